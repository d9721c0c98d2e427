"""Classify image files with any loadable weights, using the preprocessing stored with the weights
(or the format's standard one) and the stored class names."""

from __future__ import annotations

import collections
import csv
import fnmatch
import glob
import io
import itertools
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.progress import bar_options


@dataclass
class Prediction:
    """Top-k classes of one image: `labels[i]` with probability `probs[i]` (class index `indices[i]`)."""

    path: str
    labels: list[str]
    probs: list[float]
    indices: list[int]

    def top(self) -> list[dict]:
        """The ranked classes as JSON objects (`--format json`, `vitlab serve`)."""
        return [{"rank": r + 1, "label": label, "index": i, "probability": p}
                for r, (label, p, i) in enumerate(zip(self.labels, self.probs, self.indices))]


def top_predictions(logits: torch.Tensor, names: list[str], k: int, paths: list) -> list[Prediction]:
    """The top-k classes of each row of (B, K) logits, as Predictions named by `paths`."""
    top = logits.float().softmax(dim=-1).cpu().topk(k, dim=-1)
    return [Prediction(str(path), [names[j] for j in i.tolist()], p.tolist(), i.tolist())
            for path, p, i in zip(paths, top.values, top.indices)]


def classes_of(model: nn.Module) -> int:
    """The model's number of classes; a feature extractor (no head) is refused in one line."""
    if not model.config.num_classes:
        raise VitlabError("these weights have no classification head (a feature extractor); "
                          "fine-tune them first (vitlab.load(..., num_classes=K))")
    return model.config.num_classes


def collect_images(inputs: Iterable[str | Path]) -> tuple[list[Path], list[tuple[str, str]]]:
    """Image files named directly or found (recursively, sorted) in folders; (files, skipped non-images)."""
    from vitlab.data.images import is_image_file

    files: list[Path] = []
    skipped: list[tuple[str, str]] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = [f for f in _walk_files(p, skipped) if _listed(f, skipped)]
            if not found:
                raise VitlabError(f"no image files in {p} (looked for {', '.join(_extensions())})")
            files += found
        elif p.is_file():
            files.append(p)
        elif glob.has_magic(str(item)):  # a quoted pattern, or a shell that does not expand them (Windows)
            matched = [m for m in _expand_pattern(str(Path(item).expanduser()))
                       if m.is_file() and is_image_file(m)]
            if not matched:
                raise VitlabError(f"no image file matches {item}")
            files += matched
        elif p.exists():
            raise VitlabError(f"{p} is not a regular file (a FIFO, a device or a socket); give image files or folders")
        else:
            raise VitlabError(f"no such image file or folder: {p}")
    return files, skipped


def _listed(f: Path, skipped: list[tuple[str, str]]) -> bool:
    """Whether a file found in a folder is an image to read; anything else is listed in `skipped` with why."""
    from vitlab.data.images import is_image_file

    if f.is_file():  # through links
        if is_image_file(f):
            return True
        skipped.append((str(f), "not an image file name"))
    elif f.exists():  # a FIFO, a device or a socket (never opened: a FIFO blocks, /dev/zero never ends)
        skipped.append((str(f), "not a regular file (a FIFO, a device or a socket)"))
    else:
        skipped.append((str(f), "dangling link (its target does not exist)"))
    return False


