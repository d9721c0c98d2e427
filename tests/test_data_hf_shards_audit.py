"""Fixes from the data-source audit: Hugging Face and tar-shard sources decide channels and storage size from
every image's header like folders; Parquet split names; fixed 8-bit scales for 16-bit, 32-bit and float images;
`data inspect` counts what training counts; odd tar shards; `data download` re-extracts and takes `./` archives."""

import functools
import hashlib
import http.server
import io
import json
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.cli import main
from vitlab.data import download as data_download
from vitlab.data import load_data
from vitlab.data.images import open_image
from vitlab.errors import VitlabError

KW = dict(val_fraction=0, test_fraction=0, progress=False, report=False)


def _png(arr: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(arr).save(out, format="PNG")
    return out.getvalue()


def _tar(path: Path, members) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _grey(v: int, side: int = 8) -> bytes:
    return _png(np.full((side, side), v, np.uint8))


# ------------------------------------------------------------------- 1. channels and storage size
def _mixed_folder(root: Path) -> list[tuple[Path, str]]:
    """40 grey 24x24 images of class a, then 40 colour 40x40 images of class b (the colour ones after the first
    32 samples a source might peek at)."""
    rng = np.random.default_rng(0)
    out = []
    for c, shape in (("a", (24, 24)), ("b", (40, 40, 3))):
        (root / c).mkdir(parents=True)
        for k in range(40):
            p = root / c / f"{c}{k:02d}.png"
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(p)
            out.append((p, c))
    return out


def _sorted(s):
    x, y = s.train.images, s.train.labels
    order = sorted(range(len(y)), key=lambda i: (int(y[i]), x[i].float().sum().item()))
    return x[order], y[order]


def test_shards_decide_channels_and_size_from_every_header_like_folders(tmp_path):
    recs = _mixed_folder(tmp_path / "folder")
    members = []
    for i, (p, c) in enumerate(recs):
        members += [(f"{i:06d}.png", p.read_bytes()), (f"{i:06d}.cls", str("ab".index(c)).encode())]
    _tar(tmp_path / "shards" / "train-000000.tar", members)
    (tmp_path / "shards" / "classes.txt").write_text("a\nb\n")
    folder = load_data(str(tmp_path / "folder"), **KW)
    assert folder.channels == 3 and folder.train.image_size == (32, 32)
    for in_memory in (True, False):
        s = load_data(str(tmp_path / "shards"), in_memory=in_memory, **KW)
        assert s.channels == 3 and s.train.image_size == (32, 32), in_memory
    x, y = _sorted(load_data(str(tmp_path / "shards"), **KW))
    fx, fy = _sorted(folder)
    assert torch.equal(x, fx) and torch.equal(y, fy)  # the colour class stays colour, pixel for pixel


def test_hf_sources_decide_channels_and_size_from_every_header_like_folders(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    recs = _mixed_folder(tmp_path / "folder")
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    ds = datasets.Dataset.from_dict({"image": [str(p) for p, _ in recs], "label": ["ab".index(c) for _, c in recs]},
                                    features=feats)
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "disk"))
    ds.to_parquet(str(tmp_path / "pq" / "train-00000.parquet"))
    fx, fy = _sorted(load_data(str(tmp_path / "folder"), **KW))
    for spec in (f"hf:{tmp_path / 'disk'}", f"hf:{tmp_path / 'pq'}", f"hf:imagefolder:{tmp_path / 'folder'}"):
        s = load_data(spec, **KW)
        assert s.channels == 3 and s.train.image_size == (32, 32), spec
        x, y = _sorted(s)
        assert torch.equal(x, fx) and torch.equal(y, fy), spec
    # a row whose image header cannot be read is skipped and listed when loading, as a folder's file is
    bad = datasets.Dataset.from_dict({"image": [{"bytes": b"not an image", "path": None},
                                                {"bytes": _grey(9), "path": None}], "label": [0, 1]},
                                     features=feats)
    bad.save_to_disk(str(tmp_path / "bad"))
    s = load_data(f"hf:{tmp_path / 'bad'}", in_memory=False, **KW)
    assert len(s.train) == 1 and [r for _, r in s.skipped] == ["not an image (Pillow cannot identify it)"]


