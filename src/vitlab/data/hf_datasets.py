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
import io
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from vitlab.data.dataset import DataSplits, FileImageDataset
from vitlab.data.images import (
    BadImageError,
    check_image_header,
    open_image,
)
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


def _parquet_split(path: str) -> str | None:
    """The split a Parquet file holds by the Hub's layouts: its name's first word (`validation-00000-of-00002`),
    else its folder's name (`train/0000.parquet`); "train", "val", "test", None for no split name, or the
    unknown word (`extra`, `unsupervised`)."""
    p = Path(path)
    word = re.split(r"[-_.]", p.name.lower(), maxsplit=1)[0]
    for candidate in (word, p.parent.name.lower()):
        if (split := _split_name(candidate)) is not None:
            return split
    return word if re.fullmatch(r"[a-z]+", word) and re.match(r"[a-z]+[-_]\d", p.name.lower()) else None


def _parquet_groups(files: list[str], spec: str) -> tuple[dict[str, list[str]], list[str]]:
    """{split: files} and notes. Files of another named split (`extra-00000.parquet`) are left out with a
    note; files with no split name are the train split when no file is named train (`data.parquet`)."""
    groups: dict[str, list[str]] = {}
    for f in files:
        groups.setdefault(_parquet_split(f) or "", []).append(f)
    plain = groups.pop("", [])
    if "train" not in groups and plain:
        groups["train"], plain = plain, []
    known = {k: v for k, v in groups.items() if k in HF_SPLITS}
    other = sorted(k for k in groups if k not in HF_SPLITS)
    left = [f for k in other for f in groups[k]] + plain
    notes = [f"{spec}: splits {', '.join(other + (['(no split name)'] if plain else []))} not used (vitlab reads "
             f"train, validation/val/valid/dev and test): {len(left)} Parquet file{'s' if len(left) != 1 else ''} "
             "left out"] if left else []
    return ({"validation" if k == "val" else k: v for k, v in known.items()}), notes


def _open(spec: str, progress: bool = True):
    """(DatasetDict or Dataset, a short name, notes) for a spec."""
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
            return ds.load_dataset("imagefolder", data_dir=str(path)), name, []
        if kind == "disk":
            return ds.load_from_disk(str(path)), name, []
        if not path.exists() and not rest.lower().endswith(".parquet") and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", rest):
            return ds.load_dataset(rest), name, []  # a Hub id (needs a network and the library's cache)
        files = _parquet_files(rest)
        if not files:
            raise VitlabError(f"no .parquet files at {rest}; give a save_to_disk folder, .parquet files or "
                              "hf:imagefolder:DIR")
        groups, notes = _parquet_groups(files, spec)
        return ds.load_dataset("parquet", data_files=groups), name, notes
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
        return self.stored.tensor(img, self.size)

    def _copy(self, idx, labels, class_names, size: int, failures) -> HFImageDataset:
        out = HFImageDataset(self.table, self.rows[np.asarray(list(idx), dtype=np.int64)], self.image_col, labels,
                             class_names, self.channels, size, self.name, substitute=self.substitute, failures=failures)
        out.stored = self.stored
        return out


def _split_name(key: str) -> str | None:
    return next((s for s, names in HF_SPLITS.items() if key.lower() in names), None)


class _BufferFile(io.RawIOBase):
    """A read-only file over a slice of an Arrow buffer. io.BytesIO would copy the whole image out of the
    memory-mapped Arrow file, while reading a header touches only its first pages."""

    def __init__(self, view: memoryview):
        super().__init__()
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self.view) - self.pos))
        memoryview(b).cast("B")[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, offset + (0, self.pos, len(self.view))[whence])
        return self.pos

    def tell(self) -> int:
        return self.pos


def _cells(batch, image_col: str):
    """(file object over the image bytes or None, path or None) of each row of an Arrow batch, bytes unread."""
    for chunk in batch.column(image_col).chunks:
        data, paths = chunk.flatten()
        bufs = data.buffers()
        width = np.int64 if str(data.type).startswith("large") else np.int32
        offsets = np.frombuffer(bufs[1], dtype=width)[data.offset:data.offset + len(data) + 1] if bufs[1] else None
        view = memoryview(bufs[2]).cast("B") if bufs[2] is not None else memoryview(b"")
        valid = data.is_valid().to_numpy(zero_copy_only=False)
        for i, path in enumerate(paths.to_pylist()):
            lo, hi = (int(offsets[i]), int(offsets[i + 1])) if offsets is not None else (0, 0)
            yield (_BufferFile(view[lo:hi]) if valid[i] and hi > lo else None), path


