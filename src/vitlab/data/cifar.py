"""CIFAR-10 / CIFAR-100 in the official *binary* version (fixed-size records; no pickle is ever loaded).

CIFAR-10 record: 1 label byte + 3072 pixel bytes (1024 R, 1024 G, 1024 B, row-major 32x32).
CIFAR-100 record: 1 coarse label byte + 1 fine label byte + 3072 pixel bytes. A path may be the
extracted folder, its parent, or the .tar.gz archive itself (read without extracting).
"""

from __future__ import annotations

import os
import tarfile
import zlib
from pathlib import Path

import numpy as np
import torch

from vitlab.data.dataset import DataSplits, ImageDataset
from vitlab.data.download import missing_message, search_dirs
from vitlab.data.tars import open_tar
from vitlab.errors import VitlabError

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

_LAYOUT = {
    "cifar10": {"folder": "cifar-10-batches-bin", "train": [f"data_batch_{i}.bin" for i in range(1, 6)],
                "test": ["test_batch.bin"], "names": "batches.meta.txt", "header": 1},
    "cifar100": {"folder": "cifar-100-binary", "train": ["train.bin"], "test": ["test.bin"],
                 "names": "fine_label_names.txt", "coarse_names": "coarse_label_names.txt", "header": 2},
}
# Labels of the official binaries: 10 classes (CIFAR-10), 100 fine and 20 coarse (CIFAR-100).
_NUM_CLASSES = {("cifar10", False): 10, ("cifar10", True): 10, ("cifar100", False): 100, ("cifar100", True): 20}

# Limits checked against a file's (or archive member's) declared size before it is read. The largest
# official file is CIFAR-100's train.bin (153.7 MB); the official archives hold 8-9 files, ~185 MB.
MAX_RECORD_FILE_BYTES = 256 * 1024**2
MAX_NAMES_FILE_BYTES = 1024**2
MAX_ARCHIVE_MEMBERS = 64
MAX_ARCHIVE_BYTES = 512 * 1024**2