# ------------------------------------------------------------------------ 2. Parquet split names
def test_parquet_dev_is_validation_and_other_splits_are_left_out_with_a_note(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    root = tmp_path / "pq"
    root.mkdir()
    for split, v in (("train", 10), ("dev", 20), ("test", 30), ("extra", 40), ("unsupervised", 50)):
        datasets.Dataset.from_dict({"image": [{"bytes": _grey(v), "path": None}] * 4, "label": [0, 1, 0, 1]},
                                   features=datasets.Features({"image": datasets.Image(),
                                                               "label": datasets.Value("int64")})
                                   ).to_parquet(str(root / f"{split}-00000-of-00001.parquet"))
    s = load_data(f"hf:{root}", **KW)
    pixels = {k: sorted(set(v.images[:, 0, 0, 0].tolist())) for k, v in s.splits().items()}
    assert pixels == {"train": [10], "val": [20], "test": [30]}
    assert len(s.notes) == 1 and "extra, unsupervised not used" in s.notes[0] and "2 Parquet files" in s.notes[0]
    # a file with no split name at all is the train split when none is named train
    datasets.Dataset.from_dict({"image": [{"bytes": _grey(60), "path": None}] * 2, "label": [0, 1]},
                               features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
                               ).to_parquet(str(tmp_path / "data.parquet"))
    assert len(load_data(str(tmp_path / "data.parquet"), **KW).train) == 2


# ----------------------------------------------------------------------------- 3. 8-bit scales
def _pgm(path: Path, maxval: int, value: int) -> Path:
    path.write_bytes(f"P5 4 4 {maxval}\n".encode() + np.full(16, value, ">u2").tobytes())
    return path


def _value(path: Path) -> int:
    return int(np.asarray(open_image(path))[0, 0])


def test_deep_images_use_one_fixed_scale_never_their_content(tmp_path):
    # 16-bit: 65535 -> 255, whatever the other pixels are (a 200 stayed 200 and a 300 became 1)
    assert [_value(_pgm(tmp_path / f"p{v}.pgm", 65535, v)) for v in (0, 200, 300, 32896, 65535)] == [0, 1, 1, 128, 255]
    for v in (200, 300, 40000):
        Image.fromarray(np.full((4, 4), v, np.uint16)).save(tmp_path / f"p{v}.png")
    assert [_value(tmp_path / f"p{v}.png") for v in (200, 300, 40000)] == [1, 1, 156]
    # 32-bit integers ("I"): the same 16-bit scale, clipped
    for v in (200, 300, 40000, 100000, -5):
        Image.fromarray(np.full((4, 4), v, np.int32), "I").save(tmp_path / f"i{v}.tif")
    assert [_value(tmp_path / f"i{v}.tif") for v in (200, 300, 40000, 100000, -5)] == [1, 1, 156, 255, 0]
    # float ("F"): 0..1 -> 0..255 clipped, NaN 0; no per-image min-max stretch
    arr = np.array([[0.2, 0.4], [2.0, np.nan]], np.float32)
    Image.fromarray(arr, "F").save(tmp_path / "f.tif")
    assert np.asarray(open_image(tmp_path / "f.tif")).tolist() == [[51, 102], [255, 0]]
    Image.fromarray(np.array([[-3.0, 0.5]], np.float32), "F").save(tmp_path / "g.tif")
    assert np.asarray(open_image(tmp_path / "g.tif")).tolist() == [[0, 128]]


# ---------------------------------------------------------------------------------- 4. inspect
def test_inspect_counts_and_lists_what_training_uses(tmp_path, capsys):
    rng = np.random.default_rng(0)
    root = tmp_path / "trunc"
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for k in range(20):
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(root / c / f"{k}.jpg", quality=90)
    for k in range(5):  # the header reads, the pixels do not
        p = root / "a" / f"{k}.jpg"
        p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 3])
    assert main(["data", "inspect", str(root), "--out", str(tmp_path / "out"), "--json", "--quiet"]) == 0
    info = json.loads((tmp_path / "out" / "summary.json").read_text())
    train = load_data(str(root), progress=False, report=False)  # decoded into memory, as training is
    assert {k: sum(v) for k, v in info["counts"].items()} == {k: len(v) for k, v in train.splits().items()}
    listed = (tmp_path / "out" / "skipped_files.txt").read_text().splitlines()
    assert sorted(line.split("\t")[0] for line in listed) == sorted(str(root / "a" / f"{k}.jpg") for k in range(5))


# --------------------------------------------------------------------------------- 5. tar shards
def test_numeric_cls_is_an_index_and_a_json_string_is_a_name(tmp_path):
    folder = tmp_path / "b"
    _tar(folder / "train-0.tar", [("a.png", _grey(10)), ("a.cls", b"10"), ("b.png", _grey(20)), ("b.cls", b"2"),
                                  ("c.png", _grey(30)), ("c.cls", b"0"),
                                  ("d.png", _grey(40)), ("d.json", json.dumps({"label": "10"}).encode())])
    (folder / "classes.txt").write_text("0\n10\n2\n")
    s = load_data(str(folder), **KW)
    got = {int(x[0, 0, 0]): s.class_names[int(y)] for x, y in zip(s.train.images, s.train.labels)}
    assert got == {20: "2", 30: "0", 40: "10"}  # .cls 2 is index 2 (the class "2"); the .json string "10" a name
    assert s.skipped[0][0].endswith("/a") and "read as a class index" in s.skipped[0][1]
    assert '{"label": "10"}' in s.skipped[0][1]
    assert len(s.notes) == 1 and "a number label is a class index" in s.notes[0]


def test_repeated_member_name_is_skipped_not_paired_with_another_label(tmp_path):
    _tar(tmp_path / "s" / "train-0.tar", [("k1.png", _grey(10)), ("k1.cls", b"0"), ("k2.png", _grey(20)),
                                          ("k2.cls", b"1"), ("k1.png", _grey(111))])
    s = load_data(str(tmp_path / "s"), **KW)
    assert s.train.images[:, 0, 0, 0].tolist() == [20]
    assert len(s.skipped) == 1 and s.skipped[0][0].endswith("/k1") and "duplicate member" in s.skipped[0][1]


