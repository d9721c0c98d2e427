"""The run folder: config.yaml, metrics.jsonl (one JSON record per line), checkpoints/, plots, summary."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from vitlab.train.checkpoint import atomic_write_text, remove_stale_temp_files
from vitlab.train.config import TrainConfig, save_yaml


def new_run_dir(cfg: TrainConfig) -> Path:
    """`out_dir/name`, or `out_dir/<recipe>-<data>-<UTC time>` (a numeric suffix if it exists)."""
    if cfg.name:
        return Path(cfg.out_dir) / cfg.name
    data = Path(str(cfg.data).split(":")[0]).name.replace("/", "_") or "data"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = Path(cfg.out_dir) / f"{cfg.recipe}-{data}-{stamp}"
    path, i = base, 1
    while path.exists():
        path = Path(f"{base}-{i}")
        i += 1
    return path


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
