"""Loader order is a pure function of (seed, epoch); resume, DDP sharding, sizes, streaming == in memory."""

from __future__ import annotations

import torch
from PIL import Image

from vitlab.data import ImageDataset, load_data, make_loader


def _ds(n=50, size=8):
    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 1, size, size).contiguous()
    return ImageDataset(images, torch.arange(n) % 5, [str(i) for i in range(5)])


def _order(loader):
    return torch.cat([y_img[:, 0, 0, 0] for y_img, _ in loader]).tolist()


def test_order_is_function_of_seed_and_epoch():
    ds = _ds()
    a = _order(make_loader(ds, 8, shuffle=True, seed=1, epoch=0))
    assert a == _order(make_loader(ds, 8, shuffle=True, seed=1, epoch=0))
    assert a != _order(make_loader(ds, 8, shuffle=True, seed=1, epoch=1))
    assert a != _order(make_loader(ds, 8, shuffle=True, seed=2, epoch=0))
    assert sorted(a) == list(range(50))
    assert _order(make_loader(ds, 8, shuffle=False)) == list(range(50))


def test_labels_follow_images():
    ds = _ds()
    for x, y in make_loader(ds, 7, shuffle=True, seed=0):
        assert y.dtype == torch.int64 and x.dtype == torch.uint8
        assert torch.equal(y, x[:, 0, 0, 0].long() % 5)


def test_len_drop_last_and_skip_batches():
    ds = _ds()
    full = make_loader(ds, 8, shuffle=True, seed=3)
    assert len(full) == 7 and full.total_batches == 7
    assert len(make_loader(ds, 8, shuffle=True, drop_last=True)) == 6
    resumed = make_loader(ds, 8, shuffle=True, seed=3, skip_batches=4)
    assert len(resumed) == 3 and resumed.total_batches == 7
    assert _order(resumed) == _order(full)[32:]


def test_ddp_shards_are_disjoint_equal_and_cover():
    ds = _ds(n=50)
    shards = [_order(make_loader(ds, 4, shuffle=True, seed=0, rank=r, world_size=3)) for r in range(3)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == 17  # ceil(50 / 3)
    assert set().union(*map(set, shards)) == set(range(50))
    assert sum(len(s) for s in shards) == 51  # one index repeated to pad, as DistributedSampler


def test_size_argument_resizes_in_memory_batches():
    x, _ = next(iter(make_loader(_ds(size=8), 4, shuffle=False, size=12)))
    assert x.shape == (4, 1, 12, 12) and x.dtype == torch.uint8
    assert int(x[1].min()) == int(x[1].max()) == 1  # constant images stay constant


def test_streaming_folder_matches_in_memory(tmp_path):
    for c, base in (("a", 10), ("b", 120)):
        (tmp_path / c).mkdir()
        for i in range(7):
            Image.new("RGB", (30, 20), (base + i, base, 5 * i)).save(tmp_path / c / f"{i}.png")
    mem = load_data(str(tmp_path), val_fraction=0.0, test_fraction=0.0, in_memory=True, progress=False)
    disk = load_data(str(tmp_path), val_fraction=0.0, test_fraction=0.0, in_memory=False, progress=False)
    assert mem.train.in_memory and not disk.train.in_memory
    for workers in (0, 2):
        for (xm, ym), (xd, yd) in zip(make_loader(mem.train, 5, shuffle=True, seed=4),
                                      make_loader(disk.train, 5, shuffle=True, seed=4, num_workers=workers)):
            assert torch.equal(xm, xd) and torch.equal(ym, yd)
    x, _ = next(iter(make_loader(disk.train, 3, shuffle=False, size=10, num_workers=0)))
    assert x.shape == (3, 3, 10, 10)
