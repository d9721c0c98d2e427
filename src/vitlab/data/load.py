"""`load_data(source, ...)`: one entry point for every source, giving seeded, stratified `DataSplits`.

Sources: `fashion-mnist[:DIR]`, `mnist[:DIR]`, `cifar10[:PATH]`, `cifar100[:PATH]`,
`cifar100-coarse[:PATH]`, `digits`, `bundled`, a folder of class subfolders, a CSV of path,label,
tar shards in the WebDataset layout (a folder of .tar, `DIR/train-{000000..000009}.tar`, a glob) and
Hugging Face datasets (`hf:DIR` for save_to_disk or Parquet, `hf:imagefolder:DIR`; see hf_datasets.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from vitlab.data.dataset import DataSplits, FileImageDataset, ImageDataset, skipped_summary
from vitlab.data.duplicates import copy_notes
from vitlab.data.images import StoredSquare
from vitlab.data.splits import (
    class_subset_map,
    parse_classes,
    resolve_classes,
    stratified_split,
    take_per_class,
)
from vitlab.errors import VitlabError

NAMED_SOURCES = ("fashion-mnist", "mnist", "cifar10", "cifar100", "cifar100-coarse", "digits", "bundled")
_ALIASES = {"fashion_mnist": "fashion-mnist", "fashionmnist": "fashion-mnist", "fmnist": "fashion-mnist",
            "cifar-10": "cifar10", "cifar-100": "cifar100", "sklearn-digits": "digits"}

# Decode file sources into memory when they need less than this many bytes (VITLAB_DATA_MEMORY_MB overrides).
DEFAULT_MEMORY_BUDGET = 2 * 1024**3


def _split_source(source: str) -> tuple[str | None, str | None]:
    """'cifar10:/x' -> ('cifar10', '/x'); 'mnist' -> ('mnist', None); a path -> (None, path)."""
    head, sep, rest = source.partition(":")
    key = _ALIASES.get(head.lower(), head.lower())
    if key in NAMED_SOURCES and (sep == "" or rest):
        return key, (rest or None)
    return None, source


def is_builtin_source(source: str) -> bool:
    """Whether `source` names a built-in data set (Fashion-MNIST, CIFAR, ...: fixed image sizes), not files."""
    return _split_source(str(source))[0] is not None


def _prefix_and_path(text: str) -> tuple[str, str]:
    """`cifar10:/x` -> ('cifar10:', '/x'), `hf:imagefolder:d` -> ('hf:imagefolder:', 'd'), a path -> ('', path)."""
    key, _ = _split_source(text)
    prefix = f"{text.partition(':')[0]}:" if key is not None else next(
        (p for p in ("hf:imagefolder:", "hf:parquet:", "hf:") if text.startswith(p)), "")
    return prefix, text[len(prefix):]


def source_folders(source: str) -> list[Path]:
    """The local folders whose files `source` reads: a folder given as the data (class folders, shards, a saved
    Hugging Face dataset, mnist:DIR, ...) and the folders its first two levels link to (class folders kept
    elsewhere: the loader follows those links), or the folder of a shard pattern or a .tar. None for a name
    without a path, a URL, a CSV or another single file (a CSV reads the files its rows name, never a folder).
    What `vitlab data shard` keeps its OUT apart from."""
    _, rest = _prefix_and_path(str(source).strip())
    if not rest or "://" in rest:
        return []
    path = Path(rest).expanduser()
    if path.is_dir():
        return [path, *_linked_folders(path)]
    if any(c in rest for c in "{*?[") or path.suffix.lower() == ".tar":
        while any(c in path.name for c in "{*?[") or path.suffix.lower() == ".tar":
            path = path.parent
        return [path]
    return []


def _linked_folders(root: Path, depth: int = 2) -> list[Path]:
    """The real folders that links among `root`'s subfolders (and theirs, to `depth`) lead to outside it."""
    real_root = os.path.realpath(root)
    found: list[Path] = []
    try:
        subs = [p for p in root.iterdir() if p.is_dir()]
    except OSError:
        return found
    for sub in subs:
        real = os.path.realpath(sub)
        if sub.is_symlink() and not (real + os.sep).startswith(real_root + os.sep):
            found.append(Path(real))
        if depth > 1 and not sub.is_symlink():
            found.extend(_linked_folders(sub, depth - 1))
    return found


def _spellings(path: Path) -> set[Path]:
    """`path` absolute as written (`..` folded) and with every link resolved: either may be how it nests."""
    path = Path(path).expanduser()
    return {Path(os.path.abspath(path)), Path(os.path.realpath(path))}


