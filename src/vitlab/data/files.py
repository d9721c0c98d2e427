"""Image sources made of files: a folder with one subfolder per class, or a CSV of `path,label[,split]`.

Every file's header is checked once up front (cheap: no pixel decoding) so missing, empty, non-image
and oversized files are skipped and listed before training starts; files whose pixels turn out to be
corrupt are caught when decoded. Images are stored at one square size (shorter side resized, then
centre-cropped) so they batch: by default the median shorter side, capped at 256 (enough for a
224-pixel model with a crop fraction of 0.875).
"""

from __future__ import annotations

import csv
import itertools
import os
import re
import unicodedata
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from vitlab.data.dataset import DataSplits, FileImageDataset
from vitlab.data.images import BadImageError, check_image_header, is_image_file
from vitlab.data.labels import class_order, number_label
from vitlab.errors import VitlabError
from vitlab.progress import bar_options

SPLIT_FOLDERS = {"train": ("train", "training"), "val": ("val", "valid", "validation"), "test": ("test", "testing")}
GREY_MODES = {"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"}
MAX_STORAGE_SIZE = 256
# A CSV larger than this is refused before it is read: ~3 million rows of typical paths, each row
# becoming a few hundred bytes of Python objects. Rows themselves are bounded by the csv module's
# 128 KiB field limit.
MAX_CSV_BYTES = 256 * 1024**2
MAX_CSV_LINE = 1024**2  # characters in one line of a CSV: a path,label row needs a few hundred


def scan_headers(paths: Sequence[str], progress: bool = True) -> tuple[list[tuple[int, int, str] | None], list]:
    """Header of each file: (w, h, mode) or None when unusable; plus the skipped (path, reason) list."""
    from tqdm.auto import tqdm

    def one(p):
        try:
            return check_image_header(p), None
        except BadImageError as exc:
            return None, (exc.path, exc.reason)

    infos, skipped = [], []
    with ThreadPoolExecutor(min(8, (os.cpu_count() or 2) * 2)) as pool:
        for info, bad in tqdm(pool.map(one, paths, chunksize=32), total=len(paths), desc="checking images",
                              unit="file", disable=not progress or len(paths) < 2000, leave=False,
                              **bar_options()):
            infos.append(info)
            if bad:
                skipped.append(bad)
    return infos, skipped


def storage_format(peek: Sequence[tuple[int, int, str]], requested: int | None = None,
                   model_side: int | None = None) -> tuple[int, int]:
    """(channels, storage size) from (width, height, PIL mode) of sample images: 1 channel only if all are grey."""
    channels = 1 if peek and all(m in GREY_MODES for _, _, m in peek) else 3
    return channels, choose_storage_size([(w, h) for w, h, _ in peek], requested, model_side)


def choose_storage_size(sizes: Sequence[tuple[int, int]], requested: int | None = None,
                        model_side: int | None = None) -> int:
    """The square size images are stored at: `requested`, else the median shorter side capped at 256, or at
    `model_side` where the model that reads them takes more (its resize before the crop, else its input side):
    a 384-px model read photos stored at 256 and enlarged, blurred by the storage alone."""
    if requested:
        return int(requested)
    if not sizes:
        return 32
    cap = max(MAX_STORAGE_SIZE, int(model_side or 0))
    shorter = np.array([min(w, h) for w, h in sizes])
    return int(max(1, min(cap, int(np.median(shorter)))))