def test_truncated_shards_are_reported_as_truncated(tmp_path):
    whole = _tar(tmp_path / "w.tar", [("a.png", _grey(10)), ("a.cls", b"0"), ("b.png", _grey(20)), ("b.cls", b"1"),
                                      ("c.png", _grey(30)), ("c.cls", b"0")]).read_bytes()
    d = tmp_path / "d"
    d.mkdir()
    (d / "train-0.tar").write_bytes(whole)
    (d / "train-1.tar").write_bytes(whole[:1500])  # cut in the middle of a.cls's header
    (d / "train-2.tar").write_bytes(whole[:2048 + 100])  # cut in the middle of b.png's data
    (d / "train-3.tar").write_bytes(whole[:2048])  # cut at a member boundary: no end-of-archive blocks
    s = load_data(str(d), **KW)
    reasons = dict(s.skipped)
    assert len(s.train) == 3 + 1 + 1  # train-2 and train-3 keep the whole sample a
    for k in (1, 2, 3):
        assert reasons[str(d / f"train-{k}.tar")].startswith("corrupt or truncated shard"), k
    assert not any("missing" in r for r in reasons.values())  # the cut sample is covered by its shard's entry
    assert "1 samples before it kept" in reasons[str(d / "train-2.tar")]


def test_a_glob_matching_nothing_says_so(tmp_path):
    with pytest.raises(VitlabError, match="matched no file") as err:
        load_data(str(tmp_path / "nothing-*.tar"), **KW)
    assert "0 of 0" not in str(err.value)


# ----------------------------------------------------------------------------------- 6. download
@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A static HTTP server on 127.0.0.1 over tmp_path/mirror, set as VITLAB_DATA_URL."""
    root = tmp_path / "mirror"
    (root / "cifar10").mkdir(parents=True)
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("VITLAB_DATA_URL", f"http://127.0.0.1:{httpd.server_address[1]}")
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VITLAB_OFFLINE", raising=False)
    yield root / "cifar10"
    httpd.shutdown()
    httpd.server_close()


def _cifar_archive(path: Path, members_prefix: str, monkeypatch) -> None:
    """A tiny CIFAR-10 binary archive whose members start with `members_prefix` (`./` as `tar -C DIR .`)."""
    rng = np.random.default_rng(0)
    rec = b"".join(bytes([i % 10]) + rng.integers(0, 256, 3072, dtype=np.uint8).tobytes() for i in range(10))
    files = {f"data_batch_{i}.bin": rec for i in range(1, 6)} | {"test_batch.bin": rec}
    with tarfile.open(path, "w:gz") as tar:
        if members_prefix == "./":
            info = tarfile.TarInfo(".")
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(f"{members_prefix}cifar-10-batches-bin/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    md5 = hashlib.md5(path.read_bytes()).hexdigest()
    monkeypatch.setitem(data_download.RESOURCES, "cifar10", {"mirrors": ["http://unused/"], "extract": True,
                                                             "files": {path.name: md5}})


def test_download_takes_archives_made_with_tar_c_dot(mirror, tmp_path, monkeypatch):
    _cifar_archive(mirror / "cifar-10-binary.tar.gz", "./", monkeypatch)  # members ".", "./cifar-10-batches-bin/..."
    dest = data_download.download("cifar10", tmp_path / "got", progress=False)
    assert len(load_data(f"cifar10:{dest}", progress=False, report=False).test) == 10


def test_download_extracts_again_what_is_missing_or_cut_short(mirror, tmp_path, monkeypatch):
    _cifar_archive(mirror / "cifar-10-binary.tar.gz", "", monkeypatch)
    dest = data_download.download("cifar10", tmp_path / "got", progress=False)
    batches = dest / "cifar-10-batches-bin"
    # the archive stays (right MD5, not fetched again); extracted files deleted or cut short are extracted again
    for damage in (lambda: [p.unlink() for p in batches.iterdir()],
                   lambda: (batches / "data_batch_3.bin").write_bytes(b"\0" * 10)):
        damage()
        data_download.download("cifar10", tmp_path / "got", progress=False)
        assert (batches / "data_batch_3.bin").stat().st_size == 10 * 3073
    assert len(load_data(f"cifar10:{dest}", progress=False, report=False).test) == 10


@pytest.mark.parametrize("name", ["../evil.bin", "/tmp/evil.bin", "a/../../evil.bin"])
def test_download_still_refuses_paths_out_of_the_folder(mirror, tmp_path, monkeypatch, name):
    arc = mirror / "cifar-10-binary.tar.gz"
    with tarfile.open(arc, "w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    monkeypatch.setitem(data_download.RESOURCES, "cifar10", {"mirrors": ["http://unused/"], "extract": True,
                                                             "files": {arc.name: hashlib.md5(arc.read_bytes()).hexdigest()}})
    with pytest.raises(VitlabError, match="unsafe path"):
        data_download.download("cifar10", tmp_path / "got", progress=False)
