"""Batches of uint8 images whose order is a pure function of (seed, epoch), resumable and DDP-sharded.

In-memory data sets are batched by indexing one tensor (no per-item Python work, no workers); file
data sets stream through a torch DataLoader with worker processes decoding in parallel; tar shards
stream shard by shard when training (vitlab.data.shards.ShardStreamLoader: its own order rules).
"""

from __future__ import annotations

import math
import os

import torch
from torch.utils.data import DataLoader, Dataset

from vitlab.data.dataset import FileImageDataset, ImageDataset
from vitlab.data.preprocess import resize_crop_batch
from vitlab.errors import VitlabError


def epoch_order(n: int, shuffle: bool, seed: int = 0, epoch: int = 0) -> torch.Tensor:
    """The permutation of range(n) for one epoch; same (seed, epoch) -> same order on every machine."""
    if not shuffle:
        return torch.arange(n)
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(epoch) * 7_919 + 12_345) % (2**63 - 1))
    return torch.randperm(n, generator=g)


def padded_epoch_length(n: int, world_size: int) -> int:
    """Images in an epoch's order once padded for `world_size` processes (each rank gets as many)."""
    return math.ceil(n / world_size) * world_size


def batch_indices(n: int, batch_size: int, *, shuffle: bool, seed: int = 0, epoch: int = 0, skip_batches: int = 0,
                  drop_last: bool = False, rank: int = 0, world_size: int = 1,
                  skip_samples: int = 0) -> list[torch.Tensor]:
    """Index batches of this rank for one epoch, after skipping the first `skip_batches` of them.

    With world_size > 1 the epoch order is padded by wrapping around to a multiple of world_size (as
    torch's DistributedSampler does) and rank r takes every world_size-th index from r. `skip_samples` leaves out
    the first images of that (padded) order before it is split among the ranks: a training resumed in the middle
    of an epoch at another batch size goes on from the image where it stopped. (With the same batch size, skipping
    k batches of every rank leaves out the same k x batch x world_size images.)
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    order = epoch_order(n, shuffle, seed, epoch)
    if world_size > 1 and n:
        total = padded_epoch_length(n, world_size)
        if total > n:
            order = torch.cat([order, order[: total - n]])
    order = order[max(0, int(skip_samples)):]
    if world_size > 1 and n:
        order = order[rank::world_size]
    batches = list(torch.split(order, batch_size))
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    return batches[max(0, int(skip_batches)):]


def _resize_uint8(images: torch.Tensor, size: int) -> torch.Tensor:
    out = resize_crop_batch(images.float(), (size, size), size)
    return out.round().clamp_(0, 255).to(torch.uint8)


class TensorBatchLoader:
    """Iterates (images, labels) batches by slicing the in-memory tensors: the fast path."""

    def __init__(self, dataset: ImageDataset, batches: list[torch.Tensor], size: int | None = None,
                 total_batches: int | None = None):
        self.dataset, self.batches, self.size = dataset, batches, size
        self.total_batches = total_batches if total_batches is not None else len(batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        images, labels = self.dataset.images, self.dataset.labels
        for idx in self.batches:
            x = images.index_select(0, idx)
            if self.size is not None and tuple(x.shape[-2:]) != (self.size, self.size):
                x = _resize_uint8(x, self.size)
            yield x, labels.index_select(0, idx)


class _Decoded(Dataset):
    """Worker-side view of a file dataset: item -> (image, label, failures seen by this call, error).

    A VitlabError (an evaluation split meeting a bad file) travels back as text, so the main process
    raises it as one line instead of torch's multi-line worker traceback.
    """

    def __init__(self, ds: FileImageDataset):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i):
        before = len(self.ds.failures)
        try:
            x, y = self.ds[i]
        except VitlabError as exc:
            return None, None, self.ds.failures[before:], str(exc)
        return x, y, self.ds.failures[before:], None


def _collate(items):
    xs, ys, bad, errors = zip(*items)
    failures = [b for f in bad for b in f]
    error = next((e for e in errors if e), None)
    if error:
        return None, None, failures, error
    return torch.stack(xs), torch.tensor(ys, dtype=torch.int64), failures, None


def _worker_init(_):
    torch.set_num_threads(1)  # decoding is Pillow's work; leave the cores to the training process


class StreamingLoader:
    """Wraps a DataLoader over files; failures found by workers are recorded on the dataset."""

    def __init__(self, dataset: FileImageDataset, batches: list[torch.Tensor], num_workers: int,
                 total_batches: int | None = None):
        self.dataset, self.batches, self.num_workers = dataset, batches, num_workers
        self.total_batches = total_batches if total_batches is not None else len(batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        loader = DataLoader(_Decoded(self.dataset), batch_sampler=[b.tolist() for b in self.batches],
                            num_workers=self.num_workers, collate_fn=_collate,
                            worker_init_fn=_worker_init if self.num_workers else None,
                            prefetch_factor=4 if self.num_workers else None,
                            persistent_workers=False)
        known = {p for p, _ in self.dataset.failures}
        for x, y, bad, error in loader:
            for path, reason in bad if self.num_workers else ():  # workers hold copies: bring theirs home
                if path not in known:
                    known.add(path)
                    self.dataset.failures.append((path, reason))
            if error:
                raise VitlabError(error)
            yield x, y


def default_workers() -> int:
    """Decoding workers for streamed files: half the cores (at least 1, at most 8); the rest train."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def make_loader(dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int = 0, epoch: int = 0,
                skip_batches: int = 0, drop_last: bool = False, rank: int = 0, world_size: int = 1,
                num_workers: int | None = None, size: int | None = None, buffer: int | None = None,
                skip_samples: int = 0):
    """An iterable of (uint8 images (B, C, H, W), int64 labels (B,)) for one epoch.

    The order depends only on (seed, epoch); `skip_batches` resumes mid-epoch; rank/world_size shard
    it for DDP (each rank gets the same number of batches). `len()` = batches this iterable yields
    (`.total_batches` = batches in the whole epoch for this rank). `size`: bring images to
    size x size (shorter side + centre crop) before batching; None keeps the stored size. `buffer`: streamed
    shards' shuffle buffer (None: `shards.shuffle_buffer()`). `skip_samples`: images of the epoch's order to leave
    out before it is split among ranks and batches (`batch_indices`; not for streamed shards).
    """
    from vitlab.data.shards import ShardDataset, ShardStreamLoader

    if isinstance(dataset, ShardDataset) and shuffle:  # training on shards: stream them (see ShardStreamLoader)
        if skip_samples:
            raise ValueError("streamed shards resume by whole batches (skip_batches), not skip_samples")
        ds = dataset if size is None or size == dataset.size else dataset.with_size(size)
        workers = default_workers() if num_workers is None else int(num_workers)
        return ShardStreamLoader(ds, batch_size, seed=seed, epoch=epoch, skip_batches=skip_batches,
                                 drop_last=drop_last, rank=rank, world_size=world_size, num_workers=workers,
                                 buffer=buffer)
    n = len(dataset)
    all_batches = batch_indices(n, batch_size, shuffle=shuffle, seed=seed, epoch=epoch, skip_batches=0,
                                drop_last=drop_last, rank=rank, world_size=world_size)
    batches = all_batches[max(0, int(skip_batches)):]
    if skip_samples:
        batches = batch_indices(n, batch_size, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last, rank=rank,
                                world_size=world_size, skip_samples=skip_samples)[max(0, int(skip_batches)):]
    if isinstance(dataset, FileImageDataset):
        ds = dataset if size is None or size == dataset.size else dataset.with_size(size)
        workers = default_workers() if num_workers is None else int(num_workers)
        return StreamingLoader(ds, batches, workers, len(all_batches))
    if isinstance(dataset, ImageDataset):
        return TensorBatchLoader(dataset, batches, size, len(all_batches))
    # Any other map-style dataset of (image, label): a plain DataLoader over the same index batches.
    workers = 0 if num_workers is None else int(num_workers)
    return DataLoader(dataset, batch_sampler=[b.tolist() for b in batches], num_workers=workers)
