"""MNIST and Fashion-MNIST in their IDX form (gzip-compressed or raw), read straight into uint8 tensors."""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
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


# The largest IDX file read (decoded bytes). MNIST's biggest file holds 47 MB; anything far above it is
# a broken or hostile header, refused before a byte of it is allocated.
MAX_IDX_BYTES = 256 * 1024**2
# Deflate cannot expand more than ~1032:1, so a .gz file cannot hold more than this many bytes per byte.
DEFLATE_MAX_RATIO = 1032
_CHUNK = 1 << 20


def _open_idx(path: Path):
    """The file as a binary stream (gzip detected by its magic bytes) and whether it is compressed."""
    with open(path, "rb") as fh:
        compressed = fh.read(2) == b"\x1f\x8b"
    return (gzip.open(path, "rb") if compressed else open(path, "rb")), compressed


def _read_header(fh, path: Path) -> tuple[np.dtype, tuple[int, ...]]:
    """Magic number and dimensions from an open IDX stream (positioned at the start)."""
    magic = fh.read(4)
    if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_DTYPES or not 1 <= magic[3] <= 8:
        raise VitlabError(f"{path} is not an IDX file (bad magic number); expected MNIST-style IDX data")
    ndim = magic[3]
    dims = fh.read(4 * ndim)
    if len(dims) < 4 * ndim:
        raise VitlabError(f"{path}: IDX header is truncated; download the file again")
    return np.dtype(_IDX_DTYPES[magic[2]]), struct.unpack(f">{ndim}I", dims)


def read_idx_header(path: str | os.PathLike) -> tuple[np.dtype, tuple[int, ...]]:
    """(dtype, shape) declared by an IDX file, read without touching its data."""
    path = Path(path)
    try:
        fh, _ = _open_idx(path)
        with fh:
            return _read_header(fh, path)
    except (OSError, EOFError, zlib.error) as exc:
        raise VitlabError(f"cannot read IDX file {path} ({_first_line(exc)}); download it again") from None


def _check_declared_size(path: Path, shape: tuple[int, ...], nbytes: int, compressed: bool, max_bytes: int) -> None:
    """Refuse a header whose data would be absurdly large or could not fit in the file, before allocating it."""
    shown = "x".join(str(d) for d in shape)
    if nbytes > max_bytes:
        raise VitlabError(f"{path}: IDX header declares {shown} ({nbytes:,} bytes), over the {max_bytes:,}-byte "
                          "limit; the file is broken or not MNIST-style data, download it again")
    file_size = path.stat().st_size
    room = file_size * DEFLATE_MAX_RATIO if compressed else file_size - 4 - 4 * len(shape)
    if nbytes > room:
        raise VitlabError(f"{path}: IDX header declares {shown} ({nbytes:,} bytes) but the {file_size:,}-byte file "
                          "cannot hold that much; the data is truncated, download the file again")
    if not compressed and nbytes < room:
        raise VitlabError(f"{path}: {room - nbytes:,} bytes more IDX data than the header declares ({shown}); "
                          "the header and data disagree, download the file again")


def _gzip_trailer_size(path: Path) -> int:
    """The uncompressed size (mod 2**32) a gzip file's trailer states; cheap, but only a hint."""
    with open(path, "rb") as fh:
        fh.seek(-4, os.SEEK_END)
        return struct.unpack("<I", fh.read(4))[0]


def _length_mismatch(path: Path, nbytes: int, got: int) -> VitlabError:
    if got < nbytes:
        return VitlabError(f"{path}: IDX data is truncated ({got:,} bytes, header says {nbytes:,}); "
                           "download the file again")
    return VitlabError(f"{path}: more IDX data than the header declares ({nbytes:,} bytes); the header and "
                       "data disagree, download the file again")


def _check_stream_length(fh, path: Path, nbytes: int) -> None:
    """Decompress up to nbytes + 1 bytes keeping none of them: the data's length in constant memory."""
    got = 0
    while got <= nbytes:
        chunk = fh.read(min(_CHUNK, nbytes + 1 - got))
        if not chunk:
            break
        got += len(chunk)
    if got != nbytes:
        raise _length_mismatch(path, nbytes, got)


