"""One progress bar for long evaluation and inspection work: tqdm with ETA on stderr, off when quiet.

The convention is training's: a bar is shown unless the command runs with `--quiet` (`enabled=False`);
it always goes to stderr so stdout stays the command's result. tqdm is imported lazily (fast CLI start).
Every bar of vitlab redraws at `redraw_seconds()`: twice a second on a terminal, every 30 s into a log file or a
pipe, where each redraw is kept (a day-long training run redrawn 10 times a second would write megabytes of them).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

MININTERVAL = 0.5  # seconds between redraws on a terminal (tests set both to 0 to see every step)
LOG_MININTERVAL = 30.0  # the same where stderr is a file or a pipe
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def redraw_seconds() -> float:
    """How often a bar may redraw: MININTERVAL on a terminal, LOG_MININTERVAL where stderr is a file or a pipe."""
    try:
        terminal = sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        terminal = False
    return MININTERVAL if terminal else LOG_MININTERVAL


def progress_bar(iterable: Iterable | None = None, *, desc: str, unit: str, total: int | None = None,
                 enabled: bool = True, leave: bool = False) -> Any:
    """A tqdm bar on stderr showing `desc`, `n/total unit` and the ETA; a silent pass-through when disabled."""
    from tqdm.auto import tqdm

    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    return tqdm(iterable, desc=desc, unit=unit, total=total, disable=not enabled, leave=leave, file=sys.stderr,
                dynamic_ncols=True, bar_format=BAR_FORMAT, mininterval=redraw_seconds())
