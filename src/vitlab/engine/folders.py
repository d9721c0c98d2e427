"""The engine folders beside a model (MODEL/engines/<hash>, FILE.engines/<hash>): which there are, how much disk
each takes, which belong to the weights as they load now, and removing the others (`vitlab engines`).

A folder is named by the fingerprint of the weights and config it was built for (`choose.fingerprint`), with
`-HxW` for another image size. New weights (a run trained further, a file replaced) get a new folder, and the old
one stays: at ViT-B/16 an fp32 ONNX graph and an OpenVINO model are about 660 MB together
(docs/results/engines_listing.txt). Nothing is removed without being asked; only folders named as vitlab names
them, and never through a link.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

_NAME = re.compile(r"^[0-9a-f]{24}(-\d+x\d+)?$")  # choose.fingerprint's 24 hex digits, and -HxW


@dataclass(frozen=True)
class EngineFolder:
    path: Path
    current: bool  # built for the weights as they load now (any image size)
    size: int  # bytes on disk
    built: float  # newest file's modification time (seconds since the epoch)
    files: tuple[str, ...]


def engine_folders(current: Path) -> list[EngineFolder]:
    """The engine folders beside `current` (the folder `choose.artefact_folder` gives the model now), newest first.
    Entries that vitlab does not name so, and links, are left out: they are not vitlab's to report or remove."""
    fingerprint = current.name.split("-")[0]
    try:
        entries = list(current.parent.iterdir())
    except OSError:  # nothing built yet
        return []
    found = []
    for path in entries:
        if path.is_symlink() or not path.is_dir() or not _NAME.match(path.name):
            continue
        files = [f for f in path.iterdir() if f.is_file() and not f.is_symlink()]
        found.append(EngineFolder(
            path=path, current=path.name.split("-")[0] == fingerprint,
            size=sum(f.stat().st_size for f in files), built=max((f.stat().st_mtime for f in files), default=0.0),
            files=tuple(sorted(f.name for f in files))))
    return sorted(found, key=lambda f: f.built, reverse=True)


def remove_folder(folder: EngineFolder) -> None:
    """Remove an engine folder and the records of what vitlab built in it (engine/trusted.py), under the folder's
    lock: a command building into it at the same time finishes first."""
    from vitlab.engine.locking import folder_lock
    from vitlab.engine.trusted import forget

    with folder_lock(folder.path):
        forget([folder.path / name for name in folder.files])
        shutil.rmtree(folder.path)


def describe(folder: EngineFolder) -> str:
    """One line: name, size, when built, what it holds, and whether the weights as they load now use it."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(folder.built)) if folder.built else "-"
    kinds = sorted({name.split(".")[0] for name in folder.files if not name.endswith(".json")})
    state = "current" if folder.current else "other"
    return f"{folder.path.name:<34} {folder.size / 2**20:9.1f} MB  {when}  {state:<7}  {', '.join(kinds) or '(empty)'}"