class _FolderWalk:
    """Loop-safe walk of a data folder's class folders, where links never change an image's label.

    Rules (docs/data.md, "Rules for folders and bad files"):
    - every folder is walked once, whatever the links (tracked by (st_dev, st_ino)): a link back to a
      folder already walked (`ln -s . x`, `ln -s .. up`) is not followed and is listed;
    - a link (to a file or a folder) may point inside its own class folder or outside the data folder:
      its images count under the class folder the link sits in (symlink farms work);
    - a link pointing into another class folder, or elsewhere inside the data folder, is not followed
      and is listed: those images count under the class they really live in, or not at all;
    - a file reached along several paths counts once (see _dedupe_files).
    """

    def __init__(self, root: Path, class_folders: dict[str, Path]):
        self.root_real = os.path.realpath(root)
        self.homes: dict[str, str] = {}  # real path of each class folder -> "class" or "split/class"
        for label, folder in class_folders.items():
            self.homes.setdefault(os.path.realpath(folder), label)
        self.visited: set[tuple[int, int]] = set()
        self.skipped: list[tuple[str, str]] = []

    def home(self, real: str) -> str | None:
        """Class label of the class folder holding `real`; "" inside the data folder but outside every
        class; None outside the data folder."""
        path = real
        while True:
            if path in self.homes:
                return self.homes[path]
            if path == self.root_real:
                return ""
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent

    def _first_visit(self, path: str) -> bool:
        """True the first time a folder (by device and inode, so through any link) is seen."""
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        if key in self.visited:
            return False
        self.visited.add(key)
        return True

    def _leads_elsewhere(self, path: str, real: str, label: str) -> bool:
        """True (and listed) when `real` lies in another class or in the data folder outside the classes."""
        where = self.home(real)
        if where is None or where == label:
            return False
        if where:
            self.skipped.append((path, f"link into another class folder ({where}; its images count there, not here)"))
        else:
            self.skipped.append((path, "link into the data folder outside the classes (not followed)"))
        return True

    def images_of(self, folder: Path, label: str) -> list[str]:
        """Image files under one class folder (hidden entries ignored); non-images and links are listed."""
        top = str(folder)
        try:
            first = self._first_visit(top)
        except OSError as exc:
            self.skipped.append((top, f"unreadable folder ({exc.strerror or exc})"))
            return []
        if not first:
            self.skipped.append((top, "duplicate class folder (the same folder as another class; not walked)"))
            return []
        images: list[str] = []
        stack = [(top, os.path.realpath(top))]
        while stack:
            path, real = stack.pop()
            subfolders = self._walk_one(path, real, label, images)
            stack.extend(reversed(subfolders))  # depth first, in name order, like os.walk
        return images

    def _walk_one(self, path: str, real: str, label: str, images: list[str]) -> list[tuple[str, str]]:
        """Collect one folder's image files into `images`; return its subfolders still to walk."""
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as exc:
            self.skipped.append((path, f"unreadable folder ({exc.strerror or exc})"))
            return []
        subfolders = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                is_link, is_dir = entry.is_symlink(), entry.is_dir()
                # a link's real place decides; a plain entry lies where its folder really is
                entry_real = os.path.realpath(entry.path) if is_link else os.path.join(real, entry.name)
                if is_dir:
                    if self._leads_elsewhere(entry.path, entry_real, label):
                        continue
                    if not self._first_visit(entry.path):
                        self.skipped.append((entry.path, "link loop (a folder already walked; not followed)" if is_link
                                             else "folder already walked (reached earlier through a link)"))
                        continue
                    subfolders.append((entry.path, entry_real))
                elif not is_image_file(entry.name):
                    self.skipped.append((entry.path, f"not an image (extension {Path(entry.name).suffix or 'none'})"))
                elif not (is_link and self._leads_elsewhere(entry.path, entry_real, label)):
                    images.append(entry.path)  # broken links too: the header check lists them as missing
            except OSError as exc:
                self.skipped.append((entry.path, f"unreadable ({exc.strerror or exc})"))
        return subfolders


