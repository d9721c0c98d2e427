"""Seeded, stratified selection: train/val/test splits, class subsets with relabelling, N images per class."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from vitlab.data.labels import number_label
from vitlab.errors import VitlabError


def stratified_split(labels, fractions: Sequence[float], seed: int = 0) -> list[np.ndarray]:
    """Split indices into len(fractions)+1 parts (the first is the rest, e.g. train), class by class.

    For each class (in label order) the indices are shuffled with one numpy generator seeded by `seed`
    and part k gets round(n_class * fractions[k]) of them, so each part keeps the class proportions.
    At least one image per class stays in the first part. Each part is returned sorted.
    """
    labels = np.asarray(labels, dtype=np.int64)
    fr = [float(f) for f in fractions]
    if any(f < 0 for f in fr) or sum(fr) >= 1.0:
        raise VitlabError(f"split fractions must be >= 0 and sum to less than 1, got {fr}")
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in range(len(fr) + 1)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n = len(idx)
        counts = [int(round(n * f)) for f in fr]
        while sum(counts) > n - 1 and sum(counts) > 0:  # keep one for training
            k = int(np.argmax(counts))
            counts[k] -= 1
        start = n - sum(counts)
        parts[0].append(idx[:start])
        for k, cnt in enumerate(counts):
            parts[k + 1].append(idx[start:start + cnt])
            start += cnt
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for p in parts]


def take_per_class(labels, n: int, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """Seeded choice of `n` indices per class (all of a class if it has fewer); returns (sorted indices, short classes)."""
    labels = np.asarray(labels, dtype=np.int64)
    if n < 1:
        raise VitlabError(f"--per-class must be at least 1, got {n}")
    rng = np.random.default_rng(seed)
    chosen, short = [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        if len(idx) < n:
            short.append(int(c))
            chosen.append(idx)
        else:
            chosen.append(rng.choice(idx, size=n, replace=False))
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64), short


def _norm(name: str) -> str:
    return re.sub(r"\s+", " ", str(name).strip().strip("\"'")).casefold()


def _spaced(name: str) -> str:
    return re.sub(r"\s+", " ", str(name).strip().strip("\"'"))


def _loose(name: str) -> str:
    return re.sub(r"[^0-9a-z]", "", _norm(name))


def _number(name: str) -> str:
    num = number_label(str(name))
    return "" if num is None else str(num)


# How a requested class is matched to a class name, strictest first; the first way that matches decides, so an
# exact "Cat" picks the class "Cat" even beside a class "cat". An empty key matches nothing.
_MATCHES = (("exact", lambda n: str(n).strip()), ("spaces", _spaced), ("case", _norm), ("letters and digits", _loose),
            ("number", _number))


def parse_classes(text: str | Sequence | None) -> list[str] | None:
    """`"Sandal,Sneaker,Ankle boot"` -> ["Sandal", "Sneaker", "Ankle boot"]; lists pass through; None stays None."""
    if text is None:
        return None
    if isinstance(text, str):
        items = [t.strip().strip("\"'").strip() for t in text.split(",")]
    else:
        for t in text:  # a YAML list may nest lists (or aliases of them, a few bytes that expand without end)
            if not isinstance(t, (str, int)) or isinstance(t, bool):
                raise VitlabError(f"classes: each item must be a class name or number, got a {type(t).__name__}")
        items = [str(t).strip() for t in text]
    items = [t for t in items if t]
    return items or None


def _match(item, class_names: Sequence[str]) -> int | None:
    """The index of the class `item` names (see _MATCHES), None when none does; several classes that match it
    equally well (`--classes CAT` beside `Cat` and `cat`) are refused as ambiguous."""
    for how, key in _MATCHES:
        want = key(item)
        if not want:
            continue
        found = [i for i, n in enumerate(class_names) if key(n) == want]
        if len(found) == 1:
            return found[0]
        if found:
            shown = ", ".join(repr(class_names[i]) for i in found[:8])
            raise VitlabError(f"class {item!r} is ambiguous: it matches {shown} only by {how}; "
                              "give the class name exactly as written")
    return None


def resolve_classes(requested: Sequence, class_names: Sequence[str]) -> list[int]:
    """Map requested names or indices to class indices, in the requested order. A name is matched exactly first, then
    with spaces as typed, then case-insensitively, then by its letters and digits (`tshirt` for `T-shirt`), then as
    a number (`007` for `7`); an index (`3`) is the last resort."""
    out: list[int] = []
    for item in requested:
        idx = _match(item, class_names)
        key = _norm(item)
        if idx is None and key.lstrip("-").isdigit() and 0 <= int(key) < len(class_names):
            idx = int(key)
        elif idx is None:
            shown = ", ".join(class_names[:30]) + (", ..." if len(class_names) > 30 else "")
            raise VitlabError(f"unknown class {item!r}; the classes are: {shown}")
        if idx in out:
            raise VitlabError(f"class {class_names[idx]!r} is given twice in --classes")
        out.append(idx)
    if not out:
        raise VitlabError("--classes is empty; give class names separated by commas")
    return out


def class_subset_map(selected: Sequence[int], num_classes: int) -> np.ndarray:
    """Old label -> new label (position in `selected`), -1 for dropped classes."""
    mapping = np.full(num_classes, -1, dtype=np.int64)
    mapping[np.asarray(selected, dtype=np.int64)] = np.arange(len(selected))
    return mapping


def nested_order(labels, seed: int = 0) -> np.ndarray:
    """A seeded order of all indices whose every prefix is class-stratified: subset of size n = `order[:n]`.

    Each class is shuffled once; its k-th image gets the key (k + 0.5) / class size, and the order sorts by
    that key (ties by class). So the first n hold round(n * class share) images of each class to within one,
    and a smaller subset always lies inside a larger one (`take_per_class` draws each size afresh: not nested).
    """
    labels = np.asarray(labels, dtype=np.int64)
    rng = np.random.default_rng(seed)
    idx_parts, key_parts, cls_parts = [], [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        idx_parts.append(idx)
        key_parts.append((np.arange(len(idx)) + 0.5) / len(idx))
        cls_parts.append(np.full(len(idx), c))
    if not idx_parts:
        return np.zeros(0, dtype=np.int64)
    idx, key, cls = (np.concatenate(p) for p in (idx_parts, key_parts, cls_parts))
    return idx[np.lexsort((cls, key))]


def nested_subset(labels, n: int, seed: int = 0) -> np.ndarray:
    """The sorted indices of the first `n` (at most all) of `nested_order(labels, seed)`."""
    if n < 1:
        raise VitlabError(f"subset size must be at least 1, got {n}")
    return np.sort(nested_order(labels, seed)[:n])
