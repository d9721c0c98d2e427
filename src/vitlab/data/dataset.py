"""Datasets of uint8 images: in memory (one tensor, the fast path) or as files decoded on demand.

`DataSplits` bundles train / val / test with the class names and the list of skipped files.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from vitlab.data.images import BadImageError, StoredSquare, one_line, open_image
from vitlab.errors import VitlabError
from vitlab.progress import bar_options


def _as_labels(labels) -> torch.Tensor:
    return torch.as_tensor(np.asarray(labels, dtype=np.int64) if not isinstance(labels, torch.Tensor) else labels,
                           dtype=torch.int64).reshape(-1)


class ImageDataset(Dataset):
    """Images held in memory as one uint8 tensor (N, C, H, W); item i is (images[i], label)."""

    in_memory = True

    def __init__(self, images: torch.Tensor, labels, class_names: Sequence[str], name: str = "",
                 paths: Sequence[str] | None = None):
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"images must be a uint8 tensor (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        self.images = images
        self.labels = _as_labels(labels)
        if len(self.labels) != len(images):
            raise ValueError(f"{len(images)} images but {len(self.labels)} labels")
        self.class_names = list(class_names)
        self.name = name
        self.paths = list(paths) if paths is not None else None
        self.original_sizes: list[tuple[int, int]] | None = None  # (w, h) of the files, when from files

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], int(self.labels[i])

    @property
    def channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def image_size(self) -> tuple[int, int]:
        """Stored (height, width); every item has this size."""
        return int(self.images.shape[2]), int(self.images.shape[3])

    def class_counts(self) -> list[int]:
        return torch.bincount(self.labels, minlength=len(self.class_names)).tolist()

    def subset(self, indices) -> ImageDataset:
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        paths = [self.paths[i] for i in idx.tolist()] if self.paths is not None else None
        out = ImageDataset(self.images[idx], self.labels[idx], self.class_names, self.name, paths)
        if self.original_sizes is not None:
            out.original_sizes = [self.original_sizes[i] for i in idx.tolist()]
        return out

    def relabel(self, labels, class_names: Sequence[str]) -> ImageDataset:
        """Same images with new labels and class names (for class subsets)."""
        out = ImageDataset(self.images, labels, class_names, self.name, self.paths)
        out.original_sizes = self.original_sizes
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, n={len(self)}, classes={len(self.class_names)}, "
                f"size={self.image_size}, channels={self.channels})")


class FileImageDataset(ImageDataset):
    """Image files decoded on access (Pillow), brought to `size` x `size` (shorter side, centre crop).

    Every file that fails to decode is recorded in `failures` (path, reason), which the loader and
    `write_skipped` report. With `substitute` (the training split, set by load_data) the next readable
    item takes its place, so a long run never stops on one bad file; without it (evaluation splits,
    checked up front by `verify`) a failure is a one-line VitlabError: an evaluation never silently
    scores a different image.
    """

    in_memory = False
    stored = StoredSquare()  # the centre square, anti-aliased; load_data(squash=, antialias=) sets another

    def __init__(self, paths: Sequence[str], labels, class_names: Sequence[str], channels: int, size: int,
                 name: str = "", original_sizes: Sequence[tuple[int, int]] | None = None, *,
                 substitute: bool = False, failures: list[tuple[str, str]] | None = None):
        self.paths = [str(p) for p in paths]
        self.labels = _as_labels(labels)
        if len(self.labels) != len(self.paths):
            raise ValueError(f"{len(self.paths)} paths but {len(self.labels)} labels")
        self.class_names = list(class_names)
        self._channels = int(channels)
        self.size = int(size)
        self.name = name
        self.original_sizes = list(original_sizes) if original_sizes is not None else None
        self.substitute = substitute
        self.failures: list[tuple[str, str]] = [] if failures is None else failures  # shared by views of it

    @property
    def channels(self) -> int:
        return self._channels

    @property
    def image_size(self) -> tuple[int, int]:
        return self.size, self.size

    @property
    def images(self):  # noqa: D401 - explicit error instead of AttributeError deep inside user code
        raise VitlabError("this dataset streams files; call .materialize() to hold its images in memory")

    def load(self, i: int) -> torch.Tensor:
        """Decode item i to uint8 (C, size, size); raises BadImageError."""
        img = open_image(self.paths[i], mode="L" if self._channels == 1 else "RGB")
        return self.stored.tensor(img, self.size)

    def _record(self, exc: BadImageError) -> None:
        if exc.path not in {p for p, _ in self.failures}:
            self.failures.append((exc.path, exc.reason))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not self.substitute:
            try:
                return self.load(i), int(self.labels[i])
            except BadImageError as exc:
                self._record(exc)
                raise VitlabError(f"{self.name or 'dataset'}: cannot decode {one_line(exc.path)} ({exc.reason}) and this "
                                  "split never substitutes another image; fix or remove the file, then load "
                                  "the data again") from None
        n = len(self)
        for k in range(min(n, 64)):
            j = (i + k) % n
            try:
                return self.load(j), int(self.labels[j])
            except BadImageError as exc:
                self._record(exc)
        raise VitlabError(f"{self.name or 'dataset'}: 64 unreadable images in a row near index {i}; check the files")

    def _copy(self, idx, labels, class_names, size: int, failures) -> FileImageDataset:
        sizes = [self.original_sizes[i] for i in idx] if self.original_sizes is not None else None
        out = FileImageDataset([self.paths[i] for i in idx], labels, class_names, self._channels, size, self.name,
                               sizes, substitute=self.substitute, failures=failures)
        out.stored = self.stored
        return out

    def subset(self, indices) -> FileImageDataset:
        idx = np.asarray(indices, dtype=np.int64)
        return self._copy(idx, self.labels[torch.as_tensor(idx)], self.class_names, self.size, None)

    def relabel(self, labels, class_names: Sequence[str]) -> FileImageDataset:
        return self._copy(range(len(self)), labels, class_names, self.size, self.failures)

    def with_size(self, size: int) -> FileImageDataset:
        return self._copy(range(len(self)), self.labels, self.class_names, size, self.failures)

    def _decode_each(self, work, desc: str, progress: bool, threads: int | None) -> list[tuple[str, str]]:
        """Run work(i) -> None | (path, reason) over every item in threads; the (path, reason) failures."""
        from tqdm.auto import tqdm

        n = len(self)
        skipped: list[tuple[str, str]] = []
        threads = threads or min(8, (os.cpu_count() or 2))
        with ThreadPoolExecutor(threads) as pool:  # Pillow releases the GIL while decoding
            it = pool.map(work, range(n), chunksize=64)
            for res in tqdm(it, total=n, desc=f"{desc} {self.name or 'images'}", unit="img",
                            disable=not progress or n < 500, leave=False, **bar_options()):
                if res is not None:
                    skipped.append(res)
        return skipped

    def verify(self, progress: bool = True, threads: int | None = None) -> tuple[FileImageDataset, list]:
        """Decode every file once (nothing kept); returns (dataset without the failing files, their
        (path, reason)). Evaluation splits that stream are checked so, and so never need to substitute."""
        ok = np.zeros(len(self), dtype=bool)

        def work(i: int):
            try:
                self.load(i)
            except BadImageError as exc:
                return exc.path, exc.reason
            ok[i] = True
            return None

        skipped = self._decode_each(work, "checking", progress, threads)
        return (self if ok.all() else self.subset(np.flatnonzero(ok))), skipped

    def materialize(self, progress: bool = True, threads: int | None = None) -> tuple[ImageDataset, list]:
        """Decode every file once into one uint8 tensor; returns (in-memory dataset, skipped (path, reason))."""
        n = len(self)
        out = torch.empty((n, self._channels, self.size, self.size), dtype=torch.uint8)
        ok = np.zeros(n, dtype=bool)

        def work(i: int):
            try:
                out[i] = self.load(i)
            except BadImageError as exc:
                return exc.path, exc.reason
            ok[i] = True
            return None

        skipped = self._decode_each(work, "decoding", progress, threads)
        keep = np.flatnonzero(ok)
        idx = torch.as_tensor(keep)
        ds = ImageDataset(out[idx] if len(keep) < n else out, self.labels[idx], self.class_names, self.name,
                          [self.paths[i] for i in keep])
        if self.original_sizes is not None:
            ds.original_sizes = [self.original_sizes[i] for i in keep]
        return ds, skipped

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, n={len(self)}, classes={len(self.class_names)}, "
                f"size={self.image_size}, channels={self.channels}, streaming)")


@dataclass
class DataSplits:
    """A data set ready for training: splits, class names, channels and the files that were skipped."""

    train: ImageDataset | None
    val: ImageDataset | None
    test: ImageDataset | None
    class_names: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    name: str = ""
    channels: int = 3
    notes: list[str] = field(default_factory=list)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def splits(self) -> dict[str, ImageDataset]:
        """The splits that exist, by name."""
        return {k: v for k, v in (("train", self.train), ("val", self.val), ("test", self.test)) if v is not None}

    def identity(self) -> dict[str, Any]:
        """What tells this data apart when the same source string may name other data (a relative path read from
        another folder, files changed on disk): the classes and each split's size. Training checkpoints and the
        studies record it, and a resume compares it (`identity_difference`)."""
        return {"classes": list(self.class_names), "images": {k: len(v) for k, v in self.splits().items()}}

    def all_skipped(self) -> list[tuple[str, str]]:
        """Files skipped while loading plus those that failed later while streaming."""
        seen, out = set(), []
        for ds in [None, *self.splits().values()]:
            items = self.skipped if ds is None else getattr(ds, "failures", [])
            for path, reason in items:
                if path not in seen:
                    seen.add(path)
                    out.append((path, reason))
        return out

    def summary(self) -> str:
        parts = [f"{k} {len(v)}" for k, v in self.splits().items()]
        return (f"{self.name}: {self.num_classes} classes, {', '.join(parts)} images, "
                f"{self.channels} channel{'s' if self.channels != 1 else ''}")


def identity_difference(before: dict[str, Any], now: dict[str, Any]) -> str | None:
    """How two `DataSplits.identity()` records differ, in words (`classes [..] -> [..]`, `train 90 -> 95 images`);
    None when they do not."""
    if before == now:
        return None
    if before.get("classes") != now.get("classes"):
        return f"classes {before.get('classes')} -> {now.get('classes')}"
    was, new = before.get("images") or {}, now.get("images") or {}
    return ", ".join(f"{k} {was.get(k, 0)} -> {new.get(k, 0)} images"
                     for k in ("train", "val", "test") if was.get(k, 0) != new.get(k, 0)) or "splits differ"


def skipped_summary(skipped: Sequence[tuple[str, str]], listing: str | os.PathLike | None = None) -> str:
    """One line: how many files were skipped (unreadable, bad, or links not followed) and why, and where the list is."""
    if not skipped:
        return "data: no files skipped"
    kinds = Counter(reason.split(" (")[0].split(":")[0] for _, reason in skipped)
    detail = ", ".join(f"{k}: {v}" for k, v in kinds.most_common())
    where = f"; list in {listing}" if listing else ""
    n = len(skipped)
    return f"data: skipped {n} file{'s' if n != 1 else ''} ({detail}){where}"


def write_skipped(splits: DataSplits, run_dir: str | os.PathLike) -> str:
    """Write `skipped_files.txt` (path<TAB>reason per line) into the run folder; return the summary line."""
    skipped = splits.all_skipped()
    if not skipped:
        return skipped_summary(skipped)
    path = Path(run_dir) / "skipped_files.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for p, reason in skipped:
            fh.write(f"{one_line(p)}\t{one_line(reason)}\n")  # a newline in a name must not split a line
    return skipped_summary(skipped, path)
