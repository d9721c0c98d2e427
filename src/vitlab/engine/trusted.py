"""Which built engine artefacts (ONNX graphs, OpenVINO models) vitlab may run again: those that this user's vitlab
wrote, unchanged since.

Artefacts live beside the model (MODEL/engines/<hash>/), and model folders travel with them. A graph that came
with a folder from elsewhere, or was edited, stale or corrupted, would otherwise run in place of the weights:
`--engine auto` reuses its cached pick without comparing it with the eager model. So when vitlab writes an
artefact it records the file's digest in the user's own cache (never beside the model), and a file whose digest
is not on record there is built again instead of run.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def _digest(path: Path) -> str:
    from vitlab.engine.digest import file_sha256

    return file_sha256(path)


def _record(path: Path) -> Path:
    """Where the digest of the artefact at `path` is kept: one small file per artefact in the user's cache."""
    from vitlab.weights.hub import cache_dir

    key = hashlib.blake2b(str(path.resolve()).encode(), digest_size=16).hexdigest()
    return cache_dir() / "engines" / "built" / f"{key}.json"


def remember(files: list[Path]) -> None:
    """Record `files` as built here, as they are now (a cache that cannot be written: they are rebuilt next time)."""
    for path in files:
        record = _record(path)
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            tmp = record.with_name(f"{record.name}.{os.getpid()}.part")
            tmp.write_text(json.dumps({"path": str(path.resolve()), "digest": _digest(path)}))
            tmp.replace(record)
        except OSError:
            pass


def is_trusted(files: list[Path]) -> bool:
    """Every one of `files` exists and is what vitlab wrote there (its digest on record in the user's cache)."""
    for path in files:
        try:
            if not path.is_file():
                return False
            kept = json.loads(_record(path).read_text())
            if kept.get("path") != str(path.resolve()) or kept.get("digest") != _digest(path):
                return False
        except (OSError, ValueError, AttributeError):
            return False
    return True


def recorded_digests(files: list[Path]) -> list[str] | None:
    """The digests on record for `files` (what `is_trusted` compared them with), without reading the files again;
    None where one has no record."""
    try:
        return [json.loads(_record(path).read_text())["digest"] for path in files]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def forget(files: list[Path]) -> None:
    """Drop the records of `files` (their folder is being removed: `vitlab engines --clean`)."""
    for path in files:
        _record(path).unlink(missing_ok=True)


def discard(files: list[Path]) -> bool:
    """Remove `files` (an artefact not to be run); whether any was there."""
    found = False
    for path in files:
        if path.exists():
            found = True
            path.unlink()
    return found


def remove_links(folder: Path) -> None:
    """Remove the symbolic links in an engine folder before building into it. vitlab makes none there, and the
    builders write fixed names (raw.onnx, fp32.onnx, ...) through them: a link planted in a shared model's folder
    made the next user's vitlab overwrite the link's target (any file of theirs) with an ONNX graph."""
    try:
        entries = list(os.scandir(folder))
    except OSError:  # not made yet: nothing in it
        return
    for entry in entries:
        if entry.is_symlink():
            Path(entry.path).unlink(missing_ok=True)
