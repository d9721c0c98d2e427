"""Labels that are class numbers, as Hugging Face data sets, Parquet files and tar shards give them without names.

A class number is an index: its classes are '0' .. 'K-1' with K = the largest number + 1, so that the numbers keep
their meaning (a subset of ImageNet's classes still lines up with a 1000-class head). Two things make that unsafe
unchecked: one huge number (a corrupt row, a hash used as a label) would make billions of classes, and a column of
floats (pandas turns an integer column with one missing value into floats) must still be read as numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from vitlab.errors import VitlabError

# More class numbers than any public classification set has (ImageNet-21k: 21,843; iNaturalist 2021: 10,000)
MAX_CLASSES = 100_000


def read_label(value, where: str):
    """A raw label as vitlab reads it: an int for a class number (1.0 too), a str for a class name, None for no
    label (None, NaN, a negative number: -1 is Hugging Face's "unlabelled")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (bool, np.bool_)):
        raise VitlabError(f"{where}: label {value!r} is a truth value; labels are class numbers or class names")
    if isinstance(value, (int, np.integer)):
        return int(value) if value >= 0 else None
    if isinstance(value, (float, np.floating)):
        if math.isnan(value):
            return None
        if float(value).is_integer():
            return int(value) if value >= 0 else None
        raise VitlabError(f"{where}: label {value!r} is not a whole number; labels are class numbers "
                          "(0, 1, 2, ...) or class names")
    raise VitlabError(f"{where}: label {value!r} ({type(value).__name__}) is neither a class number nor a name")


def class_number_names(numbers: Iterable[int], where: str) -> tuple[list[str], str | None]:
    """Names '0' .. 'K-1' for class numbers (K = the largest + 1) and a note naming the classes with no image, or
    None; a largest number beyond MAX_CLASSES is refused in one line."""
    seen = set(numbers)
    if not seen:
        return [], None
    top = max(seen)
    if top >= MAX_CLASSES:
        raise VitlabError(f"{where}: label {top} would make {top + 1:,} classes (class numbers are indices 0..K-1; "
                          f"at most {MAX_CLASSES:,}); check that column, or give the classes by name")
    empty = [i for i in range(top + 1) if i not in seen]
    note = None
    if empty:
        shown = ", ".join(map(str, empty[:8])) + (", ..." if len(empty) > 8 else "")
        note = (f"{where}: {len(empty)} of the {top + 1} classes numbered 0..{top} have no image ({shown}); "
                "class numbers are indices, so they stay in the head")
    return [str(i) for i in range(top + 1)], note
