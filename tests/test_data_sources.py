"""Every data source, checked against files written here in the official byte formats (or the real files)."""

from __future__ import annotations

import gzip
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data import load_data, read_source
from vitlab.data.download import RESOURCES, missing_message
from vitlab.errors import VitlabError

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FMNIST_NAMES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


def _idx_bytes(arr: np.ndarray) -> bytes:
    """IDX as specified on yann.lecun.com/exdb/mnist: 0,0,type 0x08 (ubyte),ndim, big-endian dims, data."""
    return bytes([0, 0, 0x08, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape) + arr.tobytes()


def _write_mnist_like(folder: Path, n_train=30, n_test=10, gz=True, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    data = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        y = (np.arange(n) % 10).astype(np.uint8)
        for kind, arr in (("images-idx3", x), ("labels-idx1", y)):
            name = f"{prefix}-{kind}-ubyte"
            raw = _idx_bytes(arr)
            if gz:
                (folder / f"{name}.gz").write_bytes(gzip.compress(raw))
            else:
                (folder / name).write_bytes(raw)
        data[prefix] = (x, y)
    return data


@pytest.mark.parametrize("gz", [True, False])
def test_idx_from_folder(tmp_path, gz):
    data = _write_mnist_like(tmp_path / "m", gz=gz)
    splits = load_data(f"mnist:{tmp_path / 'm'}", val_fraction=0.0)
    assert splits.class_names == [str(i) for i in range(10)] and splits.channels == 1
    assert torch.equal(splits.train.images[:, 0], torch.from_numpy(data["train"][0]))
    assert splits.train.labels.tolist() == data["train"][1].tolist()
    assert torch.equal(splits.test.images[:, 0], torch.from_numpy(data["t10k"][0]))
    fm = load_data(f"fashion-mnist:{tmp_path / 'm'}", val_fraction=0.0)
    assert fm.class_names == FMNIST_NAMES


def test_idx_folder_given_as_plain_path(tmp_path):
    _write_mnist_like(tmp_path / "fashion", gz=True)
    assert load_data(str(tmp_path / "fashion"), val_fraction=0.0).class_names == FMNIST_NAMES
    _write_mnist_like(tmp_path / "digits28", gz=True)
    with pytest.raises(VitlabError, match="mnist:"):
        load_data(str(tmp_path / "digits28"))


def test_idx_truncated_file_is_clear_error(tmp_path):
    _write_mnist_like(tmp_path / "m", gz=False)
    p = tmp_path / "m" / "train-images-idx3-ubyte"
    p.write_bytes(p.read_bytes()[:1000])
    with pytest.raises(VitlabError, match="truncated"):
        load_data(f"mnist:{tmp_path / 'm'}")


def test_missing_dataset_message_names_download(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_DATA", str(tmp_path))
    monkeypatch.setattr("vitlab.data.download.SYSTEM_DIR", tmp_path / "system")
    with pytest.raises(VitlabError) as info:
        load_data("mnist")
    msg = str(info.value)
    assert "vitlab data download mnist" in msg and "ossci-datasets.s3.amazonaws.com/mnist" in msg
    assert "\n" not in msg
    assert "cifar-10-binary.tar.gz" in missing_message("cifar10")
    assert RESOURCES["cifar10"]["files"]["cifar-10-binary.tar.gz"] == "c32a1d4ab5d03f1284b67883e8d87530"


@pytest.mark.skipif(not FMNIST_DIR.is_dir(), reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
def test_fashion_mnist_installed_copy():
    splits = load_data("fashion-mnist", val_fraction=0.1, seed=0)
    assert splits.class_names == FMNIST_NAMES
    assert len(splits.train) + len(splits.val) == 60000 and len(splits.test) == 10000
    assert splits.train.images.shape[1:] == (1, 28, 28) and splits.train.images.dtype == torch.uint8
    assert splits.test.class_counts() == [1000] * 10
    assert splits.val.class_counts() == [600] * 10  # 10% of 6000 per class, stratified
    # first test image, read independently with gzip + numpy
    with gzip.open(FMNIST_DIR / "t10k-images-idx3-ubyte.gz") as fh:
        first = np.frombuffer(fh.read()[16:16 + 784], np.uint8).reshape(28, 28)
    assert torch.equal(splits.test.images[0, 0], torch.from_numpy(first.copy()))


def _cifar_records(n, classes, fine=False, seed=0):
    rng = np.random.default_rng(seed)
    imgs = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)  # HWC, as a user would think of them
    labels = (np.arange(n) % classes).astype(np.uint8)
    rows = []
    for i in range(n):
        planes = imgs[i].transpose(2, 0, 1).reshape(-1)  # R plane, G plane, B plane (row-major)
        head = bytes([labels[i] // 5, labels[i]]) if fine else bytes([labels[i]])
        rows.append(head + planes.tobytes())
    return b"".join(rows), imgs, labels


def test_cifar10_binary_folder_and_archive(tmp_path):
    folder = tmp_path / "c10" / "cifar-10-batches-bin"
    folder.mkdir(parents=True)
    all_imgs = []
    for i in range(1, 6):
        data, imgs, _ = _cifar_records(4, 10, seed=i)
        (folder / f"data_batch_{i}.bin").write_bytes(data)
        all_imgs.append(imgs)
    data, test_imgs, test_labels = _cifar_records(6, 10, seed=9)
    (folder / "test_batch.bin").write_bytes(data)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (folder / "batches.meta.txt").write_text("\n".join(names) + "\n\n")
    for src in (tmp_path / "c10", folder):
        s = load_data(f"cifar10:{src}", val_fraction=0.0)
        assert s.class_names == names and s.channels == 3
        assert len(s.train) == 20 and len(s.test) == 6
        # pixel (y=3, x=5) of test image 2, channel G
        assert int(s.test.images[2, 1, 3, 5]) == int(test_imgs[2, 3, 5, 1])
        assert s.test.labels.tolist() == test_labels.tolist()
        assert torch.equal(s.train.images[:4].permute(0, 2, 3, 1), torch.from_numpy(all_imgs[0]))
    archive = tmp_path / "cifar-10-binary.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-bin")
    s = load_data(f"cifar10:{archive}", val_fraction=0.0)
    assert int(s.test.images[2, 1, 3, 5]) == int(test_imgs[2, 3, 5, 1])


def test_cifar100_fine_and_coarse(tmp_path):
    folder = tmp_path / "cifar-100-binary"
    folder.mkdir()
    data, imgs, fine = _cifar_records(12, 100, fine=True, seed=1)
    (folder / "train.bin").write_bytes(data)
    data_t, _, fine_t = _cifar_records(5, 100, fine=True, seed=2)
    (folder / "test.bin").write_bytes(data_t)
    (folder / "fine_label_names.txt").write_text("\n".join(f"fine{i}" for i in range(100)))
    (folder / "coarse_label_names.txt").write_text("\n".join(f"coarse{i}" for i in range(20)))
    s = load_data(f"cifar100:{tmp_path}", val_fraction=0.0)
    assert len(s.class_names) == 100 and s.train.labels.tolist() == fine.tolist()
    assert int(s.train.images[7, 2, 31, 0]) == int(imgs[7, 31, 0, 2])
    c = load_data(f"cifar100-coarse:{tmp_path}", val_fraction=0.0)
    assert c.class_names[0] == "coarse0" and c.train.labels.tolist() == (fine // 5).tolist()


def test_cifar_wrong_record_size(tmp_path):
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        (folder / name).write_bytes(b"\x00" * 3000)
    with pytest.raises(VitlabError, match="3073-byte"):
        load_data(f"cifar10:{folder}")


def test_digits_matches_scikit_learn():
    from sklearn.datasets import load_digits

    ref = load_digits()
    s = load_data("digits", val_fraction=0.1, test_fraction=0.1, seed=0)
    assert s.channels == 1 and s.train.images.shape[1:] == (1, 8, 8)
    total = len(s.train) + len(s.val) + len(s.test)
    assert total == len(ref.target) == 1797
    counts = np.bincount(ref.target)
    got = np.array(s.train.class_counts()) + np.array(s.val.class_counts()) + np.array(s.test.class_counts())
    assert got.tolist() == counts.tolist()
    # 16 -> 255, 8 -> 128 (rounded x * 255 / 16)
    vals = set(torch.unique(s.train.images).tolist())
    assert vals <= {round(v * 255 / 16) for v in range(17)}


def test_bundled_subset_is_real_fashion_mnist():
    s = load_data("bundled", val_fraction=0.1)
    assert s.class_names == FMNIST_NAMES and s.channels == 1
    assert len(s.train) + len(s.val) == 5000 and len(s.test) == 1000
    assert s.test.class_counts() == [100] * 10
    if FMNIST_DIR.is_dir():
        with gzip.open(FMNIST_DIR / "t10k-images-idx3-ubyte.gz") as fh:
            first = np.frombuffer(fh.read()[16:16 + 784], np.uint8).reshape(28, 28)
        with gzip.open(FMNIST_DIR / "t10k-labels-idx1-ubyte.gz") as fh:
            label0 = fh.read()[8]
        # the bundled test split keeps file order, so its first image of class label0 is the file's first image
        idx = int((s.test.labels == label0).nonzero()[0])
        assert torch.equal(s.test.images[idx, 0], torch.from_numpy(first.copy()))


def _photo(path: Path, value: int, size=(40, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, 255 - value, 0)).save(path)


def test_folder_with_split_folders(tmp_path):
    for split, n in (("train", 5), ("val", 2), ("test", 3)):
        for cls, v in (("boots", 20), ("sandals", 120), ("shoes", 220)):
            for i in range(n):
                _photo(tmp_path / split / cls / f"{i}.jpg", v)
    s = load_data(str(tmp_path), storage_size=24, progress=False)
    assert s.class_names == ["boots", "sandals", "shoes"]
    assert [len(s.train), len(s.val), len(s.test)] == [15, 6, 9]
    assert s.train.images.shape[1:] == (3, 24, 24) and s.channels == 3
    assert s.val.class_counts() == [2, 2, 2]
    # colour survived: boots are (20, 235, 0) (JPEG: approximately)
    boot = s.train.images[s.train.labels == 0][0].float().mean(dim=(1, 2))
    assert abs(boot[0] - 20) < 6 and abs(boot[1] - 235) < 6


def test_folder_storage_size_is_median_shorter_side(tmp_path):
    for i, size in enumerate([(40, 30), (60, 50), (90, 70)]):
        _photo(tmp_path / "a" / f"{i}.png", 10, size)
        _photo(tmp_path / "b" / f"{i}.png", 200, size)
    raw = read_source(str(tmp_path), progress=False)
    assert raw.train.size == 50
    grey = tmp_path / "grey"
    for c in "xy":
        for i in range(3):
            (grey / c).mkdir(parents=True, exist_ok=True)
            Image.new("L", (20, 20), 9).save(grey / c / f"{i}.png")
    assert load_data(str(grey), progress=False).channels == 1


def test_csv_with_split_column_and_integer_labels(tmp_path):
    rows = []
    for i in range(12):
        _photo(tmp_path / "im" / f"{i}.png", 10 * i, (16, 16))
        rows.append(f"{tmp_path / 'im' / f'{i}.png'},{i % 3},{'test' if i >= 9 else 'train'}")
    (tmp_path / "d.csv").write_text("\n".join(rows))
    s = load_data(str(tmp_path / "d.csv"), val_fraction=0.0, progress=False)
    assert s.class_names == ["0", "1", "2"]
    assert len(s.train) == 9 and len(s.test) == 3
    assert s.test.labels.tolist() == [0, 1, 2]


def test_unknown_source():
    with pytest.raises(VitlabError, match="unknown data source"):
        load_data("no-such-source-xyz")


def test_download_code_checks_md5_and_extracts_safely(tmp_path, monkeypatch):
    """The real download path, fed from a file:// mirror (no network here)."""
    import hashlib
    import io

    from vitlab.data import download as dl

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    folder = tmp_path / "src" / "cifar-10-batches-bin"
    folder.mkdir(parents=True)
    for i in range(1, 6):
        (folder / f"data_batch_{i}.bin").write_bytes(_cifar_records(2, 10, seed=i)[0])
    (folder / "test_batch.bin").write_bytes(_cifar_records(3, 10)[0])
    archive = mirror / "cifar-10-binary.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-bin")
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    fake = {"cifar10": {"mirrors": [mirror.as_uri() + "/"], "files": {"cifar-10-binary.tar.gz": md5}, "extract": True}}
    monkeypatch.setattr(dl, "RESOURCES", fake)
    dest = dl.download("cifar10", tmp_path / "dest", progress=False)
    s = load_data(f"cifar10:{dest}", val_fraction=0.0)
    assert len(s.train) == 10 and len(s.test) == 3

    fake["cifar10"]["files"]["cifar-10-binary.tar.gz"] = "0" * 32  # wrong checksum: refused, nothing kept
    with pytest.raises(VitlabError, match="MD5"):
        dl.download("cifar10", tmp_path / "dest2", progress=False)
    assert not (tmp_path / "dest2" / "cifar-10-binary.tar.gz").exists()

    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../outside.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(VitlabError, match="unsafe path"):
        dl._safe_extract(evil, tmp_path / "x")
    assert not (tmp_path / "outside.txt").exists()
