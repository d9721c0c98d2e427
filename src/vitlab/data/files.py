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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from vitlab.data.dataset import DataSplits, FileImageDataset
from vitlab.data.images import BadImageError, check_image_header, is_image_file
from vitlab.errors import VitlabError
from vitlab.progress import bar_options

SPLIT_FOLDERS = {"train": ("train", "training"), "val": ("val", "valid", "validation"), "test": ("test", "testing")}
GREY_MODES = {"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"}
MAX_STORAGE_SIZE = 256
# A CSV larger than this is refused before it is read: ~3 million rows of typical paths, each row
# becoming a few hundred bytes of Python objects. Rows themselves are bounded by the csv module's
# 128 KiB field limit.
MAX_CSV_BYTES = 256 * 1024**2


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


def storage_format(peek: Sequence[tuple[int, int, str]], requested: int | None = None) -> tuple[int, int]:
    """(channels, storage size) from (width, height, PIL mode) of sample images: 1 channel only if all are grey."""
    channels = 1 if peek and all(m in GREY_MODES for _, _, m in peek) else 3
    return channels, choose_storage_size([(w, h) for w, h, _ in peek], requested)


def choose_storage_size(sizes: Sequence[tuple[int, int]], requested: int | None = None) -> int:
    """The square size images are stored at: `requested`, else the median shorter side capped at 256."""
    if requested:
        return int(requested)
    if not sizes:
        return 32
    shorter = np.array([min(w, h) for w, h in sizes])
    return int(max(1, min(MAX_STORAGE_SIZE, int(np.median(shorter)))))


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
            where = ", ".join(sorted({f"{split}/{label}" for split, label in kinds}))
            for split, i, path, _ in found:
                drop.add((split, i))
                skipped.append((path, f"same file in several classes or splits ({where}; skipped everywhere)"))
    if not drop:
        return entries
    return {s: [e for i, e in enumerate(items) if (s, i) not in drop] for s, items in entries.items()}


def _subdirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _split_folders(root: Path) -> dict[str, Path]:
    found = {}
    for d in _subdirs(root):
        for split, names in SPLIT_FOLDERS.items():
            if d.name.lower() in names and split not in found:
                found[split] = d
    return found if "train" in found else {}


def _build(entries: dict[str, list[tuple[str, str]]], class_names: list[str], skipped: list, name: str,
           storage_size: int | None, progress: bool, source: str,
           class_paths: dict[str, str] | None = None) -> DataSplits:
    """entries: split -> [(path, class name)]; header-check all, drop unusable, make FileImageDatasets."""
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
    index = {c: i for i, c in enumerate(classes)}
    good = [info_of[p] for items in usable.values() for p, _ in items]
    channels, size = storage_format(good, storage_size)
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
    return DataSplits(parts["train"], parts["val"], parts["test"], classes, skipped, name, channels)


def _place(split: str, class_dir: Path, n_splits: int) -> str:
    """How a class folder is named in messages: "CLASS", or "SPLIT/CLASS" with split folders."""
    return f"{split}/{class_dir.name}" if n_splits > 1 else class_dir.name


def load_folder(root: str | os.PathLike, storage_size: int | None = None, progress: bool = True) -> DataSplits:
    """ROOT/CLASS/*.jpg, or ROOT/{train,val,test}/CLASS/*.jpg (val/test optional)."""
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
            entries[split].extend((p, cdir.name) for p in imgs)
            if cdir.name not in class_names:
                class_names.append(cdir.name)
                class_paths[cdir.name] = str(cdir) if len(roots) == 1 else str(root / "*" / cdir.name)
    skipped.extend(walk.skipped)
    class_names.sort()
    return _build(entries, class_names, skipped, root.name or str(root), storage_size, progress, str(root),
                  class_paths)


