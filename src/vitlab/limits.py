"""The documented maxima of a model config and the typed checks that enforce them (below models, weights
and data, which all read them).

The maxima sit far above the largest published models (ViT-H/14: depth 32, width 1280, MLP 5120;
big_vision's ViT-e: width 1792, MLP 15360; BiT-R152x4: stem width 256, 8192 output channels), so
they stop a broken or hostile config (`"depth": 200000`) before anything is built, without
refusing any real model. docs/weights.md ("Limits") lists them.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from vitlab.errors import VitlabError

MAX_DEPTH = 256  # transformer blocks
MAX_WIDTH = 16384  # dim, representation size, conv-stem channels, ResNet stem width
MAX_MLP_DIM = 65536
MAX_IMAGE_SIZE = 4096  # pixels per side; also the largest patch
MAX_NUM_CLASSES = 1_000_000
MAX_IN_CHANS = 1024
MAX_CONV_STEM = 8  # conv-stem layers (each halves the image)
MAX_RESNET_STAGES = 8
MAX_STAGE_BLOCKS = 256  # blocks per ResNet stage (ResNet-152 has 36)
MAX_RESNET_CHANNELS = 4 * MAX_WIDTH  # channels of the last ResNet stage

LIMITS_DOC = "docs/weights.md, Limits"


def is_number(value: Any) -> bool:
    """A real number that is not a bool (Python or numpy scalar)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value: Any, low: int, high: int) -> int:
    """`value` as an int in [low, high]; integral floats (12.0 from a JSON file) are accepted."""
    ok = is_number(value) and math.isfinite(float(value)) and float(value) == int(value)
    if not ok or not low <= int(value) <= high:
        raise VitlabError(f"{name} must be an integer from {low} to {high} ({LIMITS_DOC}), got {value!r}")
    return int(value)


def check_float(name: str, value: Any, low: float, high: float, *, include_low: bool = True,
                include_high: bool = True) -> float:
    """`value` as a finite float between low and high (ends included unless said otherwise)."""
    ok = is_number(value) and math.isfinite(float(value))
    if ok:
        v = float(value)
        ok = (v >= low if include_low else v > low) and (v <= high if include_high else v < high)
    if not ok:
        interval = f"{'[' if include_low else '('}{low}, {high}{']' if include_high else ')'}"
        raise VitlabError(f"{name} must be a finite number in {interval}, got {value!r}")
    return float(value)


def check_size_pair(name: str, value: Any, high: int = MAX_IMAGE_SIZE) -> tuple[int, int]:
    """An int or an (h, w) pair of ints in [1, high]."""
    if is_number(value):
        side = check_int(name, value, 1, high)
        return (side, side)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise VitlabError(f"{name} must be an int or a (height, width) pair, got {value!r}")
    return (check_int(name, value[0], 1, high), check_int(name, value[1], 1, high))