def nesting(out: Path, folders: list[Path]) -> tuple[str, Path] | None:
    """How a folder to write, `out`, nests with the first of `folders` it nests with ("is", "is inside" or
    "holds", and that folder), by the paths as written and as links resolve them; None where it is apart."""
    for folder in folders:
        for o in _spellings(out):
            for f in _spellings(folder):
                if o == f or f in o.parents:
                    return ("is" if o == f else "is inside"), folder
                if o in f.parents:
                    return "holds", folder
    return None


def absolute_source(source: str) -> str:
    """`source` with its local path made absolute (`photos` -> `/home/me/photos`, `hf:data` -> `hf:/home/me/data`,
    `shards/train-{0..9}.tar` -> `/home/me/shards/train-{0..9}.tar`), as a run records it: a relative path read
    again from another folder (a resume, `vitlab evaluate RUN`) would name other data, or none. Names, URLs and
    paths that do not exist here are returned as given."""
    text = str(source).strip()
    prefix, rest = _prefix_and_path(text)
    if not rest or "://" in rest:
        return text
    path = Path(rest).expanduser()
    if path.is_absolute():
        # one spelling per folder: '/data/shapes/' (what tab completion writes) and '/data/shapes/.' were other
        # strings than the '/data/shapes' a run recorded, so `vitlab evaluate RUN --data /data/shapes/` did not
        # know its own data and tested on the run's training images
        return prefix + os.path.normpath(rest) if "://" not in rest else text
    if path.exists():
        return prefix + str(path.resolve())
    if any(c in path.name for c in "{*?[") and path.parent.is_dir():  # a shard or file pattern: its folder
        return prefix + str(path.parent.resolve() / path.name)
    return text


def read_source(source: str, storage_size: int | None = None, progress: bool = True,
                model_side: int | None = None) -> DataSplits:
    """Open a source as it is on disk (its own splits only, original classes, nothing decoded yet for files);
    `model_side`: see `load_data`."""
    source = str(source).strip()
    if not source:
        raise VitlabError("no data source given; use e.g. --data fashion-mnist, --data bundled or --data PATH")
    key, path = _split_source(source)
    if key in ("fashion-mnist", "mnist"):
        from vitlab.data.idx import load_idx_dataset

        return load_idx_dataset(key, path)
    if key in ("cifar10", "cifar100", "cifar100-coarse"):
        from vitlab.data.cifar import load_cifar

        return load_cifar(key.replace("-coarse", ""), path, coarse=key.endswith("-coarse"))
    if key == "digits":
        from vitlab.data.builtin import load_digits_dataset

        return load_digits_dataset()
    if key == "bundled":
        from vitlab.data.builtin import load_bundled

        return load_bundled()
    from vitlab.data.hf_datasets import is_hf_source
    from vitlab.data.shards import looks_like_shards

    if is_hf_source(path):
        from vitlab.data.hf_datasets import load_hf

        return load_hf(path, storage_size, progress, model_side)
    if looks_like_shards(path):
        from vitlab.data.shards import load_shards

        return load_shards(path, storage_size, progress, model_side)
    p = Path(path).expanduser()
    from vitlab.data.files import load_csv, load_folder

    if p.is_dir():
        from vitlab.data.idx import find_idx_files

        if find_idx_files(p):  # a folder of MNIST-style IDX files given by path
            if "fashion" in str(p.resolve()).lower():
                from vitlab.data.idx import load_idx_dataset

                return load_idx_dataset("fashion-mnist", p)
            raise VitlabError(f"{p} holds IDX files; say which data set they are: --data mnist:{p} "
                              f"or --data fashion-mnist:{p}")
        if (p / "data_batch_1.bin").is_file() or (p / "cifar-10-batches-bin").is_dir():
            raise VitlabError(f"{p} holds CIFAR-10 binary files; use --data cifar10:{p}")
        if (p / "train.bin").is_file() or (p / "cifar-100-binary").is_dir():
            raise VitlabError(f"{p} holds CIFAR-100 binary files; use --data cifar100:{p}")
        return load_folder(p, storage_size, progress, model_side)
    if p.is_file() and p.suffix.lower() in (".csv", ".tsv", ".txt"):
        return load_csv(p, storage_size, progress, model_side)
    if p.exists():
        raise VitlabError(f"cannot use {p} as data: give a folder of class subfolders, a CSV of path,label, "
                          "tar shards or a Hugging Face dataset (hf:PATH)")
    raise VitlabError(f"unknown data source {source!r}: not a folder, CSV file, shard spec or hf:PATH, "
                      f"nor one of {', '.join(NAMED_SOURCES)}")


