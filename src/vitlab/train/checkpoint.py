"""Training checkpoints: atomic writes, keep the last K and the best, full RNG state for exact resume.

A checkpoint is one `torch.save` file of plain tensors and Python scalars (read back with
`weights_only=True`): model, optimizer, scheduler, loss scaler, every RNG, and the position
(epoch, step in epoch, global step).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitlab.errors import VitlabError


def atomic_save(obj: Any, path: str | Path) -> Path:
    """torch.save to a temporary file in the same folder, fsync, then rename: a kill leaves either
    the old file or the new one, never half a file. A failed write removes its temporary file; a full
    disk is one line naming the folder and the space the file needs."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:  # a second Ctrl-C too: never leave the temporary file behind
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError | RuntimeError) and is_disk_full(exc, path.parent, tensor_bytes(obj)):
            raise VitlabError(disk_full_message(path.parent, tensor_bytes(obj))) from None
        raise
    return path


def temp_path(path: Path) -> Path:
    """`.NAME.tmp-PID` beside `path`: the PID tells a stale file (its writer is gone) from a live one."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


_TEMP_RE = re.compile(r"^\..+\.tmp-(\d+)$")


def remove_stale_temp_files(*folders: Path) -> list[Path]:
    """Delete temporary files that killed writers left behind (their process no longer runs)."""
    removed = []
    for folder in folders:
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            m = _TEMP_RE.match(p.name)
            if m and p.is_file() and not process_alive(int(m.group(1))):
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def process_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (this process counts as gone: it has nothing
    in flight when it cleans up)."""
    if pid == os.getpid():
        return False  # this process has written nothing yet when it cleans up
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def tensor_bytes(obj: Any) -> int:
    """Bytes of all tensors in a nested state (the bulk of a checkpoint file)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def is_disk_full(exc: BaseException, folder: Path, needed: int) -> bool:
    """ENOSPC, or torch's zip writer failing (`enforce fail at inline_container.cc`) with too little space left:
    torch reports a full disk as a RuntimeError without an errno."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if "inline_container" not in str(exc) and "file write failed" not in str(exc):
        return False
    try:
        return shutil.disk_usage(folder).free < needed
    except OSError:
        return False


def disk_full_message(folder: Path, needed: int) -> str:
    try:
        free = f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return (f"no space left to write a checkpoint in {folder}: it needs about {needed / 2**20:.1f} MiB ({free}); "
            f"free disk space there (or lower --keep-last) and resume")