def _walk_files(top: Path, skipped: list[tuple[str, str]]) -> list[Path]:
    """Every non-folder entry under `top` (sorted), hidden entries left out.

    Links to folders are followed (a symlink farm holds its photos in other folders, and the data loader reads
    them), but each folder is walked once, by device and inode, so `ln -s .. up` is listed and ends the walk.
    An explicit stack, not recursion: a tree 1,500 folders deep raised RecursionError in `Path.rglob`.
    Hidden entries are left out, as the data loader leaves them out (data/files.py): macOS's `._x.jpg` files
    are metadata, not images, and `.ipynb_checkpoints/` holds copies."""
    found: list[Path] = []
    seen: set[tuple[int, int]] = set()
    stack = [top]
    while stack:
        folder = stack.pop()
        try:
            st = folder.stat()
            if (st.st_dev, st.st_ino) in seen:
                skipped.append((str(folder), "folder already walked (a link loop, or a second link to it); not walked again"))
                continue
            seen.add((st.st_dev, st.st_ino))
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            skipped.append((str(folder), f"unreadable folder ({exc.strerror or exc})"))
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                is_dir = entry.is_dir()  # through links
            except OSError:
                is_dir = False
            (stack if is_dir else found).append(Path(entry.path))
    return sorted(found)


def _expand_pattern(pattern: str) -> list[Path]:
    """The paths a glob pattern matches (`**` any number of folders), sorted. glob.glob's `**` follows links into
    folders without end: two `ln -s .. up` links made `vitlab predict W 'photos/**/*.png'` run forever. So for
    `**` the folder before the first wildcard is walked once (`_walk_files`) and each path matched part by part;
    a pattern without `**` reaches a fixed depth, and glob.glob looks only into the folders it matches."""
    parts = Path(pattern).parts
    if "**" not in parts:
        return sorted(Path(m) for m in glob.glob(pattern))
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    base, rest = Path(*parts[:fixed]) if fixed else Path("."), parts[fixed:]
    found = _walk_files(base, []) if base.is_dir() else []
    if rest[-1] == "**":  # glob.glob's `DIR/**` also lists the folders; only files are read anyway
        rest = (*rest, "*")
    return [f for f in found if _matches(f.relative_to(base).parts, rest)]


def _matches(parts: tuple[str, ...], patterns: tuple[str, ...]) -> bool:
    """Whether path parts match pattern parts, `**` standing for any number of folders (as in glob.glob)."""
    if not patterns:
        return not parts
    if patterns[0] == "**":
        return any(_matches(parts[i:], patterns[1:]) for i in range(len(parts)))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], patterns[0]) and _matches(parts[1:], patterns[1:])


def _extensions() -> tuple[str, ...]:
    from vitlab.data.images import IMAGE_EXTENSIONS

    return IMAGE_EXTENSIONS


def non_finite_error(bad: int, total: int, what: str = "logits") -> VitlabError:
    """The one line for a model whose outputs are NaN or inf: shown instead of 'nan%' and exit 0."""
    return VitlabError(f"the model produced non-finite {what} (NaN or inf) for {bad} of {total} images: the weights "
                       "or their stored preprocessing are broken (NaN/inf weights, std 0, layer_norm_eps NaN); "
                       "re-save or re-download the weights")


def class_names_for(meta: dict, num_classes: int) -> list[str]:
    names = meta.get("class_names")
    if names and len(names) == num_classes:
        return list(names)
    return [f"class_{i}" for i in range(num_classes)]


def preprocess_for(model: nn.Module, meta: dict):
    """The evaluation preprocessing stored with the weights, else the model's standard one."""
    from vitlab.data.preprocess import Preprocess

    pre = meta.get("preprocess")
    if pre is None or isinstance(pre, dict):
        pre = Preprocess.from_dict(pre) if pre else Preprocess.for_model(model.config.image_size, model.config.in_chans)
    return pre


READ_AHEAD_WORKERS = 2  # threads reading images ahead for `vitlab predict`; 0: in turn (benchmarks/decode.py)


