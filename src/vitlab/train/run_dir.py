"""The run folder: config.yaml, metrics.jsonl (one JSON record per line), checkpoints/, plots, summary."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from vitlab.errors import VitlabError
from vitlab.train.checkpoint import atomic_write_text, process_alive, remove_stale_temp_files, temp_path
from vitlab.train.config import TrainConfig, save_yaml


def new_run_dir(cfg: TrainConfig) -> Path:
    """`out_dir/name`, or `out_dir/<recipe>-<data>-<UTC time>` (a numeric suffix if it exists). A named folder
    that already holds a run is refused: a new run written into it would mix its metrics, checkpoints and
    reports with the old run's, and a later --resume would pick up the old run's checkpoints."""
    if cfg.name:
        path = Path(cfg.out_dir) / cfg.name
        earlier = earlier_run_files(path)
        if earlier:
            raise VitlabError(f"{path} already holds a run ({', '.join(earlier)}); continue it with --resume {path}, "
                              "or choose another --name (or delete that folder to start over)")
        return path
    data = Path(str(cfg.data).split(":")[0]).name.replace("/", "_") or "data"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return unused_folder(Path(cfg.out_dir) / f"{cfg.recipe}-{data}-{stamp}")


def unused_folder(base: Path) -> Path:
    """`base`, or `base-1`, `base-2`, ... where it exists (runs started in the same second)."""
    path, i = base, 1
    while path.exists():
        path = Path(f"{base}-{i}")
        i += 1
    return path


def earlier_run_files(path: Path) -> list[str]:
    """The files of a run that `path` already holds (none for a missing or empty folder, or unrelated files)."""
    if not path.is_dir():
        return []
    found = [name for name in ("config.yaml", "metrics.jsonl", "summary.json", "model") if (path / name).exists()]
    checkpoints = path / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        found.append("checkpoints/")
    return found


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become strings, tensors and numpy scalars become numbers."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


class RunDir:
    """Writes the files of one run; only the main process (rank 0) writes."""

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / "checkpoints").mkdir(exist_ok=True)

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def save_config(self, cfg: TrainConfig) -> None:
        if self.enabled:
            save_yaml(cfg, self.path / "config.yaml")

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.metrics_path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(_clean(record)) + "\n")

    def truncate_metrics(self, step: int) -> None:
        """On resume: drop records written after the checkpoint we resume from (they will be redone), and
        a line that a kill or a full disk cut short (with a note)."""
        if not self.enabled or not self.metrics_path.exists():
            return
        records, broken = parse_metrics(self.metrics_path.read_text())
        if broken:
            print(f"vitlab: dropped {broken} incomplete line(s) of {self.metrics_path} (a write was cut short)",
                  file=sys.stderr, flush=True)
        keep = [json.dumps(r) for r in records if r.get("step", 0) <= step]
        atomic_write_text("".join(line + "\n" for line in keep), self.metrics_path)

    def remove_leftovers(self) -> None:
        """Temporary files of checkpoint or metrics writes that a kill interrupted (never read, only in the way)."""
        if not self.enabled:
            return
        removed = remove_stale_temp_files(self.path, self.path / "checkpoints")
        if removed:
            print(f"vitlab: removed {len(removed)} temporary file(s) left by an interrupted write in {self.path}",
                  file=sys.stderr, flush=True)

    def write_json(self, name: str, data: dict[str, Any]) -> Path:
        path = self.path / name
        if self.enabled:
            atomic_write_text(json.dumps(_clean(data), indent=2) + "\n", path)
        return path


def parse_metrics(text: str) -> tuple[list[dict[str, Any]], int]:
    """The records of a metrics.jsonl text, and how many lines were not whole JSON records."""
    records, broken = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            broken += 1
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            broken += 1
    return records, broken


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a run's metrics.jsonl; a line cut short by a kill is skipped."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    return parse_metrics(p.read_text())[0]


# ------------------------------------------------------------------------------------------ the lock
LOCK_NAME = "run.lock"


class RunLock:
    """`RUN/run.lock` (process id, host, start time): one process at a time writes a run folder.

    Written when a run starts, removed when it ends. A lock whose process is gone (same host, pid not
    running: a SIGKILL) is taken over with a note; one held by a live process, or by another host (whose
    processes cannot be seen from here), is refused unless `force` (--force-unlock)."""

    def __init__(self):
        self.path: Path | None = None

    def acquire(self, folder: str | Path, force: bool = False) -> None:
        path = Path(folder) / LOCK_NAME
        for _ in range(3):  # a lock that vanishes or appears between our look and our write: look again
            if create_lock(path, this_process(path.parent)):
                self.path = path
                return
            holder = read_lock(path)
            note = take_over_note(path, holder, force)  # raises for a live holder
            if remove_lock(path, holder):
                print(f"vitlab: {note}", file=sys.stderr, flush=True)
        raise VitlabError(f"cannot take the lock {path}: other processes keep taking it; make sure only one "
                          "process trains this run folder, then try again")

    def release(self) -> None:
        """Remove the lock if it is still ours (a --force-unlock elsewhere may have taken it over)."""
        if self.path is not None:
            holder = read_lock(self.path) or {}
            if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                self.path.unlink(missing_ok=True)
        self.path = None


def create_lock(path: Path, record: dict[str, Any]) -> bool:
    """Write the lock where there is none (False where there is one), whole: linked from a temporary file, so that
    no process reads it half written, takes it for a killed writer's and takes it over."""
    tmp = temp_path(path)
    try:
        tmp.write_text(json.dumps(record))
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: created, then written
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump(record, fh)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def remove_lock(path: Path, judged: dict[str, Any] | None) -> bool:
    """Remove the lock read as `judged` (stale, or forced); False where it is another by now. Two processes taking
    over one stale lock at once both removed it, the second the lock the first had just written, and both trained
    the run: the lock is moved aside first, and one that is not the one judged is put back."""
    aside = path.with_name(f".{path.name}.aside.tmp-{os.getpid()}")  # a stale one is cleaned up as leftovers are
    try:
        os.replace(path, aside)
    except FileNotFoundError:  # another process removed it
        return False
    try:
        if read_lock(aside) == judged:
            return True
        try:
            os.link(aside, path)
        except FileExistsError:  # a third process wrote one meanwhile: that one stands
            pass
        return False
    finally:
        aside.unlink(missing_ok=True)


