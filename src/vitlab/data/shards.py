"""Tar shards in the WebDataset layout as a data source, read and written; training streams them.

A shard is a plain .tar whose members are grouped by key: `000123.png` + `000123.cls` (or `.jpg`,
`.webp`, ..., and `.json` holding a "label"). The stdlib `tarfile` reads them: one up-front pass over the
headers gives every sample's byte range and label (bad samples are skipped and listed there, like bad
files in folders), so evaluation can read samples by offset and training can stream whole shards
forward; the `webdataset` package is not needed (its pipeline hides counts, which DDP needs equal).
"""

from __future__ import annotations

import glob
import io
import json
import os
import re
import tarfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from vitlab.data.dataset import DataSplits, FileImageDataset
from vitlab.data.images import (
    IMAGE_EXTENSIONS,
    BadImageError,
    header_mode,
    pil_open,
)
from vitlab.data.labels import MAX_CLASSES, class_number_names
from vitlab.data.tars import TarHeaderTooLarge, open_tar
from vitlab.errors import VitlabError
from vitlab.progress import bar_options

IMAGE_EXTS = tuple(e.lstrip(".") for e in IMAGE_EXTENSIONS)
LABEL_EXTS = ("cls", "cls2", "class", "label", "target")  # the class index (or name) as text
SPLIT_NAMES = {"train": ("train", "training"), "val": ("val", "valid", "validation"), "test": ("test", "testing")}
CLASS_FILES = ("classes.txt", "classes.json")
MAX_SAMPLE_BYTES = 64 * 1024**2  # an image member larger than this is an "oversized sample"
MAX_LABEL_BYTES = 64 * 1024  # a label or .json member larger than this is a bad label
# classes.txt / classes.json: a million classes (vitlab.limits.MAX_NUM_CLASSES) of names up to 60 bytes
MAX_CLASS_FILE_BYTES = 64 * 1024**2
DEFAULT_SHUFFLE_BUFFER = 2000  # samples held per streaming worker to mix neighbouring shards' samples


@dataclass(frozen=True, slots=True)
class ShardSample:
    """Where one sample's image lies: the shard, its key, the byte offset and length of the image member."""

    shard: str
    key: str
    offset: int
    nbytes: int

    @property
    def name(self) -> str:
        """How the sample is named in skipped-file lists: SHARD/KEY."""
        return f"{self.shard}/{self.key}"


# ------------------------------------------------------------------------------------------ specs
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_LIST = re.compile(r"\{([^{}]*,[^{}]*)\}")


def expand_braces(spec: str) -> list[str]:
    """`train-{000000..000003}.tar` -> the four names (zero-padded like the first bound); `{a,b}` lists and
    several braces expand too (as the `braceexpand` package that webdataset uses)."""
    m = _RANGE.search(spec)
    lst = _LIST.search(spec)
    if lst and (not m or lst.start() < m.start()):
        return [n for alt in lst.group(1).split(",") for n in expand_braces(spec[: lst.start()] + alt + spec[lst.end():])]
    if not m:
        return [spec]
    lo, hi = int(m.group(1)), int(m.group(2))
    if hi < lo or hi - lo > 10_000_000:
        raise VitlabError(f"bad shard range {m.group(0)} in {spec}: write {{FIRST..LAST}} with FIRST <= LAST")
    width = len(m.group(1))
    out: list[str] = []
    for i in range(lo, hi + 1):
        out.extend(expand_braces(spec[: m.start()] + str(i).zfill(width) + spec[m.end():]))
    return out


def looks_like_shards(source: str) -> bool:
    """A shard spec: names a .tar (or a {a..b} range / glob of them), or a folder of .tar files (with no
    subfolders, or with a classes.txt / classes.json: a class-folder data set with a stray .tar stays one)."""
    if re.search(r"\.tar\b(?!\.)", source.lower()) and (
            Path(source).is_file() or _RANGE.search(source) or _LIST.search(source) or glob.has_magic(source)):
        return True
    p = Path(source).expanduser()
    if not p.is_dir():
        return False
    entries = [f for f in p.iterdir() if not f.name.startswith(".")]
    if not any(f.is_file() and f.suffix.lower() == ".tar" for f in entries):
        return False
    return not any(f.is_dir() for f in entries) or any((p / c).is_file() for c in CLASS_FILES)


def split_of(name: str) -> str:
    """The split a shard belongs to by its file name prefix (`val-000001.tar` -> "val"); else "train"."""
    head = re.split(r"[-_.]", Path(name).name.lower(), maxsplit=1)[0]
    return next((s for s, names in SPLIT_NAMES.items() if head in names), "train")


