"""One command at a time builds into, or records a choice in, an engine folder (MODEL/engines/<hash>/).

Commands started together on a fresh model (a shell loop run in parallel, several workers of a server) each built
the same graphs through the same file names (raw.onnx, fp32.onnx, openvino-fp32.partial.bin): one removed or
replaced the file another was reading, and that command failed with 'engine onnxruntime cannot run this model
(FileNotFoundError ...)'. Under the folder's lock the first builds, and the others wait and reuse what it built.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

_guard = threading.Lock()
_locks: dict[str, threading.RLock] = {}
_depth: dict[str, int] = {}


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """Hold `folder`'s lock (a file lock between processes, POSIX; an RLock between threads). Re-entrant in one
    thread: a build that first builds the graph it starts from (static int8 on the fp32 graph) takes it again."""
    key = os.path.abspath(folder)
    with _guard:
        rlock = _locks.setdefault(key, threading.RLock())
    with rlock:
        depth = _depth.get(key, 0)
        _depth[key] = depth + 1
        try:
            if depth:
                yield
            else:
                with _file_lock(Path(folder)):
                    yield
        finally:
            _depth[key] = depth


def lock_path(folder: Path) -> Path:
    """The lock file of an engine folder: in the user's cache (as the records of what was built, engine/trusted.py),
    so the model's folder holds only what the engines run."""
    from vitlab.weights.hub import cache_dir

    key = hashlib.blake2b(os.path.abspath(folder).encode(), digest_size=16).hexdigest()
    return cache_dir() / "engines" / "locks" / f"{key}.lock"


@contextlib.contextmanager
def _file_lock(folder: Path) -> Iterator[None]:
    """flock on the folder's lock file; none where that cannot be had (no fcntl, a user cache that cannot be
    written: commands then build as they did before)."""
    try:
        import fcntl

        path = lock_path(folder)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")  # noqa: SIM115 - closed below, after the lock is released
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        handle.close()  # closing releases the lock