def _file_key(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file a path leads to, through links; None when it cannot be read."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _dedupe_files(entries: dict[str, list[tuple[str, str]]], skipped: list) -> dict[str, list[tuple[str, str]]]:
    """Each file counts once: a file reached along several paths (links, hard links, repeated CSV rows)
    is kept once when every path gives it the same class and split, and skipped everywhere (listed)
    when they disagree, since its label or split would depend on which path won."""
    places: dict[tuple[int, int], list[tuple[str, int, str, str]]] = {}
    for split, items in entries.items():
        for i, (path, label) in enumerate(items):
            key = _file_key(path)
            if key is not None:
                places.setdefault(key, []).append((split, i, path, label))
    drop: set[tuple[str, int]] = set()  # (split, position): a repeated CSV row has the same path string
    for found in places.values():
        if len(found) < 2:
            continue
        first = found[0][2]
        kinds = {(split, label) for split, _, _, label in found}
        if len(kinds) == 1:
            for split, i, path, _ in found[1:]:
                drop.add((split, i))
                again = "listed more than once" if path == first else f"the same file as {first}"
                skipped.append((path, f"duplicate file ({again}; counted once)"))
        else:
            places_of = sorted({f"{split}/{label}" for split, label in kinds})
            # a few places and the count: every listed path repeats this text, so all of them (a CSV naming one
            # file under 200,000 labels) would make the list quadratic in the rows
            where = ", ".join(places_of[:3]) + (f", ... ({len(places_of)} in all)" if len(places_of) > 3 else "")
            for split, i, path, _ in found:
                drop.add((split, i))
                skipped.append((path, f"same file in several classes or splits ({where}; skipped everywhere)"))
    if not drop:
        return entries
    return {s: [e for i, e in enumerate(items) if (s, i) not in drop] for s, items in entries.items()}


def _subdirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _dangling_links(folder: Path) -> list[tuple[str, str]]:
    """Links in a folder of class folders whose target is gone (a class folder on a drive not mounted): listed, not
    passed over as non-folders, which left their classes out of the data without a word."""
    return [(str(p), "dangling link (its target does not exist; nothing read from it)")
            for p in sorted(folder.iterdir()) if not p.name.startswith(".") and p.is_symlink() and not p.exists()]


def _split_folders(root: Path) -> dict[str, Path]:
    found = {}
    for d in _subdirs(root):
        for split, names in SPLIT_FOLDERS.items():
            if d.name.lower() in names and split not in found:
                found[split] = d
    return found if "train" in found else {}


def _build(entries: dict[str, list[tuple[str, str]]], class_names: list[str], skipped: list, name: str,
           storage_size: int | None, progress: bool, source: str,
           class_paths: dict[str, str] | None = None, notes: list[str] | None = None,
           model_side: int | None = None) -> DataSplits:
    """entries: split -> [(path, class name)]; header-check all, drop unusable, make FileImageDatasets."""
    notes = list(notes or [])
    entries = _dedupe_files(entries, skipped)
    all_paths = [p for items in entries.values() for p, _ in items]
    infos, bad = scan_headers(all_paths, progress)
    skipped.extend(bad)
    info_of = dict(zip(all_paths, infos))
    usable = {s: [(p, c) for p, c in items if info_of.get(p)] for s, items in entries.items()}
    present = {c for items in usable.values() for _, c in items}
    for c in class_names:
        if c not in present:
            where = (class_paths or {}).get(c, f"{source}:{c}")
            skipped.append((where, "empty class (no usable image)"))
    classes = [c for c in class_names if c in present]
    if not classes:
        n = len(skipped)
        first = f" (first: {skipped[0][0]}: {skipped[0][1]})" if skipped else ""
        raise VitlabError(f"no usable image in {source}: {n} file{'s' if n != 1 else ''} skipped{first}; "
                          "check the files or the path")
    notes += _lookalike_note(classes, source)
    untrained = [c for c in classes if c not in {c for _, c in usable.get("train", [])}]
    if untrained and usable.get("train"):
        notes.append(_untrained_note(untrained, source))
    index = {c: i for i, c in enumerate(classes)}
    good = [info_of[p] for items in usable.values() for p, _ in items]
    channels, size = storage_format(good, storage_size, model_side)
    parts = {}
    for split in ("train", "val", "test"):
        items = usable.get(split)
        if items is None:
            parts[split] = None
            continue
        paths = [p for p, _ in items]
        labels = [index[c] for _, c in items]
        sizes = [info_of[p][:2] for p in paths]
        parts[split] = FileImageDataset(paths, labels, classes, channels, size, f"{name}/{split}", sizes)
    if parts["train"] is None or len(parts["train"]) == 0:
        raise VitlabError(f"no usable image in the train split of {source}; check the files")
    return DataSplits(parts["train"], parts["val"], parts["test"], classes, skipped, name, channels, notes)


def _lookalike_note(classes: list[str], source: str) -> list[str]:
    """A note for classes whose names differ only in case, in how an accent is encoded (`café` typed as one
    character, or as `e` and a combining accent, as macOS names files) or in how a number is written (`1`, `01`):
    separate classes that print alike, most often one class copied from two places."""
    groups: dict[str, list[str]] = {}
    for c in classes:  # folders `1` and `01` too: a CSV reads them as one class number, folders keep them apart
        number = number_label(c)
        groups.setdefault(unicodedata.normalize("NFC", c).casefold() if number is None else str(number), []).append(c)
    alike = [g for g in groups.values() if len(g) > 1]
    if not alike:
        return []
    shown = "; ".join(" and ".join(c if c.isascii() else ascii(c)[1:-1] for c in g) for g in alike[:5])
    return [f"{source}: {len(alike)} group{'s' if len(alike) > 1 else ''} of classes whose names differ only in case, "
            f"accent encoding or leading zeros ({shown}{'; ...' if len(alike) > 5 else ''}) are separate classes; merge "
            "their folders (or labels) where they are one class"]


def _untrained_note(untrained: list[str], source: str) -> str:
    """The note for classes whose images are all in val or test: they stay in the head, but nothing teaches them."""
    shown = ", ".join(untrained[:8]) + (", ..." if len(untrained) > 8 else "")
    n = len(untrained)
    them = "them" if n > 1 else "it"
    return (f"{source}: {n} class{'es' if n > 1 else ''} with no training image, only val or test ones ({shown}); "
            f"a model cannot learn {them}: add training images, or leave {them} out with --classes")


def class_name(folder_name: str) -> str:
    """A class folder's name as its class name. A name that is not UTF-8 (Linux hands its bytes over as surrogate
    escapes) is written with `\\xNN` for those bytes (`cat\\xff`): as it was, matplotlib could not draw it (`vitlab
    train` failed at its end, on the confusion matrix; `vitlab data inspect` on its sample grid), nor could a
    strict UTF-8 terminal print it."""
    return os.fsencode(folder_name).decode("utf-8", "backslashreplace")  # os.fsencode: the folder's own bytes


def _place(split: str, class_dir: Path, n_splits: int) -> str:
    """How a class folder is named in messages: "CLASS", or "SPLIT/CLASS" with split folders."""
    return f"{split}/{class_dir.name}" if n_splits > 1 else class_dir.name


def _loose_images(folder: Path) -> int:
    """How many image files lie directly in a folder (not hidden, links to files included)."""
    return sum(1 for p in folder.iterdir() if not p.name.startswith(".") and p.is_file() and is_image_file(p.name))


def _unread_notes(root: Path, splits: dict[str, Path]) -> list[str]:
    """Notes for what a data folder holds but does not read, so nothing is dropped unsaid: folders beside the split
    folders (`unlabeled/`, `extra_train/`, a typo such as `tst/`, a second `validation/`) and images in no class
    folder (directly in ROOT, or directly in a split folder)."""
    notes = []
    if splits:
        used = set(splits.values())
        other = []
        for d in _subdirs(root):
            if d in used:
                continue
            twin = next((s for s, names in SPLIT_FOLDERS.items() if d.name.lower() in names), None)
            other.append(f"{d.name}/ (a second {twin} folder; {splits[twin].name}/ is read)" if twin else f"{d.name}/")
        if other:
            notes.append(f"{root}: {', '.join(other)} not read: beside split folders only train/, val/ and test/ "
                         "(or training/, valid/, validation/, testing/) are read")
    for folder in [root, *splits.values()]:
        n = _loose_images(folder)
        if n:
            where = "SPLIT/CLASS/" if splits else "CLASS/"
            notes.append(f"{folder}: {n} image file{'s' if n > 1 else ''} directly in it, in no class folder, "
                         f"not read (images belong in {root}/{where})")
    return notes


def load_folder(root: str | os.PathLike, storage_size: int | None = None, progress: bool = True,
                model_side: int | None = None) -> DataSplits:
    """ROOT/CLASS/*.jpg, or ROOT/{train,val,test}/CLASS/*.jpg (val/test optional); class names that are all integers
    are ordered as numbers (`labels.class_order`)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise VitlabError(f"data folder not found: {root}")
    splits = _split_folders(root)
    skipped: list[tuple[str, str]] = []
    entries: dict[str, list[tuple[str, str]]] = {}
    roots = splits or {"train": root}
    class_names: list[str] = []
    class_paths: dict[str, str] = {}
    class_dirs: dict[str, list[Path]] = {}
    for split, folder in roots.items():
        skipped += _dangling_links(folder)
        classes = _subdirs(folder)
        if not classes:
            if split == "train":
                loose = [p for p in folder.iterdir() if p.is_file() and is_image_file(p)]
                what = f"has {len(loose)} images but no class subfolders" if loose else "has no class subfolders"
                raise VitlabError(f"{folder} {what}; put each class in its own folder "
                                  f"({folder}/CLASS/image.jpg) or use a CSV of path,label")
            continue
        class_dirs[split] = classes
    walk = _FolderWalk(root, {_place(split, c, len(roots)): c for split, cs in class_dirs.items() for c in cs})
    for split, classes in class_dirs.items():
        entries[split] = []
        for cdir in classes:
            imgs = walk.images_of(cdir, _place(split, cdir, len(roots)))
            name = class_name(cdir.name)
            entries[split].extend((p, name) for p in imgs)
            if name not in class_names:
                class_names.append(name)
                class_paths[name] = str(cdir) if len(roots) == 1 else str(root / "*" / cdir.name)
    skipped.extend(walk.skipped)
    return _build(entries, class_order(class_names), skipped, root.name or str(root), storage_size, progress,
                  str(root), class_paths, _unread_notes(root, splits), model_side)


def _check_csv_size(path: Path) -> None:
    size = path.stat().st_size
    if size > MAX_CSV_BYTES:
        raise VitlabError(f"{path} is {size:,} bytes, over the {MAX_CSV_BYTES:,}-byte limit for a CSV of "
                          "path,label rows; split it, or use a folder of class subfolders")


_SEPARATORS = {"\t": "tab", ";": "semicolon"}


def _delimiter(path: Path) -> tuple[str, str | None]:
    """The field separator and a note when it is not the obvious one: a tab for `.tsv`; for other files a comma,
    unless none of the first lines has a comma and every one of them has a tab (or every one a semicolon): such a
    file read with commas would be all bad rows, while a path,label file always has a comma on each line."""
    if path.suffix.lower() == ".tsv":
        return "\t", None
    with path.open(encoding="utf-8-sig", errors="replace") as fh:
        head = fh.read(64 * 1024)
    lines = [line for line in head.splitlines()[:21] if line.strip() and not line.lstrip().startswith("#")]
    lines = lines[:20] if len(head) < 64 * 1024 else lines[:-1][:20]  # a cut last line proves nothing
    if lines and not any("," in line for line in lines):
        for sep, name in _SEPARATORS.items():
            if all(sep in line for line in lines):
                return sep, f"{path}: read as {name}-separated (its lines have no comma)"
    return ",", None


def _bounded_lines(fh, path: Path):
    """The file's lines, each read with a bound: a line over MAX_CSV_LINE characters is an error naming it."""
    number = 0
    while line := fh.readline(MAX_CSV_LINE + 1):
        number += 1
        if len(line) > MAX_CSV_LINE:
            raise VitlabError(f"{path}: line {number} is over {MAX_CSV_LINE:,} characters; expected lines of "
                              "path,label[,split]")
        yield line


def _csv_rows(path: Path, delimiter: str):
    """(line number, row) of the CSV's non-empty, non-comment rows; csv/encoding faults become one-line errors
    naming the line. The number is the row's first line in the file, as an editor shows it."""
    with path.open(newline="", encoding="utf-8-sig") as fh:
        # its field size limit (128 KiB) bounds each field, and _bounded_lines the fields of a row: one line of 60 MB
        # of `,ab` made 20 million fields, 1.8 GB of Python strings
        reader = csv.reader(_bounded_lines(fh, path), delimiter=delimiter)
        line = 1
        try:
            for row in reader:
                if row and any(c.strip() for c in row) and not row[0].lstrip().startswith("#"):
                    yield line, row
                line = reader.line_num + 1  # blank lines come as [] rows, so every line is counted
        except csv.Error as exc:
            raise VitlabError(f"{path}: line {reader.line_num}: {exc}; expected lines of path,label") from None
        except UnicodeDecodeError as exc:
            raise VitlabError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                              "save it as UTF-8") from None