def resolve_shards(source: str) -> tuple[dict[str, list[str]], Path]:
    """{split: shard paths} and the folder holding them (of the first shard). Shards go to splits by their
    name prefix (train-, val-, test-; no prefix: train); when none is a training shard, all are."""
    p = Path(source).expanduser()
    if p.is_dir():
        names = sorted(str(f) for f in p.iterdir() if f.is_file() and f.suffix.lower() == ".tar")
        folder = p
    else:
        names = []
        for part in expand_braces(str(p)):
            names.extend(sorted(glob.glob(part)) if glob.has_magic(part) else [part])
        if not names:
            raise VitlabError(f"no shard matches {source}: the pattern matched no file; check the --data spec")
        missing = [n for n in names if not Path(n).is_file()]
        if missing:
            raise VitlabError(f"shard {missing[0]} not found ({len(missing)} of {len(names)} missing); "
                              "check the --data spec")
        folder = Path(names[0]).parent
    groups: dict[str, list[str]] = {}
    for f in names:
        groups.setdefault(split_of(f), []).append(f)
    return (groups if "train" in groups else {"train": names}), folder


def read_class_file(folder: Path) -> list[str] | None:
    """Class names from classes.txt (one per line) or classes.json (a list, or {name: index}) in `folder`."""
    txt, js = folder / "classes.txt", folder / "classes.json"
    try:
        path = txt if txt.is_file() else js
        if path.is_file() and path.stat().st_size > MAX_CLASS_FILE_BYTES:  # the size first: it is read whole
            raise ValueError(f"{path.name} is {path.stat().st_size:,} bytes, over the {MAX_CLASS_FILE_BYTES:,} "
                             "bytes a list of class names needs")
        if txt.is_file():
            return [line.rstrip("\r") for line in txt.read_text(encoding="utf-8").split("\n") if line.strip()]
        if js.is_file():
            data = json.loads(js.read_text(encoding="utf-8"))
            if isinstance(data, dict):
                return [name for name, _ in sorted(data.items(), key=lambda kv: int(kv[1]))]
            return [str(x) for x in data]
    except (OSError, ValueError, TypeError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
        raise VitlabError(f"cannot read the class names in {folder} ({exc}); fix or remove the classes file") from None
    return None


# ------------------------------------------------------------------------------------ scanning
def _read_member(tar: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    fh = tar.extractfile(info)
    return fh.read() if fh is not None else b""


def _label_of(raw: bytes, ext: str):
    """An int or a str label from a label member or a .json member; raises ValueError."""
    text = raw.decode("utf-8").strip()
    if ext == "json":
        obj = json.loads(text)
        for k in ("label", "cls", "class", "target", "class_name"):
            if isinstance(obj, dict) and k in obj and isinstance(obj[k], (int, str)):
                return obj[k]
        raise ValueError("no label in the .json member")
    if not text:  # an empty .cls: as a name '' it made every other sample's number a "mix" and refused the set
        raise ValueError("empty label member")
    return int(text) if re.fullmatch(r"-?[0-9]+", text) else text  # ASCII digits: int() also reads '١' as 1


def _group(tar: tarfile.TarFile) -> tuple[dict[str, dict[str, tarfile.TarInfo]], dict[str, str], int, str | None]:
    """Members by sample key (`dir/000123.seg.png` -> key `dir/000123`, extension `seg.png`), the keys whose
    member name is repeated ({key: name}), the end of the last member's data in the file, and the oversized
    extended header that stopped the listing (vitlab.data.tars), if one did."""
    groups: dict[str, dict[str, tarfile.TarInfo]] = {}
    repeated: dict[str, str] = {}
    end, bad_header = 0, None
    try:
        infos = list(tar)
    except TarHeaderTooLarge as exc:  # the members listed before it are whole: kept, as for other damage
        infos, bad_header = list(tar.members), str(exc)
    for info in infos:
        end = max(end, info.offset_data + (info.size if info.isfile() else 0))
        if not info.isfile():
            continue
        folder, _, base = info.name.rpartition("/")
        if base.startswith(".") or "." not in base:
            continue
        stem, ext = base.split(".", 1)
        members = groups.setdefault(f"{folder}/{stem}" if folder else stem, {})
        if ext.lower() in members:
            repeated.setdefault(f"{folder}/{stem}" if folder else stem, info.name)
        members[ext.lower()] = info
    return groups, repeated, end, bad_header


def _damage(tar: tarfile.TarFile, path: str, end: int) -> str | None:
    """Where and how a shard is cut off or damaged, or None. tarfile ends its member list silently at a header that is cut off or
    garbled anywhere but at the start, so what follows the last header read must be the end-of-archive blocks
    (zeros), and every member's data must lie inside the file."""
    size = os.path.getsize(path)
    if end > size:
        return f"the last member is cut off at byte {size}"
    with open(path, "rb") as fh:
        fh.seek(tar.offset)
        tail = fh.read(2 * tarfile.BLOCKSIZE)
    if not tail:
        return f"it ends at byte {size} without the end-of-archive blocks"
    if tail.strip(b"\0"):
        return f"a header cut off or unreadable at byte {tar.offset}"
    return None


def image_header(fh, name: str) -> tuple[int, int, str]:
    """(width, height, mode) of an image held in a binary file object, from its header only, refused as a
    file's header is (images.check_image_header); raises BadImageError."""
    from vitlab.data.images import check_image_size

    try:
        with pil_open(fh) as img:  # reads the header only, of the formats vitlab reads
            w, h, mode = *img.size, header_mode(img)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise BadImageError("image too large", name, "possible decompression bomb") from None
    except UnidentifiedImageError:
        raise BadImageError("not an image", name, "Pillow cannot identify it") from None
    except Exception as exc:  # noqa: BLE001 - a broken header of any kind
        text = str(exc).strip()
        raise BadImageError("corrupt image", name, text.splitlines()[0][:80] if text else type(exc).__name__) from None
    check_image_size(name, w, h)
    return w, h, mode


@dataclass
class ShardScan:
    """What one pass over a shard's headers found: samples, their raw labels, the image headers' shorter
    sides and whether any is colour (for the storage format), and skipped (name, reason)."""

    samples: list[ShardSample]
    labels: list
    shorter: list[int]
    colour: bool
    skipped: list[tuple[str, str]]


def _sample(tar: tarfile.TarFile, path: str, key: str, members: dict, out: ShardScan) -> str | None:
    """Add one sample to `out`; the reason it is skipped otherwise."""
    from vitlab.data.files import GREY_MODES

    name = f"{path}/{key}"
    image = next((members[e] for e in members if e.rsplit(".", 1)[-1] in IMAGE_EXTS), None)
    label_ext = next((e for e in (*LABEL_EXTS, "json") if e in members), None)
    if image is None:
        return "missing image (no image member in the sample)"
    if label_ext is None:
        return "missing label (no .cls or .json member)"
    if image.size > MAX_SAMPLE_BYTES or image.size == 0:
        return f"oversized or empty sample ({image.size} bytes, limit {MAX_SAMPLE_BYTES})"
    if members[label_ext].size > MAX_LABEL_BYTES:
        return f"bad label (.{label_ext} member of {members[label_ext].size} bytes)"
    try:
        label = _label_of(_read_member(tar, members[label_ext]), label_ext)
    except (ValueError, UnicodeDecodeError) as exc:
        return f"bad label ({str(exc).splitlines()[0][:80]})"
    try:
        w, h, mode = image_header(tar.extractfile(image), name)
    except BadImageError as exc:
        return exc.reason
    out.samples.append(ShardSample(path, key, image.offset_data, image.size))
    out.labels.append(label)
    out.shorter.append(min(w, h))
    out.colour = out.colour or mode not in GREY_MODES
    return None


def _before_damage(groups: dict[str, dict[str, tarfile.TarInfo]], size: int) -> dict[str, dict[str, tarfile.TarInfo]]:
    """The samples of a damaged shard that are whole: every member inside the file, and the last sample read
    (which the damage may have cut short) only with both an image and a label."""
    keep = {k: m for k, m in groups.items() if all(i.offset_data + i.size <= size for i in m.values())}
    if keep:
        last = next(reversed(keep))
        members = keep[last]
        if not any(e.rsplit(".", 1)[-1] in IMAGE_EXTS for e in members) or not any(
                e in members for e in (*LABEL_EXTS, "json")):
            del keep[last]
    return keep


def scan_shard(path: str) -> ShardScan:
    """One pass over a shard's headers (and each image's header): its samples, labels and skipped entries."""
    out = ShardScan([], [], [], False, [])
    try:
        with open_tar(path, "r:") as tar:  # extended headers bounded (vitlab.data.tars)
            groups, repeated, end, bad_header = _group(tar)
            damage = bad_header or _damage(tar, path, end)
            if damage:  # samples cut by the damage are covered by the shard's own entry
                groups = _before_damage(groups, os.path.getsize(path))
            for key, members in groups.items():
                if key in repeated:
                    out.skipped.append((f"{path}/{key}", f"duplicate member ({repeated[key]} appears more than "
                                        "once in the shard; which image and label belong together is unclear)"))
                elif (reason := _sample(tar, path, key, members, out)) is not None:
                    out.skipped.append((f"{path}/{key}", reason))
            if damage:
                out.skipped.append((path, f"corrupt or truncated shard ({damage}; {len(out.samples)} samples before it kept)"))
    except (tarfile.TarError, OSError, EOFError) as exc:
        # a damaged shard: the samples read before the damage are kept, the rest are listed as one entry
        out.skipped.append((path, f"corrupt shard ({str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__}; "
                                  f"{len(out.samples)} samples before it kept)"))
    return out


def decode_image_bytes(data: bytes, name: str, mode: str | None) -> Image.Image:
    """Decode an image held in memory exactly as images.open_image decodes a file; bad data is a BadImageError."""
    from vitlab.data.images import decode_image

    return decode_image(io.BytesIO(data), name, mode)


def read_bytes(sample: ShardSample, fh=None) -> bytes:
    """The image member's bytes (from an open file handle of its shard when given)."""
    if fh is None:
        with open(sample.shard, "rb") as f:
            f.seek(sample.offset)
            return f.read(sample.nbytes)
    fh.seek(sample.offset)
    return fh.read(sample.nbytes)


# ------------------------------------------------------------------------------------- dataset
class ShardDataset(FileImageDataset):
    """Samples in tar shards, decoded on access like image files (same failures, substitution and sizes).

    `load(i)` reads one sample by its byte offset (evaluation, `materialize`, `verify`); training with
    shuffling streams whole shards instead (`ShardStreamLoader`, chosen by `make_loader`).
    """

    def __init__(self, samples: Sequence[ShardSample], labels, class_names: Sequence[str], channels: int, size: int,
                 name: str = "", *, substitute: bool = False, failures: list[tuple[str, str]] | None = None):
        self.samples = list(samples)
        super().__init__([s.name for s in self.samples], labels, class_names, channels, size, name,
                         substitute=substitute, failures=failures)
        self._runs: list[np.ndarray] | None = None

    def decode(self, data: bytes, i: int) -> torch.Tensor:
        img = decode_image_bytes(data, self.paths[i], "L" if self.channels == 1 else "RGB")
        return self.stored.tensor(img, self.size)

    def load(self, i: int) -> torch.Tensor:
        """Decode sample i to uint8 (C, size, size); raises BadImageError."""
        try:
            data = read_bytes(self.samples[i])
        except OSError as exc:
            raise BadImageError("unreadable file", self.paths[i], exc.strerror or str(exc)) from None
        return self.decode(data, i)

    def _copy(self, idx, labels, class_names, size: int, failures) -> ShardDataset:
        out = ShardDataset([self.samples[i] for i in idx], labels, class_names, self.channels, size, self.name,
                           substitute=self.substitute, failures=failures)
        out.stored = self.stored
        return out

    def shard_runs(self) -> list[np.ndarray]:
        """Item indices grouped by shard (shards in first-seen order, items by offset): the streaming units."""
        if self._runs is None:
            n, ids = len(self.samples), {}
            shard = np.fromiter((ids.setdefault(s.shard, len(ids)) for s in self.samples), np.int64, n)
            offset = np.fromiter((s.offset for s in self.samples), np.int64, n)
            order = np.lexsort((offset, shard))
            self._runs = np.split(order, np.flatnonzero(np.diff(shard[order])) + 1) if n else []
        return self._runs


def _class_names(raw_labels: list, given: list[str] | None, where: str) -> tuple[list[str], dict, str | None]:
    """Class names, a raw-label -> index map and a note on classes without images (or None): the classes file,
    else the labels (class numbers 0..K-1, `labels.class_number_names`, or sorted names)."""
    if given is not None:
        index = {name: i for i, name in enumerate(given)}
        index.update({i: i for i in range(len(given))})
        return given, index, None
    ints = {x for x in raw_labels if isinstance(x, int) and not isinstance(x, bool) and x >= 0}
    strs = sorted({x for x in raw_labels if isinstance(x, str)})
    if ints and strs:
        raise VitlabError("the shards mix class numbers and class names; add a classes.txt beside them "
                          "(one name per line, in class-number order)")
    if strs:
        return strs, {name: i for i, name in enumerate(strs)}, None
    names, note = class_number_names(ints, where)
    return names, {i: i for i in range(len(names))}, note


def _culprits(found: dict[str, ShardScan]) -> str:
    """The samples that make a shard set's labels refused (`_class_names`): the first with a class number too large
    for an index, else the first with a class name and the first with a class number."""
    def first(test) -> str | None:
        return next((f"{s.name} ({y!r})" for scan in found.values() for s, y in zip(scan.samples, scan.labels)
                     if test(y)), None)

    def number(y) -> bool:
        return isinstance(y, int) and not isinstance(y, bool) and y >= 0

    huge = first(lambda y: number(y) and y >= MAX_CLASSES)
    if huge:
        return f"first such sample: {huge}; fix or remove it"
    return f"e.g. a name in {first(lambda y: isinstance(y, str))}, a number in {first(number)}"


def _bad_label(y, names: list[str]) -> str:
    """Why a raw label is not a class, saying how to name a class whose name is a number."""
    if isinstance(y, int) and str(y) in names:
        return (f"bad label ({y} is read as a class index and there are {len(names)} classes; for the class named "
                f"'{y}' write a .json member {{\"label\": \"{y}\"}})")
    return f"bad label ({y!r} is not one of the {len(names)} classes)"


def _numeric_names_note(names: list[str], raw: list, where: str) -> str | None:
    """A note when classes.txt names classes by numbers other than their own index while .cls numbers are
    used: those numbers are indices (the WebDataset convention, and what `vitlab data shard` writes)."""
    if not any(isinstance(y, int) and not isinstance(y, bool) for y in raw):
        return None
    odd = [n for i, n in enumerate(names) if re.fullmatch(r"-?\d+", n.strip()) and int(n) != i]
    if not odd:
        return None
    return (f"{where}: classes.txt names classes by numbers ({', '.join(odd[:3])}{', ...' if len(odd) > 3 else ''}) "
            "but a number label is a class index (a line of classes.txt, counted from 0), never a name; a .json "
            "label given as a string (\"10\") is a name")


def _storage(scans: list[ShardScan], requested: int | None, model_side: int | None = None) -> tuple[int, int]:
    """(channels, storage size) by the folders' rule (files.storage_format) over every sample's image header."""
    from vitlab.data.files import choose_storage_size

    sides = [(v, v) for scan in scans for v in scan.shorter]  # only the shorter side counts
    channels = 3 if any(scan.colour for scan in scans) or not sides else 1
    return channels, choose_storage_size(sides, requested, model_side)


def _scan_all(shards: list[str], progress: bool) -> dict[str, ShardScan]:
    """Scan every shard (several at a time: header reads wait on storage), with a bar for many shards."""
    from tqdm.auto import tqdm

    found: dict[str, ShardScan] = {}
    with ThreadPoolExecutor(min(8, (os.cpu_count() or 2) * 2)) as pool:
        for path, scan in tqdm(zip(shards, pool.map(scan_shard, shards)), total=len(shards), leave=False,
                               desc="reading shard and image headers", unit="shard",
                               disable=not progress or len(shards) < 5, **bar_options()):
            found[path] = scan
    return found


def load_shards(source: str, storage_size: int | None = None, progress: bool = True,
                model_side: int | None = None) -> DataSplits:
    """Read a shard spec or folder: one pass over every shard's headers and every image's header; no pixel
    decoded."""
    groups, folder = resolve_shards(source)
    found = _scan_all([s for v in groups.values() for s in v], progress)
    skipped = [item for scan in found.values() for item in scan.skipped]
    raw = [y for scan in found.values() for y in scan.labels]
    label = f"shards:{folder.name or folder}"
    given = read_class_file(folder)
    try:
        names, index, note = _class_names(raw, given, f"{label} (.cls labels)")
    except VitlabError as exc:  # which sample: in a set of a million samples the line alone does not find it
        raise VitlabError(f"{exc} ({_culprits(found)})") from None
    notes = [n for n in (note, given and _numeric_names_note(names, raw, label)) if n]
    channels, size = _storage(list(found.values()), storage_size, model_side)
    parts = {}
    for split, shards in groups.items():
        keep, ys = [], []
        for path in shards:
            for s, y in zip(found[path].samples, found[path].labels):
                if y in index and not isinstance(y, bool):
                    keep.append(s)
                    ys.append(index[y])
                else:
                    skipped.append((s.name, _bad_label(y, names)))
        parts[split] = ShardDataset(keep, ys, names, channels, size, f"{label}/{split}") if keep else None
    if parts.get("train") is None:
        raise VitlabError(f"no usable training sample in {source} ({len(skipped)} skipped); name training shards "
                          "train-*.tar (or no split prefix) and check them with `vitlab data inspect`")
    return DataSplits(parts.get("train"), parts.get("val"), parts.get("test"), names, skipped, label, channels,
                      notes)


# ------------------------------------------------------------------------------------ streaming
def stream_plan(runs: list[np.ndarray], *, seed: int, epoch: int, rank: int, world_size: int, workers: int,
                worker: int) -> np.ndarray:
    """The item indices one worker of one rank reads this epoch, in reading order.

    Shards are put in a seeded per-epoch order and their samples laid end to end; each rank takes an equal
    contiguous range of floor(N / world_size) (the last N mod world_size samples of the epoch's order are
    left out, never repeated), and each DataLoader worker an equal-as-possible contiguous part of its rank's
    range. So no sample is read twice, each reader opens only the shards its range crosses, and any
    number of shards works (fewer shards than ranks x workers just means ranges inside one shard).
    """
    from vitlab.data.loader import epoch_order

    order = epoch_order(len(runs), True, seed, epoch).tolist()
    seq = np.concatenate([runs[k] for k in order]) if runs else np.zeros(0, dtype=np.int64)
    per_rank = len(seq) // world_size
    mine = seq[rank * per_rank:(rank + 1) * per_rank]
    return np.array_split(mine, workers)[worker]


class ShardStream(torch.utils.data.IterableDataset):
    """Worker side of streamed training: reads its plan's samples shard by shard, mixes them in a seeded
    shuffle buffer and yields chunks of (images, labels, failures). A sample that fails to decode is
    replaced by a random other sample of the buffer (so every rank yields the same count) and reported."""

    def __init__(self, ds: ShardDataset, *, seed: int, epoch: int, rank: int, world_size: int, workers: int,
                 buffer: int, chunk: int):
        self.ds, self.seed, self.epoch, self.rank, self.world = ds, seed, epoch, rank, world_size
        self.workers, self.buffer, self.chunk = max(1, workers), max(1, buffer), chunk

    def _decoded(self, items: np.ndarray) -> Iterator[tuple[torch.Tensor | None, int, tuple[str, str] | None]]:
        handle, current = None, None
        try:
            for i in items.tolist():
                s = self.ds.samples[i]
                try:
                    if s.shard != current:
                        if handle is not None:
                            handle.close()
                        handle, current = None, s.shard
                        handle = open(s.shard, "rb")
                    data = read_bytes(s, handle)
                except OSError as exc:  # the shard went away or broke after it was indexed
                    yield None, -1, (s.name, f"unreadable file ({exc.strerror or exc})")
                    continue
                try:
                    yield self.ds.decode(data, i), int(self.ds.labels[i]), None
                except BadImageError as exc:
                    yield None, -1, (exc.path, exc.reason)
        finally:
            if handle is not None:
                handle.close()

    def samples(self, worker: int) -> Iterator[tuple[torch.Tensor, int, list]]:
        """(image, label, failures met since the last yield) in this worker's shuffled order."""
        items = stream_plan(self.ds.shard_runs(), seed=self.seed, epoch=self.epoch, rank=self.rank,
                            world_size=self.world, workers=self.workers, worker=worker)
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker, 7])
        buf: list[tuple[torch.Tensor, int]] = []
        owed, bad, last = 0, [], None
        for x, y, failure in self._decoded(items):
            if failure is not None:
                owed, bad = owed + 1, [*bad, failure]
                continue
            buf.append((x, y))
            last = (x, y)
            if len(buf) >= self.buffer:
                j = int(rng.integers(len(buf)))
                buf[j], buf[-1] = buf[-1], buf[j]
                yield (*buf.pop(), bad)
                bad = []
        if owed and last is None:
            raise VitlabError(f"{self.ds.name}: every sample this reader was given failed to decode ({owed}, "
                              f"first: {bad[0][0]}); check the shards")
        tail = [buf[j] for j in rng.permutation(len(buf)).tolist()]
        tail += [buf[j] if buf else last for j in rng.integers(0, max(1, len(buf)), owed).tolist()]
        for x, y in tail:  # the buffer drained, then one substitute per failed sample
            yield x, y, bad
            bad = []

    def __iter__(self):
        """Chunks (images or None, labels, failures, error text or None); a VitlabError travels back as
        text, so the main process raises it as one line instead of a worker's traceback."""
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        xs, ys, bad = [], [], []
        try:
            for x, y, failures in self.samples(worker):
                xs.append(x)
                ys.append(y)
                bad.extend(failures)
                if len(xs) == self.chunk:
                    yield torch.stack(xs), torch.tensor(ys, dtype=torch.int64), bad, None
                    xs, ys, bad = [], [], []
        except VitlabError as exc:
            yield None, None, bad, str(exc)
            return
        if xs or bad:
            yield (torch.stack(xs) if xs else None), torch.tensor(ys, dtype=torch.int64), bad, None


