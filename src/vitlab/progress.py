"""One progress bar for long evaluation and inspection work: tqdm with ETA on stderr, off when quiet.

The convention is training's: a bar is shown unless the command runs with `--quiet` (`enabled=False`);
it always goes to stderr so stdout stays the command's result. tqdm is imported lazily (fast CLI start).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

MININTERVAL = 0.5  # seconds between redraws (tests set 0 to see every step)
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def progress_bar(iterable: Iterable | None = None, *, desc: str, unit: str, total: int | None = None,
                 enabled: bool = True, leave: bool = False) -> Any:
    """A tqdm bar on stderr showing `desc`, `n/total unit` and the ETA; a silent pass-through when disabled."""
    from tqdm.auto import tqdm

    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    return tqdm(iterable, desc=desc, unit=unit, total=total, disable=not enabled, leave=leave, file=sys.stderr,
                dynamic_ncols=True, bar_format=BAR_FORMAT, mininterval=MININTERVAL)