# The column names CSV files of images use (pandas, Kaggle, Hugging Face's imagefolder metadata.csv), each in order
# of preference: a header naming two of a kind (`id,file_name,label`) reads the first listed here.
_PATH_COLUMNS = ("path", "file_path", "filepath", "image_path", "img_path", "file_name", "filename", "file",
                 "image_file", "image_name", "image", "img", "image_id", "id", "name")
_LABEL_COLUMNS = ("label", "labels", "class", "class_name", "classname", "category", "target", "y")
_SPLIT_COLUMNS = ("split", "subset", "partition")
_POSITIONAL = {"path": 0, "label": 1, "split": 2}  # a CSV without a header: path,label[,split]


def _column_name(field: str) -> str:
    """`" Image Path"` -> `"image_path"`: how header names are compared."""
    return re.sub(r"[\s-]+", "_", field.strip().lower())


def _looks_like_path(field: str) -> bool:
    """Whether a first field reads as a data row's path: a folder or an image extension in it (or empty: a bad row)."""
    text = field.strip()
    return not text or "/" in text or "\\" in text or is_image_file(text)


def _is_file(field: str, base: Path) -> bool:
    try:
        return (base / field.strip()).is_file()
    except (OSError, ValueError):  # a NUL in the name
        return False


def _header_columns(row: list[str], where: str) -> dict[str, int | None]:
    """The columns a header row names: path, label and split (None when it has none); a header without a path or
    a label column it recognises is refused in one line naming the names it accepts."""
    names = [_column_name(f) for f in row]

    def pick(options):
        return next((names.index(o) for o in options if o in names), None)

    cols = {"path": pick(_PATH_COLUMNS), "label": pick(_LABEL_COLUMNS), "split": pick(_SPLIT_COLUMNS)}
    missing = [k for k in ("path", "label") if cols[k] is None]
    if missing:
        shown = ",".join(f.strip() for f in row)[:120]
        raise VitlabError(f"{where}: the first line {shown!r} is no data row (its first field names no image file) and "
                          f"names no {' and no '.join(missing)} column; a header names the path column "
                          f"({', '.join(_PATH_COLUMNS)}), the label column ({', '.join(_LABEL_COLUMNS)}) and "
                          f"optionally a split column ({', '.join(_SPLIT_COLUMNS)}); or remove it so the rows are "
                          "read as path,label[,split]")
    return cols


