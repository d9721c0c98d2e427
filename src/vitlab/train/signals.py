"""SIGINT / SIGTERM while training: the first asks for a checkpoint at the next step boundary, a second quits."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


class StopSignals:
    """SIGINT / SIGTERM while training: the first one asks the loop to finish its step, write a checkpoint
    and stop; a second one quits at once (KeyboardInterrupt wherever the program is)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def listen(self) -> None:
        if threading.current_thread() is threading.main_thread():  # Python only lets the main thread catch them
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            self.restore()  # a third signal acts as if vitlab were not there
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        # os.write, not print: a handler may run in the middle of another print to the same stream
        os.write(2, f"\nvitlab: {self.received} received: finishing this step and writing a checkpoint "
                    "(Ctrl-C again quits at once)\n".encode())


    def requested(self, votes: float | None = None) -> bool:
        """Whether the run should stop now: under several processes `votes` (the all-reduced count of processes
        that received a signal) decides, so that all stop after the same step; alone, this process's signal."""
        return votes > 0 if votes is not None else self.received is not None