def _csv_rows(path: Path):
    """The CSV's non-empty, non-comment rows; its size is checked before reading and csv/encoding faults
    become one-line errors naming the line."""
    size = path.stat().st_size
    if size > MAX_CSV_BYTES:
        raise VitlabError(f"{path} is {size:,} bytes, over the {MAX_CSV_BYTES:,}-byte limit for a CSV of "
                          "path,label rows; split it, or use a folder of class subfolders")
    with path.open(newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(fh)  # its field size limit (128 KiB) bounds every row
        try:
            for row in reader:
                if row and any(c.strip() for c in row) and not row[0].lstrip().startswith("#"):
                    yield row
        except csv.Error as exc:
            raise VitlabError(f"{path}: line {reader.line_num}: {exc}; expected lines of path,label") from None
        except UnicodeDecodeError as exc:
            raise VitlabError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                              "save it as UTF-8") from None


def _integer_label(label: str) -> bool:
    """Labels like "3" or "-1" (ASCII digits, a sane length) sort as numbers; anything else is a name."""
    return re.fullmatch(r"-?[0-9]{1,18}", label) is not None


# the column names CSV files of images use (pandas, Kaggle, Hugging Face's imagefolder metadata.csv)
_PATH_COLUMNS = {"path", "file", "filename", "file_name", "filepath", "file_path", "image", "image_path", "img",
                 "img_path", "image_file", "image_name", "image_id", "id", "name"}
_LABEL_COLUMNS = {"label", "labels", "class", "class_name", "classname", "category", "target", "y"}


def _is_header(row: list[str], base: Path) -> bool:
    """Whether the first row names the columns: a known path column name, or a known label column name beside a
    first field that is no file (`img,class` must not become a data row and a class called "class")."""
    head = row[0].strip().lower()
    if head in _PATH_COLUMNS:
        return True
    label = row[1].strip().lower() if len(row) > 1 else ""
    return label in _LABEL_COLUMNS and not (base / row[0].strip()).is_file()


def load_csv(path: str | os.PathLike, storage_size: int | None = None, progress: bool = True) -> DataSplits:
    """A CSV of `path,label` rows (optional header; optional third column `split` = train/val/test).

    Relative paths are relative to the CSV's folder. Rows pointing to missing files are skipped.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise VitlabError(f"CSV file not found: {path}")
    base = path.parent
    skipped: list[tuple[str, str]] = []
    entries: dict[str, list[tuple[str, str]]] = {}
    labels_seen: dict[str, None] = {}  # insertion-ordered set
    rows = _csv_rows(path)
    first = next(rows, None)
    if first is not None and not _is_header(first, base):
        rows = itertools.chain([first], rows)  # not a header: a data row
    rowno = 0
    for rowno, row in enumerate(rows, 1):
        if len(row) < 2 or not row[0].strip() or not row[1].strip():
            skipped.append((f"{path}:row {rowno}", f"bad row {repr(row[:3])[:80]} (expected path,label)"))
            continue
        p = Path(row[0].strip()).expanduser()
        p = p if p.is_absolute() else base / p
        split = row[2].strip().lower() if len(row) > 2 and row[2].strip() else "train"
        split = next((s for s, names in SPLIT_FOLDERS.items() if split in names), None)
        if split is None:
            skipped.append((f"{path}:row {rowno}", f"unknown split {row[2].strip()[:40]!r} (use train, val or test)"))
            continue
        label = row[1].strip()
        entries.setdefault(split, []).append((str(p), label))
        labels_seen[label] = None
    if rowno == 0:
        raise VitlabError(f"{path} has no rows; expected lines of path,label")
    if all(_integer_label(lab) for lab in labels_seen):
        class_names = [str(v) for v in sorted(int(lab) for lab in labels_seen)]
        entries = {s: [(p, str(int(c))) for p, c in items] for s, items in entries.items()}
    else:
        class_names = sorted(labels_seen)
    return _build(entries, class_names, skipped, path.stem, storage_size, progress, str(path))
