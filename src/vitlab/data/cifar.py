"""CIFAR-10 / CIFAR-100 in the official *binary* version (fixed-size records; no pickle is ever loaded).

CIFAR-10 record: 1 label byte + 3072 pixel bytes (1024 R, 1024 G, 1024 B, row-major 32x32).
CIFAR-100 record: 1 coarse label byte + 1 fine label byte + 3072 pixel bytes. A path may be the
extracted folder, its parent, or the .tar.gz archive itself (read without extracting).
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import numpy as np
import torch

from vitlab.data.dataset import DataSplits, ImageDataset
from vitlab.data.download import missing_message, search_dirs
from vitlab.errors import VitlabError

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

_LAYOUT = {
    "cifar10": {"folder": "cifar-10-batches-bin", "train": [f"data_batch_{i}.bin" for i in range(1, 6)],
                "test": ["test_batch.bin"], "names": "batches.meta.txt", "header": 1},
    "cifar100": {"folder": "cifar-100-binary", "train": ["train.bin"], "test": ["test.bin"],
                 "names": "fine_label_names.txt", "coarse_names": "coarse_label_names.txt", "header": 2},
}


def parse_records(data: bytes, name: str, coarse: bool = False, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Binary CIFAR records -> (images uint8 (N, 3, 32, 32), labels int64 (N,))."""
    header = _LAYOUT[name]["header"]
    rec = header + 3072
    if len(data) == 0 or len(data) % rec:
        raise VitlabError(f"{where or name}: {len(data)} bytes is not a whole number of {rec}-byte {name} "
                          "records; is this the binary version (not the python one)?")
    arr = np.frombuffer(data, dtype=np.uint8).reshape(-1, rec)
    label_col = 0 if (name == "cifar10" or coarse) else 1
    labels = arr[:, label_col].astype(np.int64)
    images = arr[:, header:].reshape(-1, 3, 32, 32).copy()
    return images, labels


def _read_names(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


class _Reader:
    """Reads member files from a folder or straight from the .tar.gz."""

    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path
        self.tar = None
        folder = _LAYOUT[name]["folder"]
        if path.is_file():
            try:
                self.tar = tarfile.open(path, "r:*")
            except tarfile.TarError as exc:
                raise VitlabError(f"{path} is not a readable tar archive ({exc}); pass the extracted folder") from None
            self.members = {Path(m.name).name: m for m in self.tar.getmembers() if m.isreg()}
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

    def read(self, fname: str) -> bytes:
        if self.tar:
            if fname not in self.members:
                raise VitlabError(f"{self.path} has no {fname}; is it the {self.name} binary archive?")
            with self.tar.extractfile(self.members[fname]) as fh:
                return fh.read()
        p = self.folder / fname
        if not p.is_file():
            raise VitlabError(f"missing {p}; the {self.name} folder is incomplete, download it again")
        return p.read_bytes()


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
    names_file = lay["coarse_names"] if coarse else lay["names"]
    if reader.has(names_file):
        class_names = _read_names(reader.read(names_file).decode("utf-8", "replace"))
    else:
        class_names = CIFAR10_CLASSES if name == "cifar10" else None
    parts = {}
    for split in ("train", "test"):
        xs, ys = [], []
        for fname in lay[split]:
            x, y = parse_records(reader.read(fname), name, coarse, where=f"{path}:{fname}")
            xs.append(x)
            ys.append(y)
        parts[split] = (np.concatenate(xs), np.concatenate(ys))
    num = int(max(parts["train"][1].max(), parts["test"][1].max())) + 1
    if class_names is None or len(class_names) < num:
        class_names = [f"class_{i}" for i in range(num)]
    label = f"{name}{'-coarse' if coarse else ''}"
    ds = {s: ImageDataset(torch.from_numpy(x), torch.from_numpy(y), class_names, f"{label}/{s}")
          for s, (x, y) in parts.items()}
    return DataSplits(ds["train"], None, ds["test"], list(class_names), [], label, 3)


def write_cifar_records(path: str | os.PathLike, images: np.ndarray, labels: np.ndarray,
                        coarse_labels: np.ndarray | None = None) -> None:
    """Write images (N, 3, 32, 32) uint8 in the official binary record format (tests and tools)."""
    images = np.asarray(images, dtype=np.uint8).reshape(len(images), 3072)
    cols = [np.asarray(labels, dtype=np.uint8)[:, None]]
    if coarse_labels is not None:
        cols.insert(0, np.asarray(coarse_labels, dtype=np.uint8)[:, None])
    Path(path).write_bytes(np.concatenate([*cols, images], axis=1).tobytes())