def _header(fh, path, name: str) -> tuple[int, int, str]:
    """(width, height, mode) of one image cell from its header; raises BadImageError."""
    from vitlab.data.shards import image_header

    if fh is not None:
        return image_header(fh, name)
    if path:
        return check_image_header(path)
    raise BadImageError("missing image", name, "empty image cell")


def _scan_headers(table, image_col: str, label: str, progress: bool):
    """Every row's image header, as a folder's files are checked (no pixel decoded): (shorter side per row,
    0 where unusable), whether any image is colour, and the skipped (name, reason) rows."""
    from tqdm.auto import tqdm

    from vitlab.data.files import GREY_MODES
    from vitlab.progress import bar_options

    shorter, colour, skipped = np.zeros(len(table), np.int64), False, []
    row = 0
    with tqdm(total=len(table), desc=f"checking images of {label}", unit="img", leave=False,
              disable=not progress or len(table) < 2000, **bar_options()) as bar:
        for batch in table.with_format("arrow").iter(batch_size=1000):
            for fh, path in _cells(batch, image_col):
                try:
                    w, h, mode = _header(fh, path, f"{label}[{row}]")
                    shorter[row], colour = min(w, h), colour or mode not in GREY_MODES
                except BadImageError as exc:
                    skipped.append((exc.path, exc.reason))
                row += 1
            bar.update(batch.num_rows)
    return shorter, colour, skipped


def load_hf(spec: str, storage_size: int | None = None, progress: bool = True,
            model_side: int | None = None) -> DataSplits:
    """Open a Hugging Face dataset as DataSplits of HFImageDataset (decoded later, in memory or streamed)."""
    from vitlab.data.files import choose_storage_size

    datasets = _datasets()
    obj, name, notes = _open(spec, progress)
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
    if names is None:
        values = {v for ys in raw_labels.values() for v in ys if v is not None}
        numbers = {v for v in values if isinstance(v, int)}
        if numbers and len(numbers) != len(values):
            raise VitlabError(f"{spec}: column {label_col!r} mixes class numbers and class names; give one kind ("
                              f"e.g. a name in {_first_row(raw_labels, lambda v: isinstance(v, str))}, a number in "
                              f"{_first_row(raw_labels, lambda v: isinstance(v, int))})")
        if numbers:
            try:
                names, note = class_number_names(numbers, f"{spec} (column {label_col!r})")
            except VitlabError as exc:  # which row: in a large set the line alone does not find it
                top = max(numbers)
                raise VitlabError(f"{exc} (first such row: {_first_row(raw_labels, lambda v: v == top)})") from None
            notes += [note] if note else []
        else:
            names = sorted(values)
    index = {n: i for i, n in enumerate(names)}
    label = f"hf:{name}"
    shorter, colour = {}, False
    for split, table in tables.items():
        shorter[split], split_colour, bad = _scan_headers(table, image_col, f"{label}/{split}", progress)
        colour = colour or split_colour
        skipped.extend(bad)
    # the folders' rule (files.storage_format) over every usable image of every split
    sides = [(int(v), int(v)) for ss in shorter.values() for v in ss if v > 0]
    channels = 3 if colour or not sides else 1
    size = choose_storage_size(sides, storage_size, model_side)
    out = {}
    for split, table in tables.items():
        rows, ys = [], []
        for row, y in enumerate(raw_labels[split]):
            y = index.get(y, -1) if isinstance(y, str) else (-1 if y is None else y)
            if shorter[split][row] == 0:
                continue  # listed by the header check
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


def _first_row(raw_labels: dict[str, list], test) -> str:
    """`split[row] (label)` of the first row whose label passes `test`, for a message that refuses a data set."""
    return next((f"{split}[{row}] ({v!r})" for split, ys in raw_labels.items() for row, v in enumerate(ys)
                 if v is not None and test(v)), "?")