def atomic_write_text(text: str, path: str | Path) -> Path:
    path = Path(path)
    tmp = temp_path(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return path


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may touch: Python, NumPy, torch CPU and all CUDA devices."""
    np_state = np.random.get_state()
    state = {
        "python": json.dumps(random.getstate()),
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = json.loads(state["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise VitlabError(f"no checkpoint at {path}")
    from vitlab.weights.io import check_torch_zip

    try:
        check_torch_zip(path)  # a flipped byte loaded silently as another weight or optimizer moment
        return torch.load(path, map_location="cpu", weights_only=True)
    except VitlabError as exc:
        raise VitlabError(f"{exc}; resume from another one") from None
    except Exception as exc:  # a truncated or foreign file
        raise VitlabError(f"cannot read checkpoint {path}: {type(exc).__name__}; resume from another one") from None


_STEP_RE = re.compile(r"^step-(\d+)\.pt$")


class CheckpointManager:
    """Writes `checkpoints/step-NNNNNNN.pt` (keeping the last `keep_last`) and `checkpoints/best.pt`."""

    def __init__(self, folder: str | Path, keep_last: int = 2):
        self.folder = Path(folder)
        self.keep_last = max(1, int(keep_last))

    def step_files(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := _STEP_RE.match(p.name))]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        files = self.step_files()
        return files[-1] if files else None

    def save(self, state: dict[str, Any], step: int) -> Path:
        path = atomic_save(state, self.folder / f"step-{step:07d}.pt")
        for old in self.step_files()[: -self.keep_last]:
            old.unlink(missing_ok=True)
        return path

    def set_aside_after(self, step: int) -> list[Path]:
        """Move the step checkpoints after `step` into checkpoints/abandoned/: a resume from an older checkpoint
        drops the later part of metrics.jsonl, and left in place the later checkpoints were what the next
        `--resume RUN` continued (the abandoned run's weights under the new run's records). best.pt too when it
        was written after `step`: left in place it stayed the run's best.pt (`vitlab evaluate RUN/checkpoints/
        best.pt`) whenever the continuation scored lower, weights the run's records do not hold. Moved, not
        deleted: they may be all a user has of that part of the run."""
        later = [p for p in self.step_files() if int(_STEP_RE.match(p.name).group(1)) > step]
        if (self.best_step() or 0) > step:
            later.append(self.folder / "best.pt")
        if later:
            aside = self.folder / "abandoned"
            aside.mkdir(exist_ok=True)
            for p in later:
                os.replace(p, aside / p.name)
        return later

    def best_step(self) -> int | None:
        """The global step best.pt was written at; None without a best.pt that reads (memory-mapped: a big
        checkpoint is not read whole for one number)."""
        path = self.folder / "best.pt"
        if not path.is_file():
            return None
        try:
            return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
        except Exception:  # a damaged or foreign file: left alone
            return None

    def save_best(self, state: dict[str, Any], metric: float) -> Path:
        state = dict(state, best_metric=float(metric))
        return atomic_save(state, self.folder / "best.pt")


def checkpoint_folder(run: str | Path) -> Path:
    """The checkpoints of `--resume RUN`: RUN/checkpoints, or the folder itself when it is RUN/checkpoints."""
    p = Path(run)
    return p if p.name == "checkpoints" and not (p / "checkpoints").is_dir() else p / "checkpoints"


def find_resume_checkpoint(run: str | Path) -> Path:
    """`--resume RUN` accepts a run folder (its latest step checkpoint), its checkpoints/ folder, or a checkpoint
    file in a checkpoints/ folder."""
    p = Path(run)
    if p.is_file():
        if p.parent.name != "checkpoints":  # the run folder is the checkpoint's grandparent: here there is none
            raise VitlabError(f"cannot resume from {p}: --resume takes a run folder, its checkpoints/ folder or a "
                              "checkpoint in it (RUN/checkpoints/step-N.pt); put a copied checkpoint in a folder named "
                              "checkpoints/ (the folder above it becomes the run folder)")
        return p
    if not p.exists():
        raise VitlabError(f"cannot resume: {p} does not exist; give a run folder or a checkpoint file")
    folder = checkpoint_folder(p)
    latest = CheckpointManager(folder).latest()
    if latest is None:
        raise VitlabError(f"cannot resume: no checkpoints in {folder} (the run stopped before its first one)")
    return latest


# What a training checkpoint holds beyond the weights; without them a file cannot continue a run (a state dict
# saved by hand, a weights-only file, another program's checkpoint).
TRAINING_KEYS = ("model", "optimizer", "scheduler", "rng", "global_step", "epoch", "step_in_epoch")


def missing_training_keys(state: Any) -> list[str]:
    """What a loaded file lacks to be a training checkpoint (all of it for something that is no dict)."""
    if not isinstance(state, dict):
        return list(TRAINING_KEYS)
    return [k for k in TRAINING_KEYS if k not in state]


def load_resume_state(run: str | Path) -> tuple[dict[str, Any], Path]:
    """The state to resume `run` from, and its file. A run folder falls back from an unreadable
    (truncated) latest checkpoint, or one that is no training checkpoint, to the newest one that reads, with a
    note; a file given by name must read."""
    p = Path(run)
    if p.is_file():
        state = load_checkpoint(p)
        missing = missing_training_keys(state)
        if missing:  # else a KeyError later ("an unexpected failure")
            raise VitlabError(f"cannot resume from {p}: it is not a training checkpoint (it lacks "
                              f"{', '.join(missing)}); give the run folder or one of its checkpoints/step-N.pt "
                              "(to start from weights alone: vitlab finetune --weights)")
        return state, p
    candidates = CheckpointManager(checkpoint_folder(p)).step_files()[::-1]
    for i, path in enumerate(candidates):
        then = f"; trying {candidates[i + 1].name}" if i + 1 < len(candidates) else ""
        try:
            state = load_checkpoint(path)
        except VitlabError:
            if then:
                print(f"vitlab: checkpoint {path} is unreadable (truncated or damaged){then}", file=sys.stderr,
                      flush=True)
            continue
        if missing_training_keys(state):
            print(f"vitlab: {path} is not a training checkpoint (it lacks "
                  f"{', '.join(missing_training_keys(state))}){then}", file=sys.stderr, flush=True)
            continue
        return state, path
    raise VitlabError(f"cannot resume: no readable checkpoint in {checkpoint_folder(p)}; start the run again")


def state_is_finite(state: dict[str, Any]) -> bool:
    """Every floating-point tensor of the model in a checkpoint state is finite."""
    tensors = [t for t in state.get("model", {}).values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return all_finite(tensors)


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """No NaN or infinity in any tensor (one fused max-abs pass; finite values never overflow it)."""
    tensors = [t.detach() for t in tensors if t.numel()]  # an FSDP shard can be empty: it has no maximum
    if not tensors:
        return True
    maxima = torch._foreach_norm(tensors, ord=float("inf"))
    return bool(torch.isfinite(torch.stack([m.float() for m in maxima])).all())


def last_finite_checkpoint(folder: str | Path) -> Path | None:
    """The newest step checkpoint that reads and whose model tensors are all finite."""
    for path in CheckpointManager(folder).step_files()[::-1]:
        try:
            if state_is_finite(load_checkpoint(path)):
                return path
        except VitlabError:
            continue
    return None