def prefetched(items: list, work, ahead: int, workers: int | None = None) -> Iterator[tuple]:
    """(item, future of work(item)) in order, with up to `ahead` items worked on in threads beforehand: image
    decoding (Pillow releases the GIL) overlaps the model and the other images. The same numbers as in turn."""
    from concurrent.futures import Future, ThreadPoolExecutor

    workers = READ_AHEAD_WORKERS if workers is None else workers
    if workers < 1:
        for item in items:
            done: Future = Future()
            try:
                done.set_result(work(item))
            except Exception as exc:  # noqa: BLE001 - handed to the caller, as a worker thread would
                done.set_exception(exc)
            yield item, done
        return
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vitlab-read")
    try:
        pending: collections.deque = collections.deque()
        rest = iter(items)
        for item in itertools.islice(rest, max(ahead, 1)):
            pending.append((item, pool.submit(work, item)))
        while pending:
            item, future = pending.popleft()
            following = next(rest, _END)
            if following is not _END:
                pending.append((following, pool.submit(work, following)))
            yield item, future
    finally:  # also when the caller stops early (a bad image): queued work is dropped, not waited for
        pool.shutdown(wait=True, cancel_futures=True)


_END = object()


@torch.no_grad()
def predict_files(
    model: nn.Module,
    meta: dict,
    files: list[Path],
    top_k: int = 5,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    progress: bool = False,
    strict: bool = True,
    engine_factory=None,
) -> tuple[list[Prediction], list[tuple[str, str]]]:
    """Predictions for `files` and the (path, reason) of images that could not be read.

    With `strict`, an unreadable image raises its one-line VitlabError instead of being skipped.
    `engine_factory()` returns an engine (`vitlab.engine.prepare_engine`) to run instead of eager PyTorch, or None;
    it is called when the first batch is ready, so a bad first image still fails in one line before anything is built.
    """
    from tqdm import tqdm

    from vitlab.data.images import open_image

    num_classes = classes_of(model)
    pre = preprocess_for(model, meta)
    names = class_names_for(meta, num_classes)
    k = max(1, min(top_k, num_classes))
    model = model.to(device).eval()
    runner = None
    results: list[Prediction] = []
    failed: list[tuple[str, str]] = []
    batch: list[tuple[Path, torch.Tensor]] = []
    non_finite = [0]  # images whose logits hold NaN or inf, counted over all batches

    def flush() -> None:
        nonlocal runner
        if not batch:
            return
        x = torch.stack([t for _, t in batch]).to(device)
        if runner is None:
            runner = (engine_factory() if engine_factory else None) or model
        with torch.inference_mode():
            logits = runner(x).float()
        non_finite[0] += int((~torch.isfinite(logits).all(dim=-1)).sum())
        results.extend(top_predictions(logits, names, k, [path for path, _ in batch]))
        batch.clear()

    colour: list[tuple[int, Path]] = []  # colour images given to a grey model (appended from the reading threads)
    grey_model = getattr(pre, "channels", 3) == 1

    def read(item: tuple[int, Path]) -> torch.Tensor:
        image = open_image(item[1])
        if grey_model and has_colour(image):
            colour.append(item)  # with its position: the threads finish in any order
        return pre(image)

    for (_, path), tensor in tqdm(prefetched(list(enumerate(files)), read, ahead=2 * batch_size), total=len(files),
                                  desc="predict", unit="img", disable=not progress, **bar_options()):
        try:
            x = tensor.result()
        except VitlabError as exc:
            if strict:
                raise
            failed.append((str(path), str(exc)))
            continue
        batch.append((path, x))
        if len(batch) >= batch_size:
            flush()
    flush()
    if non_finite[0]:
        raise non_finite_error(non_finite[0], len(results))
    if colour:  # a photo given to a grey 28 px model answers, but about an input far from what it learnt
        first = min(colour)[1].name  # the first in the order given, whichever thread finished first
        print(f"vitlab: the model takes grey images: {len(colour)} colour image{'s' * (len(colour) != 1)} "
              f"({first}{', ...' if len(colour) > 1 else ''}) converted to grey", file=sys.stderr)
    return results, failed


def has_colour(image) -> bool:
    """Whether a decoded image (grey stays L, colour is RGB after open_image) has any pixel whose channels differ:
    an RGB file of a grey picture is grey."""
    if image.mode != "RGB":
        return False
    from PIL import ImageChops

    r, g, b = image.split()
    return ImageChops.difference(r, g).getbbox() is not None or ImageChops.difference(g, b).getbbox() is not None


