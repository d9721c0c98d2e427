"""Hugging Face `datasets` as a data source: a save_to_disk folder, Parquet files, or an imagefolder.

Spec: `hf:PATH` (a save_to_disk folder, or a .parquet file / glob / folder of them), `hf:parquet:PATH`,
`hf:imagefolder:DIR`, `hf:OWNER/NAME` (a Hub id, downloaded by `datasets`); a save_to_disk folder or a .parquet path is also recognised without `hf:`.
The image column is the first `Image` feature (else one named image/img), the label column the first
`ClassLabel` (its names become the class names; else one named label/labels/target/class). Images are
read undecoded from Arrow and decoded here, so a bad image is skipped and counted like a bad file.
`datasets` is optional: `pip install 'vitlab[hf]'`.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from vitlab.data.dataset import DataSplits, FileImageDataset
from vitlab.data.images import BadImageError, open_image, pil_to_tensor, resize_shorter_center_crop
from vitlab.data.labels import class_number_names, read_label
from vitlab.errors import VitlabError

HF_SPLITS = {"train": ("train", "training"), "val": ("validation", "val", "valid", "dev"), "test": ("test", "testing")}
IMAGE_NAMES = ("image", "img", "images", "picture")
LABEL_NAMES = ("label", "labels", "target", "class", "fine_label", "cls")
_DISK_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")


def _datasets():
    try:
        import datasets
    except ImportError:
        raise VitlabError("Hugging Face data sources need the `datasets` package; pip install 'vitlab[hf]' "
                          "(or pip install datasets)") from None
    return datasets


def _parquet_files(path: str) -> list[str]:
    p = Path(path).expanduser()
    if p.is_dir():
        return sorted(str(f) for f in p.rglob("*.parquet"))
    if glob.has_magic(path):
        return sorted(glob.glob(path))
    return [str(p)] if p.is_file() else []


def is_hf_source(source: str) -> bool:
    """`hf:...`, a save_to_disk folder, or a path to .parquet files."""
    if source.startswith("hf:"):
        return True
    p = Path(source).expanduser()
    if p.is_dir():
        return any((p / m).is_file() for m in _DISK_MARKERS)
    return source.lower().endswith(".parquet") and bool(_parquet_files(source))


def _open(spec: str, progress: bool = True):
    """(DatasetDict or Dataset, a short name) for a spec."""
    ds = _datasets()
    if not progress:
        ds.disable_progress_bars()  # the library's own bars (Arrow conversion of Parquet / image folders)
    rest = spec[3:] if spec.startswith("hf:") else spec
    kind, _, tail = rest.partition(":")
    if kind in ("imagefolder", "parquet") and tail:
        rest = tail
    else:
        kind = "parquet" if not Path(rest).expanduser().is_dir() or not any(
            (Path(rest).expanduser() / m).is_file() for m in _DISK_MARKERS) else "disk"
    path = Path(rest).expanduser()
    name = (path.parent if glob.has_magic(path.name) else path).name or str(path)
    try:
        if kind == "imagefolder":
            if not path.is_dir():
                raise VitlabError(f"hf:imagefolder needs a folder; {path} is not one")
            return ds.load_dataset("imagefolder", data_dir=str(path)), name
        if kind == "disk":
            return ds.load_from_disk(str(path)), name
        if not path.exists() and not rest.lower().endswith(".parquet") and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", rest):
            return ds.load_dataset(rest), name  # a Hub id (needs a network and the library's cache)
        files = _parquet_files(rest)
        if not files:
            raise VitlabError(f"no .parquet files at {rest}; give a save_to_disk folder, .parquet files or "
                              "hf:imagefolder:DIR")
        from vitlab.data.shards import split_of

        groups: dict[str, list[str]] = {}
        for f in files:
            groups.setdefault(split_of(f), []).append(f)
        return ds.load_dataset("parquet", data_files=groups), name
    except VitlabError:
        raise
    except Exception as exc:  # noqa: BLE001 - the library's many error types all mean "cannot read this"
        text = str(exc).strip().splitlines()
        raise VitlabError(f"cannot read Hugging Face dataset {spec} ({text[0] if text else type(exc).__name__}); "
                          "check the path (a Hub id needs a network) and that `datasets` wrote it") from None


def _columns(features) -> tuple[str, str, list[str] | None]:
    """(image column, label column, ClassLabel names or None) detected from the features."""
    datasets = _datasets()
    image = next((c for c, f in features.items() if isinstance(f, datasets.Image)), None)
    image = image or next((c for c in IMAGE_NAMES if c in features), None)
    label = next((c for c, f in features.items() if isinstance(f, datasets.ClassLabel)), None)
    label = label or next((c for c in LABEL_NAMES if c in features), None)
    if image is None or label is None:
        raise VitlabError(f"cannot tell the image and label columns apart in {list(features)}; name them "
                          "'image' (an Image feature) and 'label' (a ClassLabel)")
    feat = features[label]
    return image, label, (list(feat.names) if isinstance(feat, datasets.ClassLabel) else None)


class HFImageDataset(FileImageDataset):
    """Rows of an Arrow-backed `datasets.Dataset`, decoded on access like image files (random access, so
    workers and DDP ranks split them like files)."""

    def __init__(self, table, rows, image_col: str, labels, class_names: Sequence[str], channels: int, size: int,
                 name: str = "", *, substitute: bool = False, failures: list[tuple[str, str]] | None = None):
        self.table, self.rows, self.image_col = table, np.asarray(rows, dtype=np.int64), image_col
        super().__init__([f"{name}[{r}]" for r in self.rows.tolist()], labels, class_names, channels, size, name,
                         substitute=substitute, failures=failures)

    def raw(self, i: int):
        """The undecoded image cell of item i ({"bytes", "path"} from Arrow)."""
        return self.table[int(self.rows[i])][self.image_col]

    def load(self, i: int) -> torch.Tensor:
        """Decode item i to uint8 (C, size, size); raises BadImageError."""
        from vitlab.data.shards import decode_image_bytes

        cell, mode = self.raw(i), ("L" if self.channels == 1 else "RGB")
        if isinstance(cell, dict) and cell.get("bytes"):
            img = decode_image_bytes(cell["bytes"], self.paths[i], mode)
        elif isinstance(cell, dict) and cell.get("path"):
            img = open_image(cell["path"], mode=mode)
        else:
            raise BadImageError("missing image", self.paths[i], "empty image cell")
        return pil_to_tensor(resize_shorter_center_crop(img, self.size))

    def _copy(self, idx, labels, class_names, size: int, failures) -> HFImageDataset:
        out = HFImageDataset(self.table, self.rows[np.asarray(list(idx), dtype=np.int64)], self.image_col, labels,
                             class_names, self.channels, size, self.name, substitute=self.substitute, failures=failures)
        return out


def _split_name(key: str) -> str | None:
    return next((s for s, names in HF_SPLITS.items() if key.lower() in names), None)


def _peek(table, image_col: str, n: int = 32) -> list[tuple[int, int, str]]:
    import io

    from PIL import Image

    out = []
    for row in range(min(len(table), n)):
        cell = table[row][image_col]
        try:
            src = io.BytesIO(cell["bytes"]) if cell.get("bytes") else cell["path"]
            with Image.open(src) as img:
                out.append((*img.size, img.mode))
        except Exception:  # noqa: BLE001 - a bad image is found and listed when decoded
            continue
    return out


def load_hf(spec: str, storage_size: int | None = None, progress: bool = True) -> DataSplits:
    """Open a Hugging Face dataset as DataSplits of HFImageDataset (decoded later, in memory or streamed)."""
    from vitlab.data.files import storage_format

    datasets = _datasets()
    obj, name = _open(spec, progress)
    parts = dict(obj) if isinstance(obj, datasets.DatasetDict) else {"train": obj}
    tables, unknown = {}, []
    for key, table in parts.items():
        split = _split_name(key)
        if split is None or split in tables:
            unknown.append(key)
        else:
            tables[split] = table
    if "train" not in tables:
        raise VitlabError(f"{spec} has no train split (splits: {', '.join(parts)}); name one 'train'")
    image_col, label_col, names = _columns(tables["train"].features)
    skipped: list[tuple[str, str]] = []
    raw_labels = {}
    for split, table in tables.items():
        try:  # undecoded: {"bytes", "path"} cells (an Image feature, or a binary or path column cast to one)
            table = table.select_columns([image_col, label_col]).cast_column(image_col, datasets.Image(decode=False))
        except Exception as exc:  # noqa: BLE001 - Arrow's cast errors have many types
            raise VitlabError(f"{spec}: column {image_col!r} ({table.features[image_col]}) does not hold images "
                              f"({type(exc).__name__}); give a data set with an Image column") from None
        tables[split] = table
        raw_labels[split] = [read_label(v, f"hf:{name}/{split}[{row}]") for row, v in enumerate(table[label_col])]
    notes = []
    if names is None:
        values = {v for ys in raw_labels.values() for v in ys if v is not None}
        numbers = {v for v in values if isinstance(v, int)}
        if numbers and len(numbers) != len(values):
            raise VitlabError(f"{spec}: column {label_col!r} mixes class numbers and class names; give one kind")
        if numbers:
            names, note = class_number_names(numbers, f"{spec} (column {label_col!r})")
            notes += [note] if note else []
        else:
            names = sorted(values)
    index = {n: i for i, n in enumerate(names)}
    peek = _peek(tables["train"], image_col)
    channels, size = storage_format(peek, storage_size)
    label = f"hf:{name}"
    out = {}
    for split, table in tables.items():
        rows, ys = [], []
        for row, y in enumerate(raw_labels[split]):
            y = index.get(y, -1) if isinstance(y, str) else (-1 if y is None else y)
            if 0 <= y < len(names):
                rows.append(row)
                ys.append(y)
            else:
                skipped.append((f"{label}/{split}[{row}]", "missing label (none, or not one of the classes)"))
        out[split] = HFImageDataset(table.select_columns([image_col]), rows, image_col, ys, names, channels, size,
                                    f"{label}/{split}") if rows else None
    if unknown:
        notes.append(f"{spec}: splits {', '.join(unknown)} not used (vitlab reads train, validation and test)")
    return DataSplits(out.get("train"), out.get("val"), out.get("test"), names, skipped, label, channels, notes)


__all__ = ["HFImageDataset", "is_hf_source", "load_hf"]
