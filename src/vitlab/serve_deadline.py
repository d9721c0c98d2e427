"""Deadlines for a request's arrival in `vitlab serve`, so that slow clients cannot hold its threads.

A socket timeout alone bounds each read: a client sending one byte every 29 s (a "slowloris") kept a connection
thread for as long as it liked, and 256 such clients took every thread. As Apache's mod_reqtimeout does, the
request head (request line and headers) must arrive within HEAD_S of its first byte, and the body at an average of
at least MIN_BODY_BYTES_PER_S after its first BODY_GRACE_S. Between requests a keep-alive connection may stay idle
for the server's `timeout_s`, as before.
"""

from __future__ import annotations

import contextlib
import io
import socket
import time

HEAD_S = 20.0  # the request line and headers, from their first byte (a few hundred bytes in practice)
BODY_GRACE_S = 20.0  # the body's first seconds are free; after them each byte buys 1 / MIN_BODY_BYTES_PER_S s
MIN_BODY_BYTES_PER_S = 10_000  # 10 KB/s: a 1 MB photo may take 120 s, a 20 MB body (--max-body-mb) 35 minutes


class DeadlineReader(io.RawIOBase):
    """A connection's reads. Each waits at most `idle_s` (None: no limit) and never past the current deadline:
    `head()` arms HEAD_S from the request's first byte; `body()` gives BODY_GRACE_S plus 1 / MIN_BODY_BYTES_PER_S
    s for every byte received, so the deadline moves with the data (as mod_reqtimeout's MinRate) and a trickle
    falls behind it at once, whatever size it declared; `clear()` drops it. Past the deadline a read raises
    TimeoutError, which http.server (the head) and the handler (the body) turn into a closed connection."""

    def __init__(self, sock: socket.socket, idle_s: float | None):
        self.sock, self.idle_s = sock, idle_s
        self.deadline: float | None = None
        self._head_pending = False
        self._body_start: float | None = None
        self._received = 0

    def readable(self) -> bool:
        return True

    def head(self) -> None:
        self.clear()
        self._head_pending = True

    def body(self) -> None:
        self.clear()
        self._body_start = time.monotonic()
        self.deadline = self._body_start + BODY_GRACE_S

    def clear(self) -> None:
        self.deadline, self._head_pending, self._body_start, self._received = None, False, None, 0
        with contextlib.suppress(OSError):  # a socket already closed has nothing left to write
            self.sock.settimeout(self.idle_s)  # writes share the socket's timeout: the answer gets the idle limit

    def readinto(self, buffer) -> int:
        timeout = self.idle_s
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request did not arrive in time")
            timeout = left if timeout is None else min(timeout, left)
        self.sock.settimeout(timeout)
        n = self.sock.recv_into(buffer)
        if self._head_pending and n:
            self._head_pending, self.deadline = False, time.monotonic() + HEAD_S
        elif self._body_start is not None:
            self._received += n
            self.deadline = self._body_start + BODY_GRACE_S + self._received / MIN_BODY_BYTES_PER_S
        return n
