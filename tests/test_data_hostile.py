"""Hostile data files and folders: every reader is bounded before it allocates; folders with links are exact.

Each case is one measured failure of issue 16: a file that made vitlab allocate gigabytes, a folder walk
that never ended or counted an image several times or under the wrong label, an image that could not
be resized, and a streamed image silently replaced.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import signal
import struct
import tarfile
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.cli import main
from vitlab.data import BadImageError, load_data, make_loader, open_image, write_skipped
from vitlab.data import cifar as cifar_module
from vitlab.data import files as files_module
from vitlab.data.idx import read_idx
from vitlab.data.images import check_image_header
from vitlab.errors import VitlabError

MiB = 1024**2


# --- helpers ----------------------------------------------------------------------------------------


def one_line_error(fn) -> tuple[str, int]:
    """Run fn, expecting a one-line VitlabError; return (message, peak bytes Python allocated meanwhile)."""
    tracemalloc.start()
    try:
        with pytest.raises(VitlabError) as info:
            fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg, peak


class TookTooLong(Exception):
    """Not an OSError (TimeoutError is one): walks that swallow OSError must not swallow this."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail instead of hanging forever (the walks these tests guard against never ended)."""
    def fail(*_):
        raise TookTooLong(f"still running after {seconds} s: a folder walk that never ends?")

    old = signal.signal(signal.SIGALRM, fail)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def idx_header(shape, type_code=0x08) -> bytes:
    return bytes([0, 0, type_code, len(shape)]) + struct.pack(f">{len(shape)}I", *shape)


def write_gz(path: Path, header: bytes, zero_bytes: int) -> Path:
    """header + zero_bytes zeros, gzip-compressed in chunks (a few KB on disk per MB of zeros)."""
    with gzip.open(path, "wb") as fh:
        fh.write(header)
        block = bytes(MiB)
        while zero_bytes > 0:
            fh.write(block[:min(MiB, zero_bytes)])
            zero_bytes -= MiB
    return path


def write_mnist(folder: Path, n=20, images_shape=None, labels_shape=None, label_value=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix in ("train", "t10k"):
        x = rng.integers(0, 256, images_shape or (n, 28, 28), dtype=np.uint8)
        y = (np.arange((labels_shape or (n,))[0]) % 10).astype(np.uint8)
        if label_value is not None:
            y[-1] = label_value
        (folder / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_header(x.shape) + x.tobytes()))
        (folder / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_header(y.shape) + y.tobytes()))
    return folder


def image(path: Path, value: int = 100, size=(20, 16)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, 255 - value, 60)).save(path)
    return path


def class_folders(root: Path, classes=("a", "b"), n=5) -> Path:
    for k, c in enumerate(classes):
        for i in range(n):
            image(root / c / f"{c}{i}.png", 40 * k + 10 * i)
    return root


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def thin_png(path: Path, width=20_000_000, height=1) -> Path:
    """A valid grey PNG of width x height pixels, a few KB on disk (rows of zeros, compressed in chunks)."""
    comp = zlib.compressobj(9)
    parts = []
    for _ in range(height):
        parts.append(comp.compress(b"\x00"))  # the row's filter byte
        left = width
        while left > 0:
            parts.append(comp.compress(bytes(min(MiB, left))))
            left -= MiB
    parts.append(comp.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", b"".join(parts))
                     + png_chunk(b"IEND", b""))
    return path


def counted_paths(splits) -> list[str]:
    return [p for ds in splits.splits().values() for p in ds.paths]


# --- IDX: checked against the file before anything is allocated -----------------------------------


def test_idx_gz_declaring_huge_dims_fails_from_its_header(tmp_path):
    """The measured case: a 1.9 MB .gz whose header declares gigabytes took 4.2 GB."""
    p = write_gz(tmp_path / "train-images-idx3-ubyte.gz", idx_header((4_000_000_000, 28, 28)), 20 * MiB)
    msg, peak = one_line_error(lambda: read_idx(p))
    assert "over the" in msg and "limit" in msg and str(p) in msg
    assert peak < 5 * MiB


def test_idx_gz_holding_more_data_than_its_header_stops_reading(tmp_path):
    p = write_gz(tmp_path / "x.gz", idx_header((10, 28, 28)), 100 * MiB)  # a zip bomb behind a small header
    msg, peak = one_line_error(lambda: read_idx(p))
    assert "more IDX data than the header declares" in msg
    assert peak < 5 * MiB