def _carve_splits(splits: DataSplits, val_fraction: float, test_fraction: float, seed: int) -> DataSplits:
    """A missing val split carved from train (`val_fraction` of it), and a missing test split for sources without
    one (`test_fraction`), stratified by class."""
    need_val = splits.val is None and val_fraction > 0
    need_test = splits.test is None and test_fraction > 0
    if not (need_val or need_test):
        return splits
    base = splits.train
    fractions = [val_fraction if need_val else 0.0, test_fraction if need_test else 0.0]
    if min(val_fraction, test_fraction) < 0 or sum(fractions) >= 1.0:  # said with the flags that set them
        raise VitlabError(f"--val-fraction {val_fraction:g} and --test-fraction {test_fraction:g} leave no training "
                          "images (each >= 0, together below 1); lower them")
    tr_idx, va_idx, te_idx = stratified_split(base.labels.numpy(), fractions, seed)
    return replace(splits, train=base.subset(tr_idx), val=base.subset(va_idx) if need_val else splits.val,
                   test=base.subset(te_idx) if need_test else splits.test)


def _select_classes(splits: DataSplits, classes) -> DataSplits:
    requested = parse_classes(classes)
    if requested is None:
        if classes is not None:  # `--classes "$EMPTY"` (or ",") selected every class without a word
            raise VitlabError(f"--classes {str(classes)!r} names no class; give class names separated by commas, or "
                              "leave --classes out for all classes")
        return splits
    selected = resolve_classes(requested, splits.class_names)
    mapping = class_subset_map(selected, len(splits.class_names))
    names = [splits.class_names[i] for i in selected]

    def sub(ds):
        if ds is None:
            return None
        new = mapping[ds.labels.numpy()]
        keep = np.flatnonzero(new >= 0)
        out = ds.subset(keep)
        return out.relabel(new[keep], names)

    return DataSplits(sub(splits.train), sub(splits.val), sub(splits.test), names, splits.skipped,
                      splits.name, splits.channels, splits.notes)


def _memory_budget() -> int:
    """Bytes a file source may take decoded in memory: VITLAB_DATA_MEMORY_MB (a number of MiB; 0 streams every file
    source from disk), else DEFAULT_MEMORY_BUDGET. A value that is not such a number is one line, not a guess."""
    env = os.environ.get("VITLAB_DATA_MEMORY_MB", "").strip()
    if not env:
        return DEFAULT_MEMORY_BUDGET
    try:
        mib = float(env)
    except ValueError:
        mib = -1.0
    if not (0 <= mib < 2**40):  # also NaN and inf
        raise VitlabError(f"VITLAB_DATA_MEMORY_MB={env!r} is not a size: give a number of MiB (e.g. 512, no unit; "
                          f"0 streams file data from disk), or unset it for the default {DEFAULT_MEMORY_BUDGET // 1024**2}")
    return int(mib * 1024**2)