def shown(text: str) -> str:
    """A path or a class name as the table and CSV print it (`images.one_line`): one line, and a name that is not
    UTF-8 with `\\xNN` for its bytes. Printed as they were, such names made `vitlab predict` stop with
    UnicodeEncodeError wherever stdout is strict UTF-8 (any UTF-8 locale but C.UTF-8), after every image was
    classified; a class name with a line break (a weights file's label) broke the table's lines."""
    from vitlab.data.images import one_line

    return one_line(text)


def format_predictions(preds: list[Prediction], fmt: str = "table") -> str:
    """Render as an aligned text table, JSON (a list of objects) or CSV (one row per image and rank)."""
    if fmt == "json":
        return json.dumps([{"path": p.path, "top": p.top()} for p in preds], indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["path", "rank", "label", "index", "probability"])
        for p in preds:
            for r, (lab, pr, i) in enumerate(zip(p.labels, p.probs, p.indices)):
                w.writerow([shown(p.path), r + 1, shown(lab), i, f"{pr:.6f}"])
        return buf.getvalue().rstrip("\n")
    if fmt != "table":
        raise VitlabError(f"unknown output format {fmt!r}; use table, json or csv")
    lines = []
    for p in preds:
        lines.append(shown(p.path))
        labels = [shown(lab) for lab in p.labels]
        width = max(len(lab) for lab in labels)
        for r, (lab, pr) in enumerate(zip(labels, p.probs)):
            lines.append(f"  {r + 1}. {lab:<{width}}  {100 * pr:6.2f}%")
    return "\n".join(lines)


def predict(
    weights: str | Path,
    images: Iterable[str | Path],
    top_k: int = 5,
    batch_size: int = 32,
    device: str | None = None,
    progress: bool = False,
    engine: str = "torch",
    int8: str | None = None,
    calibration: str | Path | None = None,
    **load_overrides,
) -> list[Prediction]:
    """Load `weights` (any supported format) and classify the images / folders of images (patterns too).

    `engine`: "torch" (eager, on `device`) or, on the CPU, what `vitlab predict --engine` takes: "auto" (the fastest
    exact engine, timed once per machine and cached beside the weights), "onnxruntime", "compiled", "openvino".
    `int8`: None, "auto", "static" or "dynamic" as `vitlab predict --int8`; static int8 calibrates on
    `calibration` (a folder of images or a --data source), or on a training run's own training images.
    Each `Prediction` has `.path`, `.labels`, `.probs`, `.indices` and `.top()` (ranked dicts, as JSON)."""
    from vitlab.runtime import device_for_engine, resolve_device
    from vitlab.weights import load_with_meta, resolve_model

    device = resolve_device(device_for_engine(device, engine, int8))
    model, meta = load_with_meta(weights, **load_overrides)
    files, _ = collect_images(images)
    if meta.get("zero_head"):
        print("vitlab predict: warning: the classification head in these weights is all zeros (an ImageNet-21k "
              "pre-training file); the probabilities are uniform - fine-tune first", file=sys.stderr)

    def make_engine():  # the command's own choice (`vitlab predict --engine/--int8/--calibration`)
        from types import SimpleNamespace

        from vitlab.commands._engine_args import engine_for, run_calibration

        pre = preprocess_for(model, meta)
        flags = SimpleNamespace(engine=engine, int8=int8, calibration=str(calibration) if calibration else None,
                                quiet=not progress)
        return engine_for(flags, model, source=resolve_model(weights), preprocess=pre,
                          batch_size=min(batch_size, len(files)), device=device, command="predict",
                          default_calibration=lambda: run_calibration(weights, pre), release=True)

    return predict_files(model, meta, files, top_k, batch_size, device, progress, engine_factory=make_engine)[0]
