"""Labels that are class numbers, as Hugging Face data sets, Parquet files and tar shards give them without names.

A class number is an index: its classes are '0' .. 'K-1' with K = the largest number + 1, so that the numbers keep
their meaning (a subset of ImageNet's classes still lines up with a 1000-class head). Two things make that unsafe
unchecked: one huge number (a corrupt row, a hash used as a label) would make billions of classes, and a column of
floats (pandas turns an integer column with one missing value into floats) must still be read as numbers.
Text labels (a CSV's) are read by the same rule (`number_label`), and every source orders classes by `class_order`.
"""

from __future__ import annotations

import math
import re
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


# A label written as a number: an integer ("7", "007", "-1") or an integral float ("1.0", "7.00"), at most 18 digits
# so that a long digit string (an ID, a hash) stays a name rather than a number no int64 holds
_NUMBER_TEXT = re.compile(r"[+-]?([0-9]{1,18})(?:\.0*)?")


def number_label(text: str) -> int | None:
    """The class number a text label (a CSV's) writes: `"007"`, `"7"` and `"7.0"` are all 7, as `read_label` reads
    Hugging Face's 7.0 as 7; None for a class name (`"cat"`, `"1.5"`, a 19-digit ID)."""
    m = _NUMBER_TEXT.fullmatch(text.strip())
    if m is None:
        return None
    return -int(m.group(1)) if text.strip().startswith("-") else int(m.group(1))


def class_order(names: Iterable[str]) -> list[str]:
    """Class names in label order: numerically when every name is a plain integer (`2` before `10`), else as text.

    Folders and CSV labels share it, so a class's id does not depend on the kind of source that named it."""
    names = list(dict.fromkeys(names))
    if names and all(re.fullmatch(r"-?[0-9]{1,18}", n) for n in names):
        return sorted(names, key=lambda n: (int(n), n))  # "007" and "7" (two folders) stay apart, in a fixed order
    return sorted(names)