def load_data(source: str, *, classes=None, per_class: int | None = None, val_fraction: float = 0.1,
              test_fraction: float = 0.1, seed: int = 0, storage_size: int | None = None,
              in_memory: bool | None = None, progress: bool = True, report: bool | None = None,
              eval_splits: Sequence[str] = ("val", "test"), model_side: int | None = None,
              squash: bool = False, antialias: bool = True, shrink_to_model: bool = False,
              interpolation: str = "bilinear", crop_offset: str = "round",
              model_crop: tuple[int, int] | None = None) -> DataSplits:
    """Load a data source as seeded, stratified train / val / test splits.

    - Official splits are kept (train/test of MNIST, Fashion-MNIST, CIFAR, bundled; split folders; a CSV
      split column). A missing val split is carved from train (`val_fraction` of it); a missing test
      split, for sources without one, is carved too (`test_fraction`). Both are stratified by class, and carved
      over all the source's classes before `classes` selects some: an image's split never depends on the
      selection.
    - `classes`: names (an exact match first, then looser ones: `splits.resolve_classes`) or indices, a list or
      "A,B,C"; labels become positions in it.
    - `per_class`: keep N seeded training images per class (val and test stay whole), for few-shot and
      data-size studies.
    - File sources are stored at `storage_size` (default: median shorter side, at most 256, or at most
      `model_side` where that is more: the side the model reads, `Preprocess.model_side`) as the centre square,
      or with `squash` as the whole image resized to the square (a model whose preprocessing is a plain resize,
      `Preprocess.squashes`, so that evaluation sees a photo as `vitlab predict` gives it to the model), shrunk
      without anti-aliasing with `antialias=False` (TensorFlow's resize, `Preprocess.antialias`), with the
      model's filter (`interpolation`, `Preprocess.interpolation`), the centre square placed as the model places
      its crop (`crop_offset`, `Preprocess.crop_offset`: Hugging Face's models floor where torchvision rounds) and,
      given the crop the model cuts from a square stored at `model_side` (`model_crop`), so that crop lands where
      `vitlab predict`'s one crop of the photo does (`preprocess.square_start`), with
      `shrink_to_model` never stored above `model_side` (one resize from the file to what the model reads, as
      `vitlab predict` makes it; else a photo may be stored at 256 and resized again for a 224 model), and decoded
      into memory once when they fit in 2 GiB (`in_memory=None`), else streamed from disk. When
      streaming, the `eval_splits` (default val and test; add "train" to score the train split) are
      decoded once here and their failures dropped, so an evaluation never substitutes an image; a
      training file that fails later is replaced by a neighbour and counted in `.failures`
      (`all_skipped()`, `write_skipped`).
    - Unreadable files are skipped and listed in `.skipped`; `report` (default: `progress`) prints the
      one-line summary to stderr. `write_skipped(splits, run_dir)` writes the list into a run folder.
    """
    raw = read_source(source, storage_size, progress, model_side)
    if raw.train is None or len(raw.train) == 0:  # every training row skipped (a Hugging Face set of bad cells)
        first = f" (first: {raw.skipped[0][0]}: {raw.skipped[0][1]})" if raw.skipped else ""
        raise VitlabError(f"no usable image in {source} for training: {len(raw.skipped)} files skipped{first}; "
                          "check the files")
    # Splits are carved and --per-class drawn over all the source's classes, before --classes selects some: an
    # image's split must not depend on which other classes were selected, or in which order (a model trained on
    # the whole folder and then evaluated on a class subset was tested on its own training images).
    raw = _carve_splits(raw, val_fraction, test_fraction, seed)
    if per_class is not None:
        keep, short = take_per_class(raw.train.labels.numpy(), int(per_class), seed + 1)
        raw = replace(raw, train=raw.train.subset(keep))
    splits = _select_classes(raw, classes)
    train, val, test = splits.train, splits.val, splits.test
    notes = list(splits.notes)
    if per_class is not None:
        short_names = [raw.class_names[c] for c in short if raw.class_names[c] in splits.class_names]
        if short_names:
            notes.append(f"--per-class {per_class}: fewer training images than that for {', '.join(short_names)}; "
                         "kept all of them")
    skipped = list(splits.skipped)
    parts = {"train": train, "val": val, "test": test}
    file_parts = {k: v for k, v in parts.items() if isinstance(v, FileImageDataset)}
    if file_parts:
        for ds in file_parts.values():
            if shrink_to_model and model_side and ds.size > model_side:
                ds.size = int(model_side)  # a second resize (256 -> 224) would give the model another input
            # before anything is decoded; copies keep it. The model's crop is cut from the square as stored only
            # where the square has the side the model crops from (a smaller photo set is enlarged first)
            inner = tuple(model_crop) if model_crop and ds.size == model_side else None
            ds.stored = StoredSquare(squash, antialias, interpolation, crop_offset, inner)
        if in_memory is None:
            total = sum(len(v) * v.channels * v.size * v.size for v in file_parts.values())
            in_memory = total <= _memory_budget()
        for k, ds in file_parts.items():
            if in_memory:
                parts[k], bad = ds.materialize(progress=progress)
            elif k in eval_splits:
                # an evaluation split must score exactly its own images: decode each once now and
                # drop (and list) the failures, so streaming never has to substitute one later
                ds.substitute = False
                parts[k], bad = ds.verify(progress=progress)
            else:
                ds.substitute, bad = True, []  # training: counted in .failures, listed by write_skipped
            skipped.extend(bad)
    for k in ("val", "test"):
        if parts[k] is not None and len(parts[k]) == 0:
            parts[k] = None
    if parts["train"] is None or len(parts["train"]) == 0:
        first = f" (first: {skipped[0][0]}: {skipped[0][1]})" if skipped else ""
        raise VitlabError(f"no usable image in {source} for training: {len(skipped)} files skipped{first}; check the files")
    for k, v in parts.items():
        if v is not None:
            v.name = f"{splits.name}/{k}"
    notes += copy_notes(parts["train"], (("val", parts["val"]), ("test", parts["test"])))
    if progress if report is None else report:
        if skipped:
            print(skipped_summary(skipped), file=sys.stderr)
        for note in notes:  # what the loader noticed (classes without images, splits not read, ...)
            print(f"data: {note}", file=sys.stderr)
    return DataSplits(parts["train"], parts["val"], parts["test"], list(splits.class_names), skipped,
                      splits.name, splits.channels, notes)


__all__ = ["DataSplits", "ImageDataset", "NAMED_SOURCES", "load_data", "read_source"]
