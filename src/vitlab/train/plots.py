"""Loss and accuracy curves of a run, drawn from its metrics.jsonl (so they can be redrawn any time)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from vitlab.train.run_dir import read_metrics  # noqa: E402


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _train_loss_note(run_dir: Path) -> str:
    """What makes the train loss another quantity than the validation loss (label smoothing, mixed targets), for
    the legend: without it a train loss above the validation loss read as a bug. '' where there is none."""
    import yaml

    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return ""
    parts = []
    if _num(cfg.get("label_smoothing")) > 0:
        parts.append(f"label smoothing {cfg['label_smoothing']:g}")
    if _num(cfg.get("mixup")) > 0 or _num(cfg.get("cutmix")) > 0:
        parts.append("mixed targets")
    return "".join(f", {p}" for p in parts)


def plot_curves(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write `loss.png` (per-step train loss, per-epoch train/val loss) and `accuracy.png`
    (per-epoch train/val accuracy and val macro-F1) into the run folder (or `out_dir`)."""
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir else run_dir
    out.mkdir(parents=True, exist_ok=True)
    records = read_metrics(run_dir)
    steps = [r for r in records if r.get("type") == "step"]
    epochs = [r for r in records if r.get("type") == "epoch"]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.2))
    note = _train_loss_note(run_dir)
    if steps:
        ax.plot([r["epoch_float"] for r in steps], [_num(r["loss"]) for r in steps], lw=0.8, alpha=0.5,
                label=f"train loss (per step{note})")
    if epochs:
        xs = [r["epoch"] for r in epochs]
        ax.plot(xs, [_num(r.get("train_loss")) for r in epochs], "o-", label=f"train loss (epoch mean{note})")
        if any(r.get("val_loss") is not None for r in epochs):
            ax.plot(xs, [_num(r.get("val_loss")) for r in epochs], "s-", label="validation loss")
    written.append(_save(fig, ax, "cross-entropy", "Loss", out / "loss.png"))

    fig, ax = plt.subplots(figsize=(7, 4.2))
    if epochs:
        xs = [r["epoch"] for r in epochs]
        ax.plot(xs, [_num(r.get("train_acc")) for r in epochs], "o-", label="train accuracy")
        if any(r.get("val_acc") is not None for r in epochs):
            ax.plot(xs, [_num(r.get("val_acc")) for r in epochs], "s-", label="validation accuracy")
            ax.plot(xs, [_num(r.get("val_macro_f1")) for r in epochs], "^--", label="validation macro-F1")
    written.append(_save(fig, ax, "fraction", "Accuracy", out / "accuracy.png"))
    return written


def _save(fig, ax, ylabel: str, title: str, path: Path) -> Path:
    """Label an epoch-axis figure, write it as PNG and close it."""
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