def _columns(first: tuple[int, list[str]] | None, path: Path, notes: list[str]) -> tuple[dict, bool]:
    """The columns to read and whether the first row is a header (then used up).

    A first row is data when its first field has a folder or an image extension in it (`img/0.png`, `x.png`, even a
    missing one), or, failing a header's column names, is an existing file; any other first row is a header, and its
    names pick the columns, so `label,path` and `file_name,label,caption` read right. Columns a header names that
    vitlab does not read are listed once; a header without a path and a label column it knows is refused."""
    if first is None or _looks_like_path(first[1][0]):
        return _POSITIONAL, False
    try:
        cols = _header_columns(first[1], f"{path}: line {first[0]}")
    except VitlabError:
        if _is_file(first[1][0], path.parent):  # `0001,cat` with a file 0001: data
            return _POSITIONAL, False
        raise
    used = {i for i in cols.values() if i is not None}
    ignored = [f.strip() for i, f in enumerate(first[1]) if i not in used and f.strip()]
    if ignored:
        read = ", ".join(first[1][i].strip() for i in cols.values() if i is not None)
        notes.append(f"{path}: column{'s' if len(ignored) > 1 else ''} {', '.join(ignored)} not read "
                     f"(vitlab reads {read})")
    return cols, True


def _field(row: list[str], i: int | None) -> str:
    return row[i].strip() if i is not None and i < len(row) else ""