def shuffle_buffer() -> int:
    """Samples in each streaming worker's shuffle buffer (VITLAB_SHUFFLE_BUFFER overrides the default)."""
    env = os.environ.get("VITLAB_SHUFFLE_BUFFER")
    return max(1, int(env)) if env else DEFAULT_SHUFFLE_BUFFER


class ShardStreamLoader:
    """Training batches streamed from shards: exactly `total_batches` batches of `batch_size` per rank.

    Workers' chunks arrive in DataLoader's fixed round-robin order and are cut into batches here, so the
    order is a pure function of (seed, epoch, world size, workers, shuffle buffer). Called with the default
    world_size=1 inside an initialised process group, the group's rank and size are used (as webdataset's
    split_by_node does), so shards are never read twice across processes. Resuming mid-epoch
    reads and drops the first `skip_batches` batches (same order as the uninterrupted run).
    """

    def __init__(self, dataset: ShardDataset, batch_size: int, *, seed: int, epoch: int, skip_batches: int,
                 drop_last: bool, rank: int, world_size: int, num_workers: int, buffer: int | None = None):
        self.dataset, self.batch_size, self.skip = dataset, batch_size, max(0, int(skip_batches))
        if world_size == 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()  # as split_by_node
        n = len(dataset) // world_size
        self.per_rank = n
        self.total_batches = n // batch_size if drop_last else -(-n // batch_size)
        self.num_workers = max(0, min(int(num_workers), n))
        dataset.shard_runs()  # computed once here, inherited by the workers
        self.stream = ShardStream(dataset, seed=seed, epoch=epoch, rank=rank, world_size=world_size,
                                  workers=max(1, self.num_workers), buffer=buffer or shuffle_buffer(),
                                  chunk=max(1, min(batch_size, 64)))

    def __len__(self) -> int:
        return max(0, self.total_batches - self.skip)

    def _chunks(self):
        from torch.utils.data import DataLoader

        from vitlab.data.loader import _worker_init

        if self.num_workers == 0:
            yield from self.stream
            return
        yield from DataLoader(self.stream, batch_size=None, num_workers=self.num_workers, worker_init_fn=_worker_init,
                              prefetch_factor=4, persistent_workers=False)

    def __iter__(self):
        known = {p for p, _ in self.dataset.failures}
        xs, ys, made = [], [], 0
        held = 0
        for x, y, bad, error in self._chunks():
            for path, reason in bad:
                if path not in known:
                    known.add(path)
                    self.dataset.failures.append((path, reason))
            if error:
                raise VitlabError(error)
            if x is None:
                continue
            xs.append(x)
            ys.append(y)
            held += len(y)
            while held >= self.batch_size and made < self.total_batches:
                bx, by = torch.cat(xs), torch.cat(ys)
                xs, ys = [bx[self.batch_size:]], [by[self.batch_size:]]
                held -= self.batch_size
                if made >= self.skip:
                    yield bx[: self.batch_size], by[: self.batch_size]
                made += 1
        if held and made < self.total_batches and made >= self.skip:
            yield torch.cat(xs), torch.cat(ys)


