"""What a finished run hands back and leaves in its folder: TrainResult, the epoch line, plots, the model,
summary.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from vitlab.train import distributed as D
from vitlab.train.config import TrainConfig
from vitlab.train.run_dir import RunDir


@dataclass
class TrainResult:
    """What a finished run hands back (also written to the run folder)."""

    model: nn.Module
    run_dir: Path
    history: list[dict[str, Any]] = field(default_factory=list)
    test_metrics: dict[str, Any] | None = None
    wall_time_s: float = 0.0
    cpu_time_s: float = 0.0
    images_per_s: float = 0.0
    config: TrainConfig | None = None
    best_val_acc: float | None = None



def gather_stream_failures(data, info: D.DistInfo) -> None:
    """Streamed training files that failed on other ranks, added to this rank's list (a collective)."""
    failures = getattr(data.train, "failures", None)
    if not info.enabled or failures is None:
        return
    import torch.distributed as dist

    parts: list[Any] = [None] * info.world_size
    dist.all_gather_object(parts, list(failures))
    known = {p for p, _ in failures}
    for part in parts:
        for path, reason in part:
            if path not in known:
                known.add(path)
                failures.append((path, reason))



def epoch_line(r: dict[str, Any], num_epochs: int) -> str:
    parts = [f"epoch {r['epoch']}/{num_epochs}"]
    if r.get("train_loss") is not None:
        parts.append(f"train loss {r['train_loss']:.4f} acc {r['train_acc']:.4f}")
    if r.get("val_acc") is not None:
        parts.append(f"val loss {r['val_loss']:.4f} acc {r['val_acc']:.4f} macro-F1 {r['val_macro_f1']:.4f}")
    parts.append(f"{r['time_s']:.0f}s")
    return " | ".join(parts)


def write_outputs(run: RunDir, cfg: TrainConfig, result: TrainResult, raw_model: nn.Module, wrapped: nn.Module,
                   class_names: list[str], tcfg, split_name: str, n_params: int, precision: str,
                   device: torch.device, world: int, total_steps: int, fsdp_state: dict | None = None,
                   resolved: dict | None = None) -> list[Path]:
    """The run folder's plots, model and summary.json; returns the figures written (for the trackers).
    `resolved` (`resolved_settings`): what the settings config.yaml leaves to defaults came to."""
    from vitlab.train.plots import plot_curves

    figures = plot_curves(run.path)
    tm = result.test_metrics
    if tm is not None:
        from vitlab.evaluate.plots import plot_confusion_matrix

        figures.append(run.path / "confusion_matrix.png")
        plot_confusion_matrix(tm["confusion_matrix"], class_names, figures[-1],
                              title=f"{split_name} confusion matrix (accuracy {tm['accuracy']:.4f} on "
                                    f"{sum(map(sum, tm['confusion_matrix']))} images)")
    if cfg.save_model:
        from vitlab.weights import save_native

        model = raw_model
        if fsdp_state is not None:  # the sharded model -> a plain CPU copy with the gathered weights
            from vitlab.models.registry import build_unfilled

            model = build_unfilled(raw_model.config)  # every weight comes from the gathered state
            model.load_state_dict(fsdp_state, assign=True)
            result.model = model
        save_native(model.cpu() if model is not raw_model else cpu_copy(model), run.path / "model",
                    class_names=class_names, preprocess=tcfg.preprocess())
    summary = {
        "run_dir": str(run.path), "recipe": cfg.recipe, "data": cfg.data,
        "model": getattr(getattr(raw_model, "config", None), "name", type(raw_model).__name__),
        "parameters": n_params, "precision": precision, "device": str(device), "processes": world,
        "steps": total_steps, "epochs": len(result.history),
        "eval_split": split_name,
        # the test pass runs at the run's precision: a bf16 run's accuracy can differ from `vitlab evaluate`'s fp32
        "test_precision": precision,
        "test_accuracy": tm["accuracy"] if tm else None,
        "test_accuracy_ci95": tm["accuracy_ci95"] if tm else None,
        "test_macro_f1": tm["macro_f1"] if tm else None,
        "best_val_acc": result.best_val_acc,
        "wall_time_s": result.wall_time_s, "train_images_per_s": result.images_per_s,
        # CPU seconds (all threads) of this process and the earlier segments' (before a resume), as wall_time_s
        "process_cpu_time_s": result.cpu_time_s, "torch_threads": torch.get_num_threads(),
        "resolved_settings": resolved or {},
        "history": result.history, "test_metrics": tm,
    }
    run.write_json("summary.json", summary)
    return figures


def resolved_settings(plan, tcfg, model: nn.Module, device: torch.device) -> dict[str, Any]:
    """The values config.yaml leaves as null or auto ("the source's default", "the model's", "as fits"), as this
    run used them: with them the run folder holds the fully resolved settings, and a later vitlab with other
    defaults can still rebuild the run (config.yaml itself keeps null, which a resume compares as given)."""
    import dataclasses

    config = getattr(model, "config", None)
    transforms = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(tcfg).items()}
    return {
        "device": str(device), "micro_batch": plan.micro, "accumulation_steps": plan.accum,
        "warmup_steps": plan.warmup, "steps_per_epoch": plan.steps_per_epoch,
        "dropout": getattr(config, "dropout", None), "drop_path": getattr(config, "drop_path", None),
        "image_size": list(getattr(config, "image_size", ())) or None, "transforms": transforms,
    }


def cpu_copy(model: nn.Module) -> nn.Module:
    """save_native needs CPU tensors; copy only when the model lives elsewhere."""
    first = next(model.parameters(), None)
    if first is None or first.device.type == "cpu":
        return model
    import copy

    return copy.deepcopy(model).cpu()