def _label_names(entries: dict[str, list[tuple[str, str]]], where: Path, notes: list[str]):
    """Entries with each label as its class name, and the class names in order.

    A label that is a number (`7`, `007`, `7.0`; `labels.number_label`) names the class by its plain integer form,
    so the same number is always one class; any other label is a name, as written. Numbers and names may be mixed
    (each is its own class, and every class name is distinct), but that is noted: it is most often a stray row."""
    spellings: dict[str, set[str]] = {}
    for items in entries.values():
        for _, label in items:
            num = number_label(label)
            spellings.setdefault(label if num is None else str(num), set()).add(label)
    merged = [f"{' and '.join(sorted(s))} -> {name}" for name, s in spellings.items() if len(s) > 1]
    if merged:
        notes.append(f"{where}: labels written differently are the same class number ("
                     f"{'; '.join(merged[:5])}{'; ...' if len(merged) > 5 else ''})")
    numbers = [n for n in spellings if number_label(n) is not None]
    if numbers and len(numbers) < len(spellings):
        names = [n for n in spellings if number_label(n) is None]
        notes.append(f"{where}: labels mix class numbers ({len(numbers)}, e.g. {numbers[0]}) and class names "
                     f"({len(names)}, e.g. {names[0]}); each is a class, ordered as text")
    plain = {label: name for name, s in spellings.items() for label in s}
    entries = {s: [(p, plain[c]) for p, c in items] for s, items in entries.items()}
    return entries, class_order(spellings)