def test_idx_gz_header_larger_than_deflate_can_hold(tmp_path):
    # 150 MB declared (under the limit) but 3 KB of gzip cannot expand to that: refused without reading
    p = write_gz(tmp_path / "x.gz", idx_header((200_000, 28, 28)), 1000)
    msg, peak = one_line_error(lambda: read_idx(p))
    assert "cannot hold" in msg and "truncated" in msg
    assert peak < 5 * MiB


def test_idx_gz_truncated_data(tmp_path):
    p = write_gz(tmp_path / "x.gz", idx_header((100, 28, 28)), 50 * 784)
    msg, _ = one_line_error(lambda: read_idx(p))
    assert "truncated" in msg and f"{100 * 784:,}" in msg


def test_idx_raw_with_extra_data_disagrees_with_its_header(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(idx_header((3, 2)) + bytes(6 + 100))
    msg, _ = one_line_error(lambda: read_idx(p))
    assert "more IDX data" in msg


def test_idx_raw_huge_sparse_file_is_refused_before_reading(tmp_path):
    p = tmp_path / "train-images-idx3-ubyte"
    with open(p, "wb") as fh:
        fh.write(idx_header((1_000_000, 28, 28)))
        fh.truncate(16 + 1_000_000 * 784)  # 784 MB, sparse: nothing is written
    msg, peak = one_line_error(lambda: read_idx(p))
    assert "limit" in msg and peak < 5 * MiB


def test_idx_valid_file_reads_exactly(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    (tmp_path / "x.gz").write_bytes(gzip.compress(idx_header(arr.shape) + arr.tobytes()))
    got = read_idx(tmp_path / "x.gz")
    assert got.dtype == np.uint8 and np.array_equal(got, arr) and got.flags.writeable


@pytest.mark.parametrize("case,expected", [
    ("count_mismatch", "do not match"), ("label_range", "label 200"), ("float_type", "unsigned bytes"),
])
def test_mnist_headers_checked_before_the_data_is_read(tmp_path, case, expected):
    folder = tmp_path / "m"
    if case == "count_mismatch":
        write_mnist(folder, n=20, labels_shape=(21,))
    elif case == "label_range":
        write_mnist(folder, label_value=200)
    else:
        write_mnist(folder)
        (folder / "train-images-idx3-ubyte.gz").write_bytes(
            gzip.compress(idx_header((20, 2, 2), 0x0D) + np.zeros(80, ">f4").tobytes()))
    msg, _ = one_line_error(lambda: load_data(f"mnist:{folder}", progress=False))
    assert expected in msg


def test_mnist_source_with_a_bomb_header_is_one_line(tmp_path):
    folder = write_mnist(tmp_path / "m")
    write_gz(folder / "train-images-idx3-ubyte.gz", idx_header((2_000_000_000, 28, 28)), 4 * MiB)
    write_gz(folder / "train-labels-idx1-ubyte.gz", idx_header((2_000_000_000,)), 4 * MiB)
    msg, peak = one_line_error(lambda: load_data(f"mnist:{folder}", progress=False))
    assert "limit" in msg and peak < 10 * MiB


# --- CIFAR binaries: sizes checked before reading ---------------------------------------------------


def _cifar10_folder(folder: Path, n=3, label=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        rec = np.zeros((n, 3073), np.uint8)
        rec[:, 0] = np.arange(n) % 10
        if label is not None:
            rec[-1, 0] = label
        (folder / name).write_bytes(rec.tobytes())
    return folder


def test_cifar_oversized_batch_is_refused_before_reading(tmp_path):
    folder = _cifar10_folder(tmp_path / "cifar-10-batches-bin")
    with open(folder / "data_batch_1.bin", "wb") as fh:
        fh.truncate(3073 * 100_000)  # 307 MB, sparse
    msg, peak = one_line_error(lambda: load_data(f"cifar10:{folder}", progress=False))
    assert "limit" in msg and "data_batch_1.bin" in msg
    assert peak < 5 * MiB


def test_cifar_label_outside_the_classes(tmp_path):
    folder = _cifar10_folder(tmp_path / "cifar-10-batches-bin", label=77)
    msg, _ = one_line_error(lambda: load_data(f"cifar10:{folder}", progress=False))
    assert "label 77" in msg and "10 classes" in msg


def test_cifar_archive_with_too_many_members(tmp_path):
    archive = tmp_path / "c.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for i in range(cifar_module.MAX_ARCHIVE_MEMBERS + 5):
            p = tmp_path / f"f{i}"
            p.write_bytes(b"x")
            tar.add(p, arcname=f"cifar-10-batches-bin/f{i}")
    msg, _ = one_line_error(lambda: load_data(f"cifar10:{archive}", progress=False))
    assert "entries" in msg


def test_cifar_archive_declaring_too_much_data(tmp_path, monkeypatch):
    folder = _cifar10_folder(tmp_path / "cifar-10-batches-bin")
    archive = tmp_path / "c.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-bin")
    monkeypatch.setattr(cifar_module, "MAX_ARCHIVE_BYTES", 3 * 3073 * 3)  # the limit's logic, at a small size
    msg, _ = one_line_error(lambda: load_data(f"cifar10:{archive}", progress=False))
    assert "holds more than" in msg
    monkeypatch.undo()
    assert len(load_data(f"cifar10:{archive}", val_fraction=0.0, progress=False).test) == 3


# --- CSV: bounded, every fault one line -----------------------------------------------------------


def _csv_images(tmp_path: Path) -> list[str]:
    for i in range(4):
        image(tmp_path / "img" / f"a{i}.png", 30)
        image(tmp_path / "img" / f"b{i}.png", 220)
    return [f"img/a{i}.png,cat" for i in range(4)] + [f"img/b{i}.png,dog" for i in range(4)]


def test_csv_with_a_giant_field(tmp_path):
    p = tmp_path / "list.csv"
    p.write_text("\n".join(_csv_images(tmp_path) + ["x" * 200_000 + ",cat"]) + "\n")
    msg, _ = one_line_error(lambda: load_data(str(p), progress=False))
    assert "line 9" in msg and "field larger" in msg


def test_csv_not_utf8(tmp_path):
    p = tmp_path / "list.csv"
    p.write_bytes(b"img/a0.png,caf\xe9\n")
    msg, _ = one_line_error(lambda: load_data(str(p), progress=False))
    assert "not UTF-8" in msg


def test_csv_over_the_size_limit(tmp_path, monkeypatch):
    p = tmp_path / "list.csv"
    p.write_text("\n".join(_csv_images(tmp_path)) + "\n")
    monkeypatch.setattr(files_module, "MAX_CSV_BYTES", 50)
    msg, _ = one_line_error(lambda: load_data(str(p), progress=False))
    assert "over the 50-byte limit" in msg


def test_csv_odd_labels_and_names(tmp_path):
    rows = _csv_images(tmp_path)
    rows = [r.replace(",cat", ",\u00b2").replace(",dog", "," + "9" * 5000) for r in rows]  # not plain integers
    rows.append("img/a\x00b.png,\u00b2")
    p = tmp_path / "list.csv"
    p.write_text("\n".join(rows) + "\n")
    splits = load_data(str(p), val_fraction=0.25, test_fraction=0.0, progress=False)
    assert sorted(splits.class_names) == sorted(["\u00b2", "9" * 5000])
    assert len(counted_paths(splits)) == 8
    assert any(reason.startswith("bad file name") for _, reason in splits.skipped)


def test_csv_repeated_file_counts_once_and_conflicting_labels_are_skipped(tmp_path):
    rows = _csv_images(tmp_path)
    rows += ["img/a0.png,cat", "./img/a0.png,cat"]  # the same file, the same label: counted once
    rows += ["img/b1.png,cat"]  # a dog file also listed as a cat: its label is ambiguous
    p = tmp_path / "list.csv"
    p.write_text("\n".join(rows) + "\n")
    splits = load_data(str(p), val_fraction=0.0, test_fraction=0.0, progress=False)
    paths = [os.path.realpath(q) for q in counted_paths(splits)]
    assert len(paths) == len(set(paths)) == 7
    assert os.path.realpath(tmp_path / "img" / "b1.png") not in paths
    reasons = [r for _, r in splits.skipped]
    assert sum(r.startswith("duplicate file") for r in reasons) == 2
    assert sum(r.startswith("same file in several classes") for r in reasons) == 2


# --- image folders: loop-safe walks, each image once, labels never changed by a link -------------


def test_two_self_links_neither_hang_nor_grow(tmp_path):
    """Measured: two `ln -s . x` in a class folder made `data inspect` and `train` hang."""
    root = class_folders(tmp_path / "d")
    os.symlink(".", root / "a" / "x")
    os.symlink(".", root / "a" / "y")
    with deadline(60):
        splits = load_data(str(root), val_fraction=0.0, test_fraction=0.0, progress=False)
    assert len(splits.train) == 10 and splits.train.class_counts() == [5, 5]
    listed = dict(splits.skipped)
    assert listed[str(root / "a" / "x")].startswith("link loop")
    assert listed[str(root / "a" / "y")].startswith("link loop")


def test_self_link_counts_each_image_once_across_splits(tmp_path):
    """Measured: one self-link counted each image 41 times, spread over train, val and test."""
    root = class_folders(tmp_path / "d", n=20)
    os.symlink(".", root / "a" / "again")
    with deadline(60):
        splits = load_data(str(root), val_fraction=0.2, test_fraction=0.2, progress=False)
    real = [os.path.realpath(p) for p in counted_paths(splits)]
    assert len(real) == len(set(real)) == 40
    assert sum(ds.class_counts()[0] for ds in splits.splits().values()) == 20


def test_link_to_the_parent_never_relabels_another_class(tmp_path):
    """Measured: `ln -s .. up` put class b's images under label a."""
    root = class_folders(tmp_path / "d")
    os.symlink("..", root / "a" / "up")
    with deadline(60):
        splits = load_data(str(root), val_fraction=0.0, test_fraction=0.0, progress=False)
    ds = splits.train
    for path, label in zip(ds.paths, ds.labels.tolist()):
        assert Path(os.path.realpath(path)).parent.name == ds.class_names[label], path
    assert ds.class_counts() == [5, 5]
    assert dict(splits.skipped)[str(root / "a" / "up")].startswith("link into the data folder")


def test_links_into_another_class_are_listed_not_counted_there(tmp_path):
    root = class_folders(tmp_path / "d")
    os.symlink("../b/b0.png", root / "a" / "stolen.png")  # a file link
    os.symlink("../b", root / "a" / "bees")  # a folder link
    splits = load_data(str(root), val_fraction=0.0, test_fraction=0.0, progress=False)
    assert splits.train.class_counts() == [5, 5]
    listed = dict(splits.skipped)
    assert listed[str(root / "a" / "stolen.png")].startswith("link into another class folder (b;")
    assert listed[str(root / "a" / "bees")].startswith("link into another class folder (b;")


def test_link_from_train_into_test_counts_in_test_only(tmp_path):
    root = tmp_path / "d"
    for split in ("train", "test"):
        class_folders(root / split, n=4)
    os.symlink("../../test/a/a0.png", root / "train" / "a" / "leak.png")
    splits = load_data(str(root), val_fraction=0.0, progress=False)
    assert str(root / "train" / "a" / "leak.png") not in splits.train.paths
    assert len(splits.train) == 8 and len(splits.test) == 8
    assert "test/a" in dict(splits.skipped)[str(root / "train" / "a" / "leak.png")]


def test_links_outside_the_data_folder_take_their_folders_label(tmp_path):
    """Symlink farms keep working: a link to a file outside the data folder counts under its class folder."""
    pool = tmp_path / "pool"
    for i in range(6):
        image(pool / f"p{i}.png", 30 * i)
    root = tmp_path / "farm"
    for c, picks in (("cat", (0, 1, 2)), ("dog", (3, 4, 5))):
        (root / c).mkdir(parents=True)
        for i in picks:
            os.symlink(pool / f"p{i}.png", root / c / f"p{i}.png")
    os.symlink(pool, root / "cat" / "more")  # a folder outside: walked, but its files reached twice count once
    splits = load_data(str(root), val_fraction=0.0, test_fraction=0.0, progress=False)
    ds = splits.train
    labels = {Path(p).name: ds.class_names[y] for p, y in zip(ds.paths, ds.labels.tolist())}
    assert labels["p0.png"] == "cat"
    # p3..p5 are linked from dog and (through cat/more) from cat: an ambiguous label, skipped everywhere
    assert not any(n in labels for n in ("p3.png", "p4.png", "p5.png"))
    reasons = dict(splits.skipped)
    assert reasons[str(root / "dog" / "p3.png")].startswith("same file in several classes")
    assert reasons[str(root / "cat" / "more" / "p0.png")].startswith("duplicate file")
    assert len(ds) == 3


def test_hard_link_in_two_classes_is_skipped_everywhere(tmp_path):
    root = class_folders(tmp_path / "d")
    os.link(root / "a" / "a0.png", root / "b" / "copy.png")
    splits = load_data(str(root), val_fraction=0.0, test_fraction=0.0, progress=False)
    assert splits.train.class_counts() == [4, 5]
    assert dict(splits.skipped)[str(root / "b" / "copy.png")].startswith("same file in several classes")


def test_class_folder_linked_to_another_class(tmp_path):
    root = class_folders(tmp_path / "d")
    os.symlink("a", root / "alias")
    splits = load_data(str(root), val_fraction=0.0, test_fraction=0.0, progress=False)
    assert splits.class_names == ["a", "b"] and len(splits.train) == 10
    assert any(p == str(root / "alias") and r.startswith("duplicate class folder") for p, r in splits.skipped)


def test_data_inspect_walks_link_loops_once(tmp_path, capsys):
    root = class_folders(tmp_path / "d")
    os.symlink(".", root / "a" / "x")
    os.symlink(".", root / "a" / "y")
    os.symlink("..", root / "b" / "up")
    with deadline(60):
        rc = main(["data", "inspect", str(root), "--out", str(tmp_path / "report"), "--quiet",
                   "--val-fraction", "0", "--test-fraction", "0"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "train 10" in out and "skipped 3 files (link loop: 2, link into the data folder" in out
    assert len((tmp_path / "report" / "skipped_files.txt").read_text().splitlines()) == 3


# --- images that cannot be resized sanely are bad files ---------------------------------------------


def test_long_thin_png_is_refused_from_its_header(tmp_path):
    """Measured: a valid 19 KB PNG of 20,000,000 x 1 pixels aborted train/evaluate/predict with MemoryError."""
    p = thin_png(tmp_path / "thin.png")
    assert p.stat().st_size < 100_000
    for read in (check_image_header, open_image):
        with pytest.raises(BadImageError) as info:
            read(p)
        assert info.value.kind == "extreme aspect ratio" and "20000000x1" in str(info.value)
    _, peak = one_line_error(lambda: open_image(p))
    assert peak < 5 * MiB


@pytest.mark.parametrize("in_memory", [True, False])
def test_long_thin_png_in_a_folder_is_skipped_and_counted(tmp_path, in_memory):
    root = class_folders(tmp_path / "d")
    thin_png(root / "b" / "thin.png")
    splits = load_data(str(root), val_fraction=0.2, test_fraction=0.2, in_memory=in_memory, progress=False)
    assert str(root / "b" / "thin.png") not in counted_paths(splits)
    assert dict(splits.all_skipped())[str(root / "b" / "thin.png")].startswith("extreme aspect ratio")
    for ds in splits.splits().values():
        for _ in make_loader(ds, 4, shuffle=False, num_workers=0):
            pass


def test_predict_skip_bad_skips_the_long_thin_png(tmp_path, capsys):
    from vitlab.models.registry import create_model
    from vitlab.weights import save_native

    model = create_model("custom", dim=32, depth=1, heads=4, mlp_dim=64, patch_size=4, image_size=16,
                         num_classes=2, seed=0).eval()
    save_native(model, tmp_path / "w", class_names=["a", "b"])
    good = image(tmp_path / "imgs" / "good.png")
    thin = thin_png(tmp_path / "imgs" / "thin.png")
    assert main(["predict", str(tmp_path / "w"), str(good), str(thin), "--skip-bad", "--format", "csv"]) == 0
    captured = capsys.readouterr()
    assert "good.png" in captured.out and "thin.png" not in captured.out
    assert "extreme aspect ratio" in captured.err


# --- streaming: never a silent substitute --------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _jpeg(path: Path, value: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(value)
    Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(path, quality=90)
    return path


def _two_class_jpegs(root: Path, per_class: int, step: int) -> None:
    """root/a/0.jpg ... root/b/{per_class-1}.jpg, each a distinct random image (seed step * i, + 1 for class b)."""
    for c in ("a", "b"):
        for i in range(per_class):
            _jpeg(root / c / f"{i}.jpg", step * i + (c == "b"))


def _split_folder_with_truncated_test_image(root: Path) -> Path:
    for split in ("train", "test"):
        for c in ("a", "b"):
            for i in range(4):
                _jpeg(root / split / c / f"{i}.jpg", 10 * i + (c == "b"))
    bad = root / "test" / "b" / "1.jpg"
    _truncate(bad)  # its header is fine: only decoding finds it
    return bad


def test_streaming_evaluation_split_drops_undecodable_files_up_front(tmp_path):
    bad = _split_folder_with_truncated_test_image(tmp_path / "d")
    splits = load_data(str(tmp_path / "d"), val_fraction=0.0, in_memory=False, progress=False)
    test = splits.test
    assert not test.in_memory and not test.substitute
    assert str(bad) not in test.paths and len(test) == 7
    assert dict(splits.skipped)[str(bad)].startswith("corrupt or truncated")
    labels = torch.cat([y for _, y in make_loader(test, 3, shuffle=False, num_workers=0)])
    assert labels.tolist() == test.labels.tolist()  # every image scored is its own
    assert "skipped 1 file" in write_skipped(splits, tmp_path / "run")


@pytest.mark.parametrize("workers", [0, 1])
def test_streaming_evaluation_split_never_substitutes(tmp_path, workers):
    root = tmp_path / "d"
    class_folders(root, n=6)
    splits = load_data(str(root), val_fraction=0.0, test_fraction=0.34, in_memory=False, progress=False)
    victim = Path(splits.test.paths[1])
    _truncate(victim)  # it changed after the data was loaded
    msg, _ = one_line_error(lambda: list(make_loader(splits.test, 2, shuffle=False, num_workers=workers)))
    assert str(victim) in msg and "never substitutes" in msg
    assert str(victim) in dict(splits.all_skipped())


def test_carved_validation_split_does_not_substitute(tmp_path):
    root = tmp_path / "d"
    _two_class_jpegs(root, 10, 3)
    _truncate(root / "a" / "3.jpg")
    splits = load_data(str(root), val_fraction=0.3, test_fraction=0.3, in_memory=False, progress=False)
    assert splits.train.substitute and not splits.val.substitute and not splits.test.substitute
    evaluated = splits.val.paths + splits.test.paths
    assert str(root / "a" / "3.jpg") not in evaluated
    if str(root / "a" / "3.jpg") not in splits.train.paths:  # it fell in val or test: dropped up front
        assert str(root / "a" / "3.jpg") in dict(splits.skipped)


def test_streaming_training_failures_found_by_workers_are_counted(tmp_path):
    root = tmp_path / "d"
    _two_class_jpegs(root, 6, 5)
    bad = root / "b" / "2.jpg"
    _truncate(bad)
    splits = load_data(str(root), val_fraction=0.0, test_fraction=0.0, in_memory=False, progress=False)
    seen = sum(len(y) for _, y in make_loader(splits.train, 4, shuffle=True, seed=0, num_workers=1))
    assert seen == 12  # substituted (training only) ...
    assert splits.train.failures == [(str(bad), dict(splits.train.failures)[str(bad)])]  # ... counted once
    line = write_skipped(splits, tmp_path / "run")
    assert "skipped 1 file" in line
    assert (tmp_path / "run" / "skipped_files.txt").read_text().startswith(f"{bad}\tcorrupt or truncated")


def test_scoring_the_train_split_checks_it_up_front(tmp_path):
    root = tmp_path / "d"
    _two_class_jpegs(root, 6, 7)
    bad = root / "a" / "4.jpg"
    _truncate(bad)
    splits = load_data(str(root), val_fraction=0.0, test_fraction=0.0, in_memory=False, progress=False,
                       eval_splits=("train", "val", "test"))
    assert not splits.train.substitute and str(bad) not in splits.train.paths and len(splits.train) == 11
    assert str(bad) in dict(splits.skipped)


def test_classes_from_yaml_must_be_names_or_numbers(tmp_path, capsys):
    """A few hundred bytes of nested YAML aliases under `classes:` expand without end when made into text."""
    from vitlab.cli import main
    from vitlab.data.splits import parse_classes

    assert parse_classes(["Sandal", 3]) == ["Sandal", "3"]
    with pytest.raises(VitlabError, match="each item must be a class name or number, got a list"):
        parse_classes(["Sandal", ["a", "b"]])
    levels = ['  - &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    levels += [f"  - &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 8)]
    (tmp_path / "bomb.yaml").write_text("classes:\n" + "\n".join(levels) + "\n")
    assert main(["train", "--config", str(tmp_path / "bomb.yaml"), "--data", "bundled", "--steps", "1",
                 "--out", str(tmp_path / "runs")]) == 2
    assert "classes: each item must be a class name or number" in capsys.readouterr().err