def parse_records(data: bytes, name: str, coarse: bool = False, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Binary CIFAR records -> (images uint8 (N, 3, 32, 32), labels int64 (N,))."""
    check_record_size(len(data), name, where)
    header = _LAYOUT[name]["header"]
    arr = np.frombuffer(data, dtype=np.uint8).reshape(-1, header + 3072)
    label_col = 0 if (name == "cifar10" or coarse) else 1
    labels = arr[:, label_col].astype(np.int64)
    num_classes = _NUM_CLASSES[(name, coarse)]
    if int(labels.max()) >= num_classes:
        raise VitlabError(f"{where or name}: label {int(labels.max())} but {name} has {num_classes} "
                          f"{'coarse ' if coarse else ''}classes; is this the {name} binary version?")
    images = arr[:, header:].reshape(-1, 3, 32, 32).copy()
    return images, labels


def check_record_size(size: int, name: str, where: str = "") -> None:
    """A file of `size` bytes must be whole records and within MAX_RECORD_FILE_BYTES (checked before reading)."""
    rec = _LAYOUT[name]["header"] + 3072
    if size == 0 or size % rec:
        raise VitlabError(f"{where or name}: {size} bytes is not a whole number of {rec}-byte {name} "
                          "records; is this the binary version (not the python one)?")
    if size > MAX_RECORD_FILE_BYTES:
        raise VitlabError(f"{where or name}: {size:,} bytes, over the {MAX_RECORD_FILE_BYTES:,}-byte limit of a "
                          f"{name} batch file; is this the official {name} binary version?")


def _read_names(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


class _Reader:
    """Reads member files from a folder or straight from the .tar.gz, each size checked before reading."""

    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path
        self.tar = None
        folder = _LAYOUT[name]["folder"]
        if path.is_file():
            self.tar, self.members = _open_archive(path)
        else:
            for cand in (path, path / folder):
                if (cand / _LAYOUT[name]["test"][0]).is_file():
                    self.folder = cand
                    break
            else:
                raise VitlabError(f"no {name} binary files ({_LAYOUT[name]['test'][0]}, ...) in {path} or "
                                  f"{path / folder}; {missing_message(name, [path])}")

    def has(self, fname: str) -> bool:
        return fname in self.members if self.tar else (self.folder / fname).is_file()

    def size(self, fname: str) -> int:
        """Bytes of a member file, from the tar header or the file system (nothing is read)."""
        if self.tar:
            if fname not in self.members:
                raise VitlabError(f"{self.path} has no {fname}; is it the {self.name} binary archive?")
            return self.members[fname].size
        p = self.folder / fname
        if not p.is_file():
            raise VitlabError(f"missing {p}; the {self.name} folder is incomplete, download it again")
        return p.stat().st_size

    def read(self, fname: str, max_bytes: int) -> bytes:
        size = self.size(fname)
        if size > max_bytes:
            raise VitlabError(f"{self.path}:{fname} is {size:,} bytes, over the {max_bytes:,}-byte limit; "
                              f"is this the official {self.name} binary version?")
        try:
            if self.tar:
                with self.tar.extractfile(self.members[fname]) as fh:
                    data = fh.read(size)
            else:
                with open(self.folder / fname, "rb") as fh:
                    data = fh.read(size)
        except (OSError, EOFError, tarfile.TarError, zlib.error) as exc:
            raise VitlabError(f"cannot read {fname} from {self.path} ({exc}); download it again") from None
        if len(data) != size:
            raise VitlabError(f"{self.path}:{fname} is truncated ({len(data)} of {size} bytes); download it again")
        return data


def _open_archive(path: Path) -> tuple[tarfile.TarFile, dict[str, tarfile.TarInfo]]:
    """Open a .tar(.gz) and list its regular files, refusing archives far from the official ones on the way."""
    try:
        tar = open_tar(path)  # extended headers bounded: tarfile would read a 4 GB long-name header into memory
        members, total = {}, 0
        for count, member in enumerate(tar, 1):  # headers only; stops early instead of walking a bomb
            if count > MAX_ARCHIVE_MEMBERS:
                raise VitlabError(f"{path} has more than {MAX_ARCHIVE_MEMBERS} entries; "
                                  "is it the official binary archive?")
            if member.isreg():
                total += member.size
                if total > MAX_ARCHIVE_BYTES:
                    raise VitlabError(f"{path} holds more than {MAX_ARCHIVE_BYTES:,} bytes; "
                                      "is it the official binary archive?")
                members[Path(member.name).name] = member
    except (OSError, EOFError, tarfile.TarError, zlib.error) as exc:
        raise VitlabError(f"{path} is not a readable tar archive ({exc}); pass the extracted folder") from None
    return tar, members


def load_cifar(name: str, root: str | os.PathLike | None = None, coarse: bool = False) -> DataSplits:
    """CIFAR-10 / CIFAR-100 with the official train (50k) and test (10k) splits, 3 x 32 x 32 uint8."""
    if root is None:
        for cand in search_dirs(name):
            if cand.exists():
                root = cand
                break
        else:
            raise VitlabError(missing_message(name))
    path = Path(root).expanduser()
    if not path.exists():
        raise VitlabError(f"{path} does not exist; {missing_message(name, [path])}")
    reader = _Reader(name, path)
    lay = _LAYOUT[name]
    notes: list[str] = []
    class_names = _class_names(reader, name, coarse, notes)
    parts = {}
    for split in ("train", "test"):
        xs, ys = [], []
        for fname in lay[split]:
            where = f"{path}:{fname}"
            check_record_size(reader.size(fname), name, where)  # before a byte is read
            x, y = parse_records(reader.read(fname, MAX_RECORD_FILE_BYTES), name, coarse, where)
            xs.append(x)
            ys.append(y)
        parts[split] = (np.concatenate(xs), np.concatenate(ys))
    label = f"{name}{'-coarse' if coarse else ''}"
    ds = {s: ImageDataset(torch.from_numpy(x), torch.from_numpy(y), class_names, f"{label}/{s}")
          for s, (x, y) in parts.items()}
    return DataSplits(ds["train"], None, ds["test"], list(class_names), [], label, 3, notes)


def _class_names(reader: _Reader, name: str, coarse: bool, notes: list[str]) -> list[str]:
    """The format's class count (10; 100 fine or 20 coarse), named by the names file where there is one.

    The count is never read off the labels: a folder whose labels stop below 99 (a subset, a custom set in the
    format) still has CIFAR-100's 100 classes, so its head and class numbers match every other CIFAR-100. Classes
    the names file does not name (no file, or a short one) are `class_N`, and a note says so."""
    count = _NUM_CLASSES[(name, coarse)]
    names_file = _LAYOUT[name]["coarse_names" if coarse else "names"]
    where = f"{reader.path}:{names_file}"
    if reader.has(names_file):
        given = _read_names(reader.read(names_file, MAX_NAMES_FILE_BYTES).decode("utf-8", "replace"))
    elif name == "cifar10":
        return list(CIFAR10_CLASSES)
    else:
        notes.append(f"{reader.path}: no {names_file}; its {count} classes are named class_0 .. class_{count - 1}")
        return [f"class_{i}" for i in range(count)]
    if len(given) != count:
        fill = f"; classes {len(given)} .. {count - 1} are named class_N" if len(given) < count else ", the rest unused"
        notes.append(f"{where} names {len(given)} classes, but {name} has {count}: the first {min(len(given), count)} "
                     f"are taken{fill}")
    return given[:count] + [f"class_{i}" for i in range(len(given), count)]


def write_cifar_records(path: str | os.PathLike, images: np.ndarray, labels: np.ndarray,
                        coarse_labels: np.ndarray | None = None) -> None:
    """Write images (N, 3, 32, 32) uint8 in the official binary record format (tests and tools)."""
    images = np.asarray(images, dtype=np.uint8).reshape(len(images), 3072)
    cols = [np.asarray(labels, dtype=np.uint8)[:, None]]
    if coarse_labels is not None:
        cols.insert(0, np.asarray(coarse_labels, dtype=np.uint8)[:, None])
    Path(path).write_bytes(np.concatenate([*cols, images], axis=1).tobytes())