def load_csv(path: str | os.PathLike, storage_size: int | None = None, progress: bool = True,
             model_side: int | None = None) -> DataSplits:
    """A CSV of `path,label` rows (optional third column `split` = train/val/test), or a header naming the columns.

    `.tsv` files are tab-separated. Relative paths are relative to the CSV's folder. Rows pointing to missing files
    are skipped; rows are named by their line in the file.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise VitlabError(f"CSV file not found: {path}")
    _check_csv_size(path)
    base = path.parent
    skipped: list[tuple[str, str]] = []
    notes: list[str] = []
    entries: dict[str, list[tuple[str, str]]] = {}
    written: dict[str, str] = {}  # the path each row leads to -> the path as written (for _misplaced_hint)
    delimiter, note = _delimiter(path)
    notes += [note] if note else []
    rows = _csv_rows(path, delimiter)
    first = next(rows, None)
    cols, is_header = _columns(first, path, notes)
    if first is not None and not is_header:
        rows = itertools.chain([first], rows)
    count = 0
    for line, row in rows:
        count += 1
        where = f"{path}:line {line}"
        file, label, split_text = _field(row, cols["path"]), _field(row, cols["label"]), _field(row, cols["split"])
        if not file or not label:
            skipped.append((where, f"bad row {repr(row[:3])[:80]} (expected path,label)"))
            continue
        number = number_label(label)
        if number is not None and number < 0:  # -1 is "no label" in Hugging Face datasets and most label files
            skipped.append((where, f"no label ({label}: a negative class number marks an unlabelled image)"))
            continue
        p = Path(file).expanduser()
        p = p if p.is_absolute() else base / p
        split = next((s for s, names in SPLIT_FOLDERS.items() if (split_text or "train").lower() in names), None)
        if split is None:
            skipped.append((where, f"unknown split {split_text[:40]!r} (use train, val or test)"))
            continue
        entries.setdefault(split, []).append((str(p), label))
        written.setdefault(str(p), file)
    if count == 0:
        raise VitlabError(f"{path} has no rows; expected lines of path,label")
    entries, class_names = _label_names(entries, path, notes)
    try:
        splits = _build(entries, class_names, skipped, path.stem, storage_size, progress, str(path), notes=notes,
                        model_side=model_side)
    except VitlabError as exc:  # every row missing: say why, where it can be seen
        hint = _misplaced_hint(path, skipped, written)
        if hint:
            raise VitlabError(f"{exc}; {hint}") from None
        raise
    hint = _misplaced_hint(path, skipped, written)
    if hint:
        splits.notes.append(f"{path}: {hint}")
    return splits


def _misplaced_hint(path: Path, skipped: list[tuple[str, str]], written: dict[str, str]) -> str | None:
    """Why a CSV's files are missing, when the first of them shows it (one stat or two, for missing rows only):
    paths written with Windows separators (`img\\0.png`, from a CSV made on Windows), or relative to the current
    folder instead of the CSV's. Neither is read as such, since either reading could pick another file than meant;
    the line says how to write the paths."""
    missing = next((written[p] for p, why in skipped if why.startswith("missing file") and p in written), None)
    if missing is None:
        return None
    slashed = missing.replace("\\", "/")
    if slashed != missing and _is_file(slashed, path.parent):
        return f"its paths are written with Windows separators ({missing}): write them with / ({slashed}) to read them here"
    if not Path(missing).is_absolute() and _is_file(missing, Path.cwd()) and path.parent.resolve() != Path.cwd():
        return (f"{missing} is in the current folder, not in the CSV's folder ({path.parent}): paths in a CSV are "
                "relative to its own folder; write them so, or absolute")
    return None
