"""The engine folders beside a model (MODEL/engines/<hash>, FILE.engines/<hash>): which there are, how much disk
each takes, which belong to the weights as they load now, and removing the others (`vitlab engines`).

`--engine compiled` keeps its kernels (Inductor's cache: generated code that runs when loaded) in the user cache,
never beside the model, in a folder of the same name ($VITLAB_CACHE/engines/<hash>/inductor): those of a model's
folders are listed and removed with them (`compiled_caches`).

A folder is named by the fingerprint of the weights and config it was built for (`choose.fingerprint`), with
`-HxW` for another image size. New weights (a run trained further, a file replaced) get a new folder, and the old
one stays: at ViT-B/16 an fp32 ONNX graph and an OpenVINO model are about 660 MB together
(docs/results/engines_listing.txt). Nothing is removed without being asked; only folders named as vitlab names
them, and never through a link.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

_NAME = re.compile(r"^[0-9a-f]{24}(-\d+x\d+)?$")  # choose.fingerprint's 24 hex digits, and -HxW


@dataclass(frozen=True)
class EngineFolder:
    path: Path
    current: bool  # built for the weights as they load now (any image size)
    size: int  # bytes on disk, subfolders included
    built: float  # newest file's modification time (seconds since the epoch)
    files: tuple[str, ...]  # the files at its top
    subfolders: tuple[str, ...] = ()  # e.g. "inductor": the compiled engine's kernels
    in_user_cache: bool = False  # a compiled engine's kernels for a model whose other engines are beside it


def _folder(path: Path, current: bool, in_user_cache: bool = False) -> EngineFolder:
    """What `path` holds: every regular file under it counts (links are neither followed nor counted)."""
    size, built = 0, 0.0
    for root, _dirs, names in os.walk(path):  # does not descend into linked folders
        for name in names:
            info = os.lstat(os.path.join(root, name))
            if stat.S_ISREG(info.st_mode):
                size, built = size + info.st_size, max(built, info.st_mtime)
    top = [f for f in path.iterdir() if not f.is_symlink()]
    return EngineFolder(path=path, current=current, size=size, built=built,
                        files=tuple(sorted(f.name for f in top if f.is_file())),
                        subfolders=tuple(sorted(f.name for f in top if f.is_dir())), in_user_cache=in_user_cache)


def _vitlab_folders(parent: Path) -> list[Path]:
    """The folders in `parent` named as vitlab names them; entries named otherwise, and links, are not vitlab's."""
    try:
        entries = list(parent.iterdir())
    except OSError:  # nothing built yet
        return []
    return [p for p in entries if not p.is_symlink() and p.is_dir() and _NAME.match(p.name)]


def engine_folders(current: Path) -> list[EngineFolder]:
    """The engine folders beside `current` (the folder `choose.artefact_folder` gives the model now), newest first.
    Entries that vitlab does not name so, and links, are left out: they are not vitlab's to report or remove."""
    fingerprint = current.name.split("-")[0]
    found = [_folder(path, path.name.split("-")[0] == fingerprint) for path in _vitlab_folders(current.parent)]
    return sorted(found, key=lambda f: f.built, reverse=True)


def compiled_caches(current: Path, beside: list[EngineFolder], cache_engines: Path) -> list[EngineFolder]:
    """The compiled engine's kernel caches in the user cache (`cache_engines`, $VITLAB_CACHE/engines) that belong to a
    model whose engines go beside it (`current`, and the folders `beside` it): the user-cache folders of the
    weights as they load now, at any image size, and those named as a folder beside it."""
    fingerprint = current.name.split("-")[0]
    names = {f.path.name for f in beside}
    found = []
    for path in _vitlab_folders(cache_engines):
        now = path.name.split("-")[0] == fingerprint
        if now or path.name in names:
            found.append(_folder(path, now, in_user_cache=True))
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
    kinds = sorted({name.split(".")[0] for name in folder.files if not name.endswith(".json")}
                   | {"compiled" for name in folder.subfolders if name == "inductor"})
    state = "current" if folder.current else "other"
    where = "  (in the user cache)" if folder.in_user_cache else ""
    return (f"{folder.path.name:<34} {folder.size / 2**20:9.1f} MB  {when}  {state:<7}  "
            f"{', '.join(kinds) or '(empty)'}{where}")