# --------------------------------------------------------------------------------------- writing
def _png(x: torch.Tensor) -> bytes:
    from vitlab.data.images import tensor_to_pil

    out = io.BytesIO()
    tensor_to_pil(x).save(out, format="PNG", compress_level=6)
    return out.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o444, 0  # fixed metadata: the same data gives the same bytes
    tar.addfile(info, io.BytesIO(data))


class ShardWriter:
    """Writes one split as OUT/{split}-000000.tar, ... of `shard_size` samples (key.png + key.cls each);
    each shard is written under a temporary name and renamed when complete."""

    def __init__(self, out: Path, split: str, shard_size: int):
        self.out, self.split, self.shard_size = out, split, shard_size
        self.count, self.shards, self.tar, self.tmp = 0, [], None, None

    def _open(self) -> None:
        path = self.out / f"{self.split}-{len(self.shards):06d}.tar"
        self.tmp = path.with_suffix(".tar.partial")
        self.tar = tarfile.open(self.tmp, "w", format=tarfile.USTAR_FORMAT)
        self.shards.append(path)

    def _close(self) -> None:
        if self.tar is not None:
            self.tar.close()
            os.replace(self.tmp, self.shards[-1])
            self.tar = None

    def add(self, png: bytes, label: int) -> None:
        """Append one sample: PNG bytes and its class index."""
        if self.count % self.shard_size == 0:
            self._close()
            self._open()
        key = f"{self.count:09d}"
        _add(self.tar, f"{key}.png", png)
        _add(self.tar, f"{key}.cls", str(int(label)).encode())
        self.count += 1

    def close(self) -> None:
        self._close()


