"""Tar shards (WebDataset layout): specs, `vitlab data shard`, the same loss curve as the in-memory source,
streaming split over ranks and workers without duplicates, and bad samples skipped and counted."""

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.cli import main
from vitlab.data import load_data, make_loader, skipped_summary
from vitlab.data.idx import write_idx
from vitlab.data.shards import (
    ShardDataset,
    ShardStreamLoader,
    expand_braces,
    looks_like_shards,
    resolve_shards,
    stream_plan,
)
from vitlab.errors import VitlabError
from vitlab.train import resolve_config, train

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


def _png(arr: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(arr).save(out, format="PNG")
    return out.getvalue()


def _add(tar, name, data: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _id_image(i: int) -> np.ndarray:
    """An 8x8 grey image whose first two pixels spell its index (so a sample can be recognised in a batch)."""
    arr = np.random.default_rng(i).integers(0, 256, (8, 8), dtype=np.uint8)
    arr[0, 0], arr[0, 1] = i // 256, i % 256
    return arr


def _ids(x: torch.Tensor) -> list[int]:
    return (x[:, 0, 0, 0].long() * 256 + x[:, 0, 0, 1].long()).tolist()


def write_id_shards(folder: Path, sizes, split="train") -> int:
    """Shards of recognisable samples (label = index mod 3); returns how many samples."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "classes.txt").write_text("a\nb\nc\n")
    i = 0
    for k, n in enumerate(sizes):
        with tarfile.open(folder / f"{split}-{k:06d}.tar", "w") as tar:
            for _ in range(n):
                _add(tar, f"s{i:05d}.png", _png(_id_image(i)))
                _add(tar, f"s{i:05d}.cls", str(i % 3).encode())
                i += 1
    return i


def fashion_subset(folder: Path, n_train=512, n_test=128) -> str:
    """A small Fashion-MNIST as IDX files: the real one's first images, else the bundled copy's."""
    folder.mkdir(parents=True, exist_ok=True)
    if FMNIST_DIR.is_dir():
        def read(name, offset, n, shape):
            with gzip.open(FMNIST_DIR / f"{name}.gz") as fh:
                raw = fh.read()
            return np.frombuffer(raw, np.uint8, count=int(np.prod(shape)) * n, offset=offset).reshape(n, *shape)

        xtr, ytr = read("train-images-idx3-ubyte", 16, n_train, (28, 28)), read("train-labels-idx1-ubyte", 8, n_train, ())
        xte, yte = read("t10k-images-idx3-ubyte", 16, n_test, (28, 28)), read("t10k-labels-idx1-ubyte", 8, n_test, ())
    else:
        b = load_data("bundled", val_fraction=0, progress=False)
        xtr, ytr = b.train.images[:n_train, 0].numpy(), b.train.labels[:n_train].numpy()
        xte, yte = b.test.images[:n_test, 0].numpy(), b.test.labels[:n_test].numpy()
    for name, arr in (("train-images-idx3-ubyte", xtr), ("train-labels-idx1-ubyte", ytr),
                      ("t10k-images-idx3-ubyte", xte), ("t10k-labels-idx1-ubyte", yte)):
        write_idx(folder / name, arr)
    return f"fashion-mnist:{folder}"


def test_specs(tmp_path):
    assert expand_braces("a-{08..10}.tar") == ["a-08.tar", "a-09.tar", "a-10.tar"]
    assert expand_braces("x{0..1}-{0..1}.tar") == ["x0-0.tar", "x0-1.tar", "x1-0.tar", "x1-1.tar"]
    write_id_shards(tmp_path / "s", [3, 3, 3])
    write_id_shards(tmp_path / "s", [2], split="val")
    groups, folder = resolve_shards(str(tmp_path / "s"))
    assert folder == tmp_path / "s" and len(groups["train"]) == 3 and len(groups["val"]) == 1
    spec = str(tmp_path / "s" / "train-{000000..000001}.tar")
    assert looks_like_shards(spec) and len(resolve_shards(spec)[0]["train"]) == 2
    assert len(resolve_shards(str(tmp_path / "s" / "train-*.tar"))[0]["train"]) == 3
    both = resolve_shards(str(tmp_path / "s" / "{train,val}-*.tar"))[0]
    assert len(both["train"]) == 3 and len(both["val"]) == 1
    assert list(resolve_shards(str(tmp_path / "s" / "val-*.tar"))[0]) == ["train"]  # no training shard: all train
    (tmp_path / "folder" / "cat").mkdir(parents=True)
    (tmp_path / "folder" / "stray.tar").write_bytes(b"")
    assert not looks_like_shards(str(tmp_path / "folder"))  # class folders with a stray .tar stay a folder
    assert not looks_like_shards(str(tmp_path / "x.tar.gz"))
    s = load_data(spec, val_fraction=0.0, test_fraction=0.0, progress=False)
    assert len(s.train) == 6 and s.class_names == ["a", "b", "c"] and s.channels == 1
    with pytest.raises(VitlabError, match="not found"):
        load_data(str(tmp_path / "s" / "train-{000000..000009}.tar"), progress=False)


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["type"] == "step"]


def _cfg(tmp_path, data, name):
    return resolve_config("small-data", overrides=dict(
        data=data, model="custom", out_dir=str(tmp_path), name=name, seed=3,
        model_args=dict(dim=32, depth=1, heads=2, mlp_dim=64, patch_size=7), steps=5, batch_size=32, lr=1e-3,
        warmup_steps=1, threads=1, quiet=True, log_every=1, inception_crop=False, hflip=False,
        label_smoothing=0.0, eval_batch_size=128, ckpt_every=0))


def test_fashion_mnist_shards_train_like_the_source(tmp_path, monkeypatch, capsys):
    source = fashion_subset(tmp_path / "fashion")
    assert main(["data", "shard", source, str(tmp_path / "shards"), "--shard-size", "100", "--quiet"]) == 0
    line = capsys.readouterr().out
    assert "train 512 images in 6 shards, test 128 images in 2 shards" in line
    assert (tmp_path / "shards" / "classes.txt").read_text().splitlines()[0] == "T-shirt/top"
    # never overwrites without --force
    assert main(["data", "shard", source, str(tmp_path / "shards"), "--quiet"]) != 0
    assert "--force" in capsys.readouterr().err
    a = load_data(source, seed=3, progress=False)
    b = load_data(str(tmp_path / "shards"), seed=3, progress=False)
    assert torch.equal(a.train.images, b.train.images) and torch.equal(a.train.labels, b.train.labels)
    assert torch.equal(a.val.images, b.val.images) and a.class_names == b.class_names
    # small shards are decoded into memory: the same batches, so the same loss curve, step for step
    one = _losses(train(_cfg(tmp_path, source, "src")).run_dir)
    two = _losses(train(_cfg(tmp_path, str(tmp_path / "shards"), "shards")).run_dir)
    assert len(one) == 5 and one == two
    # streamed (forced with a zero memory budget): the documented difference is the order only
    monkeypatch.setenv("VITLAB_DATA_MEMORY_MB", "0")
    streamed = train(_cfg(tmp_path, str(tmp_path / "shards"), "stream"))
    three = _losses(streamed.run_dir)
    assert len(three) == 5 and all(np.isfinite(three)) and three != one
    assert abs(three[0] - one[0]) < 0.5  # the same data and model: a loss of the same size at step 1
    # ... and a streamed epoch holds exactly the in-memory training images, each once, in another order
    st = load_data(str(tmp_path / "shards"), seed=3, progress=False)
    assert isinstance(st.train, ShardDataset)
    xs = torch.cat([x for x, _ in make_loader(st.train, 64, shuffle=True, seed=3, num_workers=1)])
    key = lambda t: sorted(bytes(r) for r in t.flatten(1).numpy())  # noqa: E731
    assert len(xs) == len(a.train) and key(xs) == key(a.train.images)
    assert not torch.equal(xs, a.train.images)


@pytest.mark.parametrize("sizes", [[5], [3, 7], [4, 4, 4, 4, 4, 4, 4, 4, 1], [1] * 13])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_stream_plan_has_no_duplicates(sizes, world, workers):
    runs, start = [], 0
    for n in sizes:
        runs.append(np.arange(start, start + n))
        start += n
    for epoch in (0, 1):
        plans = [stream_plan(runs, seed=5, epoch=epoch, rank=r, world_size=world, workers=workers, worker=w)
                 for r in range(world) for w in range(workers)]
        got = np.concatenate(plans)
        assert len(got) == len(set(got.tolist())) == world * (start // world)  # at most world-1 left out
        per_rank = [sum(len(plans[r * workers + w]) for w in range(workers)) for r in range(world)]
        assert len(set(per_rank)) == 1  # every rank the same count: DDP steps stay in lockstep
    a = stream_plan(runs, seed=5, epoch=0, rank=0, world_size=1, workers=1, worker=0)
    b = stream_plan(runs, seed=5, epoch=1, rank=0, world_size=1, workers=1, worker=0)
    if len(sizes) > 2:
        assert a.tolist() != b.tolist()  # shard order reshuffled each epoch


@pytest.mark.parametrize("workers", [0, 2])
def test_streamed_ranks_see_each_sample_once(tmp_path, workers):
    n = write_id_shards(tmp_path / "s", [10, 10, 10, 7])
    s = load_data(str(tmp_path / "s"), val_fraction=0, test_fraction=0, in_memory=False, progress=False)
    assert isinstance(s.train, ShardDataset)
    seen, counts = [], []
    for rank in range(2):
        loader = make_loader(s.train, 4, shuffle=True, seed=1, epoch=0, rank=rank, world_size=2, num_workers=workers)
        assert isinstance(loader, ShardStreamLoader)
        batches = list(loader)
        counts.append(len(batches))
        assert len(batches) == loader.total_batches == len(loader)
        for x, y in batches:
            ids = _ids(x)
            assert [i % 3 for i in ids] == y.tolist()  # labels travel with their images
            seen.extend(ids)
    assert counts[0] == counts[1] and len(seen) == len(set(seen)) == 2 * (n // 2)
    # same seed and epoch -> same order; resuming skips exactly the first batches
    full = [_ids(x) for x, _ in make_loader(s.train, 4, shuffle=True, seed=1, epoch=2, num_workers=workers)]
    again = [_ids(x) for x, _ in make_loader(s.train, 4, shuffle=True, seed=1, epoch=2, num_workers=workers)]
    resumed = [_ids(x) for x, _ in make_loader(s.train, 4, shuffle=True, seed=1, epoch=2, skip_batches=3,
                                               num_workers=workers)]
    assert full == again and resumed == full[3:]


def write_bad_shard(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "classes.txt").write_text("a\nb\nc\n")
    with tarfile.open(folder / "train-000000.tar", "w") as tar:
        for i in range(12):
            _add(tar, f"s{i:05d}.png", _png(_id_image(i)))
            _add(tar, f"s{i:05d}.json", json.dumps({"label": "abc"[i % 3]}).encode())
        # its header is whole (image headers are checked when loading, as a folder's files are) but its pixel
        # data is cut short: found only when decoded
        bad = _png(_id_image(99))
        _add(tar, "corrupt.png", bad[:bad.index(b"IDAT") + 10])
        _add(tar, "corrupt.cls", b"0")
        _add(tar, "nolabel.png", _png(_id_image(98)))
        _add(tar, "noimage.cls", b"1")
        _add(tar, "badlabel.png", _png(_id_image(97)))
        _add(tar, "badlabel.cls", b"7")


def test_bad_samples_are_skipped_and_counted(tmp_path, capsys):
    write_bad_shard(tmp_path / "s")
    s = load_data(str(tmp_path / "s"), val_fraction=0, test_fraction=0, progress=False)  # decoded in memory
    assert len(s.train) == 12 and s.train.labels.tolist() == [i % 3 for i in range(12)]
    reasons = dict(s.skipped)
    shard = str(tmp_path / "s" / "train-000000.tar")
    assert reasons[f"{shard}/nolabel"].startswith("missing label")
    assert reasons[f"{shard}/noimage"].startswith("missing image")
    assert reasons[f"{shard}/badlabel"].startswith("bad label")
    assert reasons[f"{shard}/corrupt"].startswith(("corrupt or truncated image", "not an image"))
    assert skipped_summary(s.skipped).startswith("data: skipped 4 files")
    # streamed: the three found by the header pass are skipped up front; the corrupt image is met while
    # training, replaced by another sample (the batch count stays) and listed like a bad file
    st = load_data(str(tmp_path / "s"), val_fraction=0, test_fraction=0, in_memory=False, progress=False)
    assert len(st.train) == 13 and len(st.skipped) == 3
    batches = list(make_loader(st.train, 13, shuffle=True, seed=0, drop_last=True, num_workers=0))
    assert len(batches) == 1 and len(batches[0][1]) == 13
    assert st.all_skipped()[-1] == (f"{shard}/corrupt", reasons[f"{shard}/corrupt"])
    assert len(st.all_skipped()) == 4
    # oversized samples are refused from the header
    import vitlab.data.shards as shards

    old = shards.MAX_SAMPLE_BYTES
    shards.MAX_SAMPLE_BYTES = 10
    try:
        with pytest.raises(VitlabError, match="no usable training sample"):
            load_data(str(tmp_path / "s"), progress=False)
    finally:
        shards.MAX_SAMPLE_BYTES = old


DDP_SCRIPT = """
import json, sys, torch.distributed as dist
from vitlab.data import load_data, make_loader
dist.init_process_group("gloo")
s = load_data(sys.argv[1], val_fraction=0, test_fraction=0, in_memory=False, progress=False)
ids = [int(x[i, 0, 0, 0]) * 256 + int(x[i, 0, 0, 1]) for x, _ in
       make_loader(s.train, 4, shuffle=True, seed=0, num_workers=1)  # rank and size from the process group
       for i in range(len(x))]
parts = [None, None]
dist.all_gather_object(parts, ids)
if dist.get_rank() == 0:
    open(sys.argv[2], "w").write(json.dumps(parts))
dist.destroy_process_group()
"""


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_two_gloo_processes_split_the_shards(tmp_path):
    n = write_id_shards(tmp_path / "s", [6, 6, 5])
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(tmp_path / "ddp.py"), str(tmp_path / "s"), str(tmp_path / "ids.json")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    a, b = json.loads((tmp_path / "ids.json").read_text())
    assert len(a) == len(b) == n // 2 and not set(a) & set(b)


def test_streaming_failures_are_listed_or_one_line(tmp_path):
    write_id_shards(tmp_path / "s", [6, 6])
    st = load_data(str(tmp_path / "s"), val_fraction=0, test_fraction=0, in_memory=False, progress=False)
    gone = tmp_path / "s" / "train-000001.tar"
    gone.rename(tmp_path / "moved.tar")  # a shard lost after indexing: its samples are listed, others stand in
    batches = list(make_loader(st.train, 4, shuffle=True, seed=0, drop_last=True, num_workers=0))
    assert len(batches) == 3 and all(len(y) == 4 for _, y in batches)
    assert len(st.all_skipped()) == 6 and st.all_skipped()[0][1].startswith("unreadable file")
    (tmp_path / "s" / "train-000000.tar").unlink()  # nothing readable left: one line, from a worker too
    with pytest.raises(VitlabError, match="every sample this reader was given failed") as err:
        list(make_loader(st.train, 4, shuffle=True, seed=0, drop_last=True, num_workers=1))
    assert "\n" not in str(err.value)


def test_class_numbers_in_shards_are_bounded_and_gaps_named(tmp_path, capsys):
    folder = tmp_path / "huge"
    folder.mkdir()
    with tarfile.open(folder / "train-000000.tar", "w") as tar:
        for i, label in enumerate(["0", "1", "99999999999"]):
            _add(tar, f"{i:06d}.png", _png(_id_image(i)))
            _add(tar, f"{i:06d}.cls", label.encode())
    with pytest.raises(VitlabError, match="label 99999999999 would make 100,000,000,000 classes"):
        load_data(str(folder), progress=False)
    folder = tmp_path / "gaps"
    folder.mkdir()
    with tarfile.open(folder / "train-000000.tar", "w") as tar:
        for i in range(12):
            _add(tar, f"{i:06d}.png", _png(_id_image(i)))
            _add(tar, f"{i:06d}.cls", str(5 * (i % 2)).encode())
    s = load_data(str(folder), val_fraction=0, test_fraction=0, progress=True)
    assert s.class_names == [str(i) for i in range(6)]
    assert "4 of the 6 classes numbered 0..5 have no image (1, 2, 3, 4)" in capsys.readouterr().err
