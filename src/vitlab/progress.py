"""One progress bar for long evaluation and inspection work: tqdm with ETA on stderr, off when quiet.

The convention is training's: a bar is shown unless the command runs with `--quiet` (`enabled=False`);
it always goes to stderr so stdout stays the command's result. tqdm is imported lazily (fast CLI start).
Every bar of vitlab takes `bar_options()`: redrawn twice a second on a terminal; into a log file or a pipe, every
30 s (each redraw is kept there: a day-long training run redrawn 10 times a second would write megabytes of them)
and as a line of its own, without the carriage returns that draw over a terminal's line.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import Any

MININTERVAL = 0.5  # seconds between redraws on a terminal (tests set both to 0 to see every step)
LOG_MININTERVAL = 30.0  # the same where stderr is a file or a pipe
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def redraw_seconds() -> float:
    """How often a bar may redraw: MININTERVAL on a terminal, LOG_MININTERVAL where stderr is a file or a pipe."""
    return MININTERVAL if _is_terminal() else LOG_MININTERVAL


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


_CURSOR_MOVES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _LogLines:
    """stderr as a bar sees it where stderr is a log file or a pipe: each redraw becomes a line of its own.

    On a terminal tqdm redraws over one line with carriage returns; a log keeps them all as one long line of
    fragments, and the blanks that erase a finished bar as a line of spaces. Here each redraw is written as a
    line, and a write with nothing but spaces and line ends (the erase, the final newline) is dropped."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        line = _CURSOR_MOVES.sub("", text.replace("\r", "")).rstrip()  # nested bars move the cursor up and back
        if line:
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def bar_options() -> dict[str, Any]:
    """tqdm's `file` and `mininterval` for every bar of vitlab: stderr, redrawn twice a second on a terminal;
    one line per redraw, every 30 s, into a log file or a pipe."""
    return {"file": sys.stderr if _is_terminal() else _LogLines(sys.stderr), "mininterval": redraw_seconds()}


def progress_bar(iterable: Iterable | None = None, *, desc: str, unit: str, total: int | None = None,
                 enabled: bool = True, leave: bool = False) -> Any:
    """A tqdm bar on stderr showing `desc`, `n/total unit` and the ETA; a silent pass-through when disabled."""
    from tqdm.auto import tqdm

    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    # into a log or a pipe a bar that is not left kept only its first line ("test: 0%| 0/1 batch"), which reads as
    # work that never finished: there the final state is written when the bar closes
    leave = leave or not _is_terminal()
    return tqdm(iterable, desc=desc, unit=unit, total=total, disable=not enabled, leave=leave, dynamic_ncols=True,
                bar_format=BAR_FORMAT, **bar_options())