def existing_shards(out: Path) -> list[Path]:
    """Shards a previous `vitlab data shard` left in `out` (SPLIT-NNNNNN.tar)."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if re.fullmatch(r"(train|val|test)-\d{6}\.tar(\.partial)?", p.name))


def check_target(out: Path, shard_size: int, force: bool) -> list[Path]:
    """Refuse a bad shard size, an OUT that is no folder, or existing shards (without `force`) before any work; the
    shards to replace."""
    out = Path(out)
    if shard_size < 1:
        raise VitlabError(f"--shard-size must be at least 1, got {shard_size}")
    if (out.exists() or out.is_symlink()) and not out.is_dir():  # before reading the source, not after: a file,
        # a device or a dangling link was "File exists: OUT; check ... the free disk space" once all was read
        raise VitlabError(f"{out} exists and is not a folder; give a new or existing folder for the shards")
    old = existing_shards(Path(out))
    if old and not force:
        raise VitlabError(f"{out} already holds {len(old)} shards ({old[0].name}, ...); pick another folder or "
                          "pass --force to replace them")
    return old


def check_apart(out: Path, source_folders: list[Path]) -> None:
    """Refuse an OUT inside a folder the source reads (`load.source_folders`), or holding one (`load.nesting`):
    shards written into their own source are read back as data (and a rerun with --force deleted a shard source
    before reading it); above it, a folder with .tar files and a classes.txt reads as shards, so the split or
    class folders beside them were no longer read."""
    from vitlab.data.load import nesting

    found = nesting(out, source_folders)
    if found is None:
        return
    how, folder = found
    if how == "holds":
        raise VitlabError(f"OUT {out} holds the source folder {folder}: its shards and classes.txt would change "
                          f"what --data {out} reads; give an OUT beside the source, not above it")
    raise VitlabError(f"OUT {out} {how} the source folder {folder}: its shards would be read back as data; give an "
                      "OUT outside the source")


def write_shards(splits: DataSplits, out: str | os.PathLike, shard_size: int, *, force: bool = False,
                 progress: bool = True) -> dict[str, tuple[int, int]]:
    """Write every split of `splits` as PNG shards plus classes.txt; {split: (samples, shards)}.

    Samples keep the source's order (so loading the shards gives the same splits and batches as the source);
    images that fail to decode are skipped and added to `splits.skipped`. Refuses to overwrite shards
    unless `force` (then the old SPLIT-NNNNNN.tar files are removed first).
    """
    from tqdm.auto import tqdm

    out = Path(out)
    old = check_target(out, shard_size, force)
    if any("\n" in n or "\r" in n for n in splits.class_names):
        raise VitlabError("a class name contains a line break; rename the class before writing shards")
    out.mkdir(parents=True, exist_ok=True)
    for p in old:
        p.unlink()
    (out / "classes.txt").write_text("".join(f"{n}\n" for n in splits.class_names), encoding="utf-8")
    total = sum(len(v) for v in splits.splits().values())
    result = {}
    with tqdm(total=total, desc=f"writing shards to {out}", unit="img", disable=not progress, leave=False,
              **bar_options()) as bar, \
            ThreadPoolExecutor(min(8, os.cpu_count() or 2)) as pool:  # Pillow and zlib release the GIL
        for split, ds in splits.splits().items():
            writer = ShardWriter(out, split, shard_size)

            def encode(i: int, ds=ds) -> bytes | BadImageError:
                try:
                    return _png(ds.load(i) if isinstance(ds, FileImageDataset) else ds.images[i])
                except BadImageError as exc:
                    return exc

            try:
                for start in range(0, len(ds), 256):  # in order, a bounded number in flight
                    stop = min(len(ds), start + 256)
                    for i, png in zip(range(start, stop), pool.map(encode, range(start, stop))):
                        if isinstance(png, BadImageError):
                            splits.skipped.append((png.path, png.reason))
                        else:
                            writer.add(png, int(ds.labels[i]))
                    bar.update(stop - start)
            finally:
                writer.close()
            result[split] = (writer.count, len(writer.shards))
    return result
