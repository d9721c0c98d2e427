"""argparse types for numbers with a range: a bad value is refused while the flags are read, as
one line naming the flag ("argument --batch-size: expected a whole number >= 1, got 0")."""

from __future__ import annotations

import argparse
import math

# The help of --threads, which `vitlab.runtime.setup_runtime` decides (defined here: runtime imports torch).
THREADS_HELP = ("CPU threads for torch (default: automatic - one per core on an idle machine, "
                "1 when the load average is already >= the number of cores)")


def _number(text: str, kind: type) -> float:
    try:
        value = kind(text)
    except ValueError:
        word = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {word}, got {text!r}") from None
    if not math.isfinite(value):  # float('nan') parses, then passes every range check
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """A count of at least one (batch sizes, neighbours, seeds)."""
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """A count that may be 0 (images to show, with 0 leaving an analysis out; head classes, 0 being no head)."""
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value}")
    return value


MAX_SEED = 2**32 - 1  # numpy's legacy seeding and most samplers take 32 bits; torch's take 64


def seed_value(text: str) -> int:
    """A random seed: a whole number from 0 to MAX_SEED."""
    value = int(_number(text, int))
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a seed from 0 to {MAX_SEED}, got {value}")
    return value


def fraction(text: str) -> float:
    """A share of the data in [0, 1)."""
    value = _number(text, float)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {value:g}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value:g}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value:g}")
    return value