def _read_exact(fh, path: Path, nbytes: int) -> bytearray:
    """Exactly `nbytes` of data into one buffer of that size; refuses fewer or more."""
    data = bytearray(nbytes)
    view = memoryview(data)
    got = 0
    while got < nbytes:
        n = fh.readinto(view[got:got + _CHUNK])
        if not n:
            raise _length_mismatch(path, nbytes, got)
        got += n
    if fh.read(1):
        raise _length_mismatch(path, nbytes, nbytes + 1)
    return data


def read_idx(path: str | os.PathLike, max_bytes: int | None = None) -> np.ndarray:
    """Read one IDX file (gzip detected by its magic bytes) into a numpy array of its declared shape.

    The declared size is checked against `max_bytes` (default MAX_IDX_BYTES) and the file's length
    before anything is allocated, and the data must be exactly as long as the header says.
    """
    path = Path(path)
    limit = MAX_IDX_BYTES if max_bytes is None else int(max_bytes)
    try:
        fh, compressed = _open_idx(path)
        with fh:
            dtype, shape = _read_header(fh, path)
            nbytes = math.prod(shape) * dtype.itemsize
            _check_declared_size(path, shape, nbytes, compressed, limit)
            start = 4 + 4 * len(shape)
            if compressed and _gzip_trailer_size(path) != (start + nbytes) % 2**32:
                # the trailer disagrees with the header: measure the real length before allocating
                _check_stream_length(fh, path, nbytes)
                fh.seek(start)
            data = _read_exact(fh, path, nbytes)
    except (OSError, EOFError, zlib.error) as exc:
        raise VitlabError(f"cannot read IDX file {path} ({_first_line(exc)}); download it again") from None
    arr = np.frombuffer(data, dtype=dtype).reshape(shape)  # shares the buffer: no second copy
    return arr.astype(dtype.newbyteorder("=")) if dtype.byteorder == ">" else arr


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


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


def _check_pair(name: str, split: str, images: Path, labels: Path) -> None:
    """Images (N, H, W) and labels (N,), both unsigned bytes: checked from the headers, before reading data."""
    x_type, x_shape = read_idx_header(images)
    y_type, y_shape = read_idx_header(labels)
    if len(x_shape) != 3 or len(y_shape) != 1 or x_shape[0] != y_shape[0] or x_shape[0] == 0:
        raise VitlabError(f"{name} {split}: images {x_shape} and labels {y_shape} do not match (expected "
                          "(N, H, W) and (N,)); check the IDX files")
    if 0 in x_shape[1:]:  # a run trained up to the first batch and failed inside the resize ("unexpected failure")
        raise VitlabError(f"{images}: images of {x_shape[1]}x{x_shape[2]} pixels (the header declares an empty side); "
                          "check the IDX files, or download them again")
    if x_type != np.uint8 or y_type != np.uint8:
        raise VitlabError(f"{name} {split}: IDX data of type {x_type}/{y_type}, expected unsigned bytes; "
                          "check the IDX files")


def load_idx_dataset(name: str, root: str | os.PathLike | None = None) -> DataSplits:
    """MNIST / Fashion-MNIST with the official train (60k) and test (10k) splits, 1 x 28 x 28 uint8."""
    files = locate(name, root)
    class_names = FASHION_MNIST_CLASSES if name == "fashion-mnist" else MNIST_CLASSES
    parts = {}
    for split in ("train", "test"):
        _check_pair(name, split, files[(split, "images")], files[(split, "labels")])
        x = read_idx(files[(split, "images")])
        y = read_idx(files[(split, "labels")])
        if int(y.max()) >= len(class_names):
            raise VitlabError(f"{files[(split, 'labels')]}: label {int(y.max())} but {name} has "
                              f"{len(class_names)} classes; check the IDX files")
        images = torch.from_numpy(x).unsqueeze(1)  # uint8 already (checked), writable, no copy
        parts[split] = ImageDataset(images, torch.from_numpy(y.astype(np.int64)), class_names, f"{name}/{split}")
    return DataSplits(parts["train"], None, parts["test"], list(class_names), [], name, 1)


def write_idx(path: str | os.PathLike, array: np.ndarray, compress: bool | None = None) -> None:
    """Write a uint8 array as an IDX file (gzip if the name ends in .gz); used by tests and tools."""
    arr = np.ascontiguousarray(array, dtype=np.uint8)
    data = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    compress = str(path).endswith(".gz") if compress is None else compress
    with (gzip.open(path, "wb") if compress else open(path, "wb")) as fh:
        fh.write(data)
