"""Training checkpoints: atomic writes, keep the last K and the best, full RNG state for exact resume.

A checkpoint is one `torch.save` file of plain tensors and Python scalars (read back with
`weights_only=True`): model, optimizer, scheduler, loss scaler, every RNG, and the position
(epoch, step in epoch, global step).
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitlab.errors import VitlabError


def atomic_save(obj: Any, path: str | Path) -> Path:
    """torch.save to a temporary file in the same folder, fsync, then rename: a kill leaves either
    the old file or the new one, never half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def atomic_write_text(text: str, path: str | Path) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
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
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
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

    def save_best(self, state: dict[str, Any], metric: float) -> Path:
        state = dict(state, best_metric=float(metric))
        return atomic_save(state, self.folder / "best.pt")


def find_resume_checkpoint(run: str | Path) -> Path:
    """`--resume RUN` accepts a run folder (its latest step checkpoint) or a checkpoint file."""
    p = Path(run)
    if p.is_file():
        return p
    if not p.exists():
        raise VitlabError(f"cannot resume: {p} does not exist; give a run folder or a checkpoint file")
    latest = CheckpointManager(p / "checkpoints").latest()
    if latest is None:
        raise VitlabError(f"cannot resume: no checkpoints in {p / 'checkpoints'} (the run stopped before its first one)")
    return latest