def refuse_if_in_use(folder: str | Path, force: bool = False) -> None:
    """One line when a live process (or another machine) holds the folder's lock: asked before anything is
    read, so a resume beside a run that has not written its first checkpoint yet names the real cause."""
    path = Path(folder) / LOCK_NAME
    if not force and path.exists():
        holder = read_lock(path)
        if holder is not None:
            take_over_note(path, holder, False)  # raises for a live holder; a stale one is taken over later


def this_process(folder: Path) -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "folder": folder_id(folder)}


def folder_id(folder: Path) -> list[int] | None:
    """(device, inode) of the run folder: a lock copied with its folder (`cp -r runs/a runs/b` while runs/a trains)
    names another folder than the one it lies in, while a moved folder keeps its own."""
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return [st.st_dev, st.st_ino]


def read_lock(path: Path) -> dict[str, Any] | None:
    """The lock's record; None when it is unreadable (a kill between creating and writing it)."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


def take_over_note(path: Path, holder: dict[str, Any] | None, force: bool) -> str:
    """The note printed when taking over a lock; a one-line VitlabError when it must not be taken over."""
    if holder is None:
        return f"took over the unreadable lock {path} (a process was killed while writing it)"
    pid, host, since = holder.get("pid"), holder.get("host"), holder.get("started", "an unknown time")
    who = f"process {pid} on {host} (since {since})"
    if force:
        return f"--force-unlock: took over the lock {path} of {who}"
    if host != socket.gethostname():
        raise VitlabError(f"run folder {path.parent} is locked by {who}, another machine; if no run is going on "
                          f"there any more, add --force-unlock (two processes writing one run corrupt it)")
    if holder.get("folder") is not None and holder["folder"] != folder_id(path.parent):
        return f"took over the lock {path}, copied with the folder from a run of {who} (that run is not this folder's)"
    if isinstance(pid, int) and process_alive(pid):
        raise VitlabError(f"run folder {path.parent} is in use by {who}; wait for that run to end or stop it "
                          f"(kill {pid}, then resume), or use another --name")
    return f"took over the lock {path} left by {who}, which is no longer running"
