"""Image sources made of files: a folder with one subfolder per class, or a CSV of `path,label[,split]`.

Every file's header is checked once up front (cheap: no pixel decoding) so missing, empty, non-image
and oversized files are skipped and listed before training starts; files whose pixels turn out to be
corrupt are caught when decoded. Images are stored at one square size (shorter side resized, then
centre-cropped) so they batch: by default the median shorter side, capped at 256 (enough for a
224-pixel model with a crop fraction of 0.875).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from vitlab.data.dataset import DataSplits, FileImageDataset
from vitlab.data.images import BadImageError, check_image_header, is_image_file
from vitlab.errors import VitlabError

SPLIT_FOLDERS = {"train": ("train", "training"), "val": ("val", "valid", "validation"), "test": ("test", "testing")}
GREY_MODES = {"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"}
MAX_STORAGE_SIZE = 256


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
                              unit="file", disable=not progress or len(paths) < 2000, leave=False):
            infos.append(info)
            if bad:
                skipped.append(bad)
    return infos, skipped


def choose_storage_size(sizes: Sequence[tuple[int, int]], requested: int | None = None) -> int:
    """The square size images are stored at: `requested`, else the median shorter side capped at 256."""
    if requested:
        return int(requested)
    if not sizes:
        return 32
    shorter = np.array([min(w, h) for w, h in sizes])
    return int(max(1, min(MAX_STORAGE_SIZE, int(np.median(shorter)))))


def _files_of_class(folder: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """Image files under a class folder (recursively, hidden entries ignored) and the non-image files."""
    images, others = [], []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if f.startswith("."):
                continue
            p = os.path.join(dirpath, f)
            (images if is_image_file(p) else others).append(p)
    return images, [(p, f"not an image (extension {Path(p).suffix or 'none'})") for p in others]


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
    size = choose_storage_size([(w, h) for w, h, _ in good], storage_size)
    channels = 1 if all(m in GREY_MODES for _, _, m in good) else 3
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
    for split, folder in roots.items():
        classes = _subdirs(folder)
        if not classes:
            if split == "train":
                loose = [p for p in folder.iterdir() if p.is_file() and is_image_file(p)]
                hint = " (it has images but no class subfolders)" if loose else ""
                raise VitlabError(f"{folder} has no class subfolders{hint}; put each class in its own folder "
                                  f"({folder}/CLASS/image.jpg) or use a CSV of path,label")
            continue
        entries[split] = []
        for cdir in classes:
            imgs, others = _files_of_class(cdir)
            skipped.extend(others)
            entries[split].extend((p, cdir.name) for p in imgs)
            if cdir.name not in class_names:
                class_names.append(cdir.name)
                class_paths[cdir.name] = str(cdir) if len(roots) == 1 else str(root / "*" / cdir.name)
    class_names.sort()
    return _build(entries, class_names, skipped, root.name or str(root), storage_size, progress, str(root),
                  class_paths)


def load_csv(path: str | os.PathLike, storage_size: int | None = None, progress: bool = True) -> DataSplits:
    """A CSV of `path,label` rows (optional header; optional third column `split` = train/val/test).

    Relative paths are relative to the CSV's folder. Rows pointing to missing files are skipped.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise VitlabError(f"CSV file not found: {path}")
    with path.open(newline="", encoding="utf-8-sig") as fh:
        rows = [r for r in csv.reader(fh) if r and any(c.strip() for c in r) and not r[0].lstrip().startswith("#")]
    if rows and rows[0][0].strip().lower() in ("path", "file", "filename", "image", "filepath"):
        rows = rows[1:]
    if not rows:
        raise VitlabError(f"{path} has no rows; expected lines of path,label")
    base = path.parent
    skipped: list[tuple[str, str]] = []
    entries: dict[str, list[tuple[str, str]]] = {}
    labels_seen: list[str] = []
    for lineno, row in enumerate(rows, 1):
        if len(row) < 2 or not row[0].strip() or not row[1].strip():
            skipped.append((f"{path}:row {lineno}", f"bad row {row!r} (expected path,label)"))
            continue
        p = Path(row[0].strip()).expanduser()
        p = p if p.is_absolute() else base / p
        split = row[2].strip().lower() if len(row) > 2 and row[2].strip() else "train"
        split = next((s for s, names in SPLIT_FOLDERS.items() if split in names), None)
        if split is None:
            skipped.append((f"{path}:row {lineno}", f"unknown split {row[2].strip()!r} (use train, val or test)"))
            continue
        label = row[1].strip()
        entries.setdefault(split, []).append((str(p), label))
        if label not in labels_seen:
            labels_seen.append(label)
    if all(lab.lstrip("-").isdigit() for lab in labels_seen):
        class_names = [str(v) for v in sorted(int(lab) for lab in labels_seen)]
        entries = {s: [(p, str(int(c))) for p, c in items] for s, items in entries.items()}
    else:
        class_names = sorted(labels_seen)
    return _build(entries, class_names, skipped, path.stem, storage_size, progress, str(path))
