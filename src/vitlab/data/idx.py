"""MNIST and Fashion-MNIST in their IDX form (gzip-compressed or raw), read straight into uint8 tensors."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import torch

from vitlab.data.dataset import DataSplits, ImageDataset
from vitlab.data.download import missing_message, search_dirs
from vitlab.errors import VitlabError

FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
MNIST_CLASSES = [str(i) for i in range(10)]

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}

# File-name stems of the four IDX files; both the official names and the common "x.idx3-ubyte" variant.
_STEMS = {
    ("train", "images"): ["train-images-idx3-ubyte", "train-images.idx3-ubyte"],
    ("train", "labels"): ["train-labels-idx1-ubyte", "train-labels.idx1-ubyte"],
    ("test", "images"): ["t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"],
    ("test", "labels"): ["t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"],
}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read one IDX file (gzip detected by its magic bytes) into a numpy array of its declared shape."""
    path = Path(path)
    with open(path, "rb") as fh:
        head = fh.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
    except (OSError, EOFError) as exc:
        raise VitlabError(f"cannot read IDX file {path} ({exc}); download it again") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise VitlabError(f"{path} is not an IDX file (bad magic number); expected MNIST-style IDX data")
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    ndim = data[3]
    if len(data) < 4 + 4 * ndim:
        raise VitlabError(f"{path}: IDX header is truncated; download the file again")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    count = int(np.prod(shape)) if shape else 1
    offset = 4 + 4 * ndim
    if len(data) - offset < count * dtype.itemsize:
        raise VitlabError(f"{path}: IDX data is truncated ({len(data) - offset} bytes, header says "
                          f"{count * dtype.itemsize}); download the file again")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
    return arr.astype(dtype.newbyteorder("=")) if dtype.byteorder == ">" else arr.copy()


def find_idx_files(folder: str | os.PathLike) -> dict[tuple[str, str], Path] | None:
    """The four IDX files in `folder` (".gz" or raw), or None if any is missing."""
    folder = Path(folder)
    found = {}
    for key, stems in _STEMS.items():
        for stem in stems:
            hit = next((folder / f"{stem}{ext}" for ext in (".gz", "") if (folder / f"{stem}{ext}").is_file()), None)
            if hit is not None:
                found[key] = hit
                break
        else:
            return None
    return found


def locate(name: str, root: str | os.PathLike | None = None) -> dict[tuple[str, str], Path]:
    """Find the IDX files of `name` ("mnist" or "fashion-mnist") in `root` or the standard places."""
    candidates = [Path(root).expanduser()] if root else search_dirs(name)
    for folder in candidates:
        for sub in (folder, folder / "raw", folder / name):
            files = find_idx_files(sub)
            if files:
                return files
    if root:
        raise VitlabError(f"no {name} IDX files (train-images-idx3-ubyte[.gz], ...) in {root}; "
                          f"{missing_message(name, candidates)}")
    raise VitlabError(missing_message(name, candidates))


def load_idx_dataset(name: str, root: str | os.PathLike | None = None) -> DataSplits:
    """MNIST / Fashion-MNIST with the official train (60k) and test (10k) splits, 1 x 28 x 28 uint8."""
    files = locate(name, root)
    class_names = FASHION_MNIST_CLASSES if name == "fashion-mnist" else MNIST_CLASSES
    parts = {}
    for split in ("train", "test"):
        x = read_idx(files[(split, "images")])
        y = read_idx(files[(split, "labels")])
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise VitlabError(f"{name} {split}: images {x.shape} and labels {y.shape} do not match; "
                              "check the IDX files")
        images = torch.from_numpy(np.ascontiguousarray(x.astype(np.uint8))).unsqueeze(1)
        parts[split] = ImageDataset(images, torch.from_numpy(y.astype(np.int64)), class_names, f"{name}/{split}")
    return DataSplits(parts["train"], None, parts["test"], list(class_names), [], name, 1)


def write_idx(path: str | os.PathLike, array: np.ndarray, compress: bool | None = None) -> None:
    """Write a uint8 array as an IDX file (gzip if the name ends in .gz); used by tests and tools."""
    arr = np.ascontiguousarray(array, dtype=np.uint8)
    data = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    compress = str(path).endswith(".gz") if compress is None else compress
    with (gzip.open(path, "wb") if compress else open(path, "wb")) as fh:
        fh.write(data)
