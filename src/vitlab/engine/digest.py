"""The digests an engine start needs: of the model's weights (which artefact folder) and of each kept artefact (was
it written by this user's vitlab). Both read every byte of a model's weights, so they are on the way of every
`predict`, `evaluate` and `serve` start. SHA-256 (hardware instructions on current x86 and ARM CPUs; 1.9x
blake2b's speed on one thread of the Intel Xeon VM) over chunks hashed in threads (hashlib releases the GIL),
then one SHA-256 of the chunks' digests: ViT-B/16's weights in 0.13 s instead of blake2b's 0.46 s
(docs/results/load_time.txt). Chunk borders are fixed, so the digest does not depend on the number of threads.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHUNK = 8 << 20  # bytes hashed as one task
WORKERS = max(1, min(4, os.cpu_count() or 1))


def _sha256(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def chunked_sha256(pieces: Iterable[bytes | memoryview]) -> str:
    """Hex digest of the byte strings `pieces`, in order (each cut into CHUNK-sized parts, an empty piece counted
    as one empty part, so that where one piece ends and the next begins changes the digest)."""
    digests: list[bytes] = []
    pending: deque = deque()  # (task, bytes) in order
    in_flight = 0
    with ThreadPoolExecutor(WORKERS) as pool:
        for piece in pieces:
            view = memoryview(piece).cast("B")
            for start in range(0, max(len(view), 1), CHUNK):
                part = view[start:start + CHUNK]
                pending.append((pool.submit(_sha256, part), len(part)))
                in_flight += len(part)
                # a file's chunks are read only so far ahead of the hashing; counted in bytes, not tasks, so that
                # small pieces (a weight's name) between large ones do not leave a thread idle
                while in_flight > 4 * WORKERS * CHUNK:
                    task, size = pending.popleft()
                    digests.append(task.result())
                    in_flight -= size
        digests += [task.result() for task, _ in pending]
    return hashlib.sha256(b"".join(digests)).hexdigest()


def file_sha256(path: Path) -> str:
    """`chunked_sha256` of a file's bytes, read (not memory-mapped: a file truncated meanwhile must not kill the
    process) in CHUNK-sized reads."""
    with path.open("rb") as f:
        return chunked_sha256(iter(lambda: f.read(CHUNK), b""))
