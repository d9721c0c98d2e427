"""PNG figures for evaluation and comparisons: confusion matrix, per-epoch curves, bar charts."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from vitlab.data.images import one_line  # noqa: E402


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_confusion_matrix(
    cm: Sequence[Sequence[int]],
    class_names: Sequence[str],
    path: str | Path,
    title: str | None = None,
    normalize: bool = False,
) -> Path:
    """Confusion matrix heat map (rows = true class, columns = predicted) with counts in the cells.

    `normalize=True` colours by the row-normalised rate (per-class recall on the diagonal); the
    cells still show the counts.
    """
    counts = np.asarray(cm, dtype=np.int64)
    k = counts.shape[0]
    rows = counts.sum(axis=1, keepdims=True)
    shown = np.divide(counts, np.maximum(rows, 1)) if normalize else counts
    size = max(4.0, min(0.55 * k + 2.0, 24.0))
    fig, ax = plt.subplots(figsize=(size, size * 0.9))
    im = ax.imshow(shown, cmap="Blues", interpolation="nearest")
    bar = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the true class" if normalize else "images")
    if not normalize:  # counts: whole-number ticks (a small matrix got 0.5, 1.5, ... images)
        from matplotlib.ticker import MaxNLocator

        bar.locator = MaxNLocator(integer=True)
        bar.update_ticks()
    ax.set_xticks(range(k))
    ax.set_yticks(range(k))
    # a weights file's class names may hold a line break or a lone surrogate, which FreeType cannot draw
    shown_names = [one_line(str(name)) for name in class_names]
    ax.set_xticklabels(shown_names, rotation=45 if k > 3 else 0, ha="right" if k > 3 else "center")
    ax.set_yticklabels(shown_names)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    if k <= 30:
        threshold = shown.max() / 2 if shown.size else 0
        for i in range(k):
            for j in range(k):
                ax.text(j, i, str(counts[i, j]), ha="center", va="center", fontsize=8 if k > 10 else 10,
                        color="white" if shown[i, j] > threshold else "black")
    ax.set_title(title or f"confusion matrix ({int(counts.sum())} images)")
    return _save(fig, path)


def plot_lines(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: str | Path,
    title: str,
    xlabel: str = "epoch",
    ylabel: str = "",
) -> Path:
    """One line per name: `series[name] = (xs, ys)`; used for per-epoch validation loss/accuracy."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, (xs, ys) in series.items():
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None and np.isfinite(y)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if series:  # outside the axes, right: a legend inside covers curves that run into a corner
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8, frameon=False)
    if xlabel == "epoch":
        ax.xaxis.get_major_locator().set_params(integer=True)
    return _save(fig, path)


def wrap_label(name: str, width: int = 16) -> str:
    """A model name on lines of about `width` characters, broken only after a space, ',', '(' or '/'
    (`custom(dim=32,depth=1)`, `vit-b/16`): a part that does not fit stays whole rather than split mid-word."""
    lines: list[str] = []
    for part in re.split(r"(?<=[ ,(/])", name):
        if lines and len(lines[-1]) + len(part) <= width:
            lines[-1] += part
        elif part:
            lines.append(part)
    return "\n".join(line.rstrip() for line in lines)


def plot_bars(
    values: Mapping[str, float],
    path: str | Path,
    title: str,
    ylabel: str = "",
    fmt: str = "{:.1f}",
) -> Path:
    """A bar per name with its value written on top (e.g. training runtime per model)."""
    names = list(values)
    vals = [float(values[n]) for n in names]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(names) + 2), 4.2))
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(names))]  # the same colours as the line plots
    bars = ax.bar(range(len(names)), vals, color=colors)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([wrap_label(n) for n in names], rotation=20 if len(names) > 3 else 0, fontsize=8)
    for b, v in zip(bars, vals):
        ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_fewshot(
    curves: Mapping[str, tuple[Sequence[int], Sequence[float], Sequence[float]]],
    path: str | Path,
    title: str = "few-shot linear evaluation (closed-form ridge)",
    chance: float | None = None,
    incomplete: Sequence[int] = (),
) -> Path:
    """Accuracy vs shots per class, mean with a +-std band: `curves[name] = (shots, mean, std)`. Shot counts in
    `incomplete` (a class had fewer training images than that) are drawn hollow and named in the legend: such a
    point stands at its nominal shots but was fitted on fewer images."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    short = {int(k) for k in incomplete}
    for name, (shots, mean, std) in curves.items():
        m, s = np.asarray(mean, float), np.asarray(std, float)
        (line,) = ax.plot(shots, 100 * m, marker="o", label=name)
        ax.fill_between(shots, 100 * (m - s), 100 * (m + s), alpha=0.2)
        hollow = [i for i, k in enumerate(shots) if int(k) in short]
        if hollow:
            ax.scatter([shots[i] for i in hollow], [100 * m[i] for i in hollow], s=80, facecolors="white",
                       edgecolors=line.get_color(), linewidths=1.5, zorder=3,
                       label="incomplete: a class has fewer images than the shots")
    if chance is not None:
        ax.axhline(100 * chance, color="grey", ls="--", label="chance")
    ax.set_xscale("log")
    ticks = sorted({int(k) for shots, _, _ in curves.values() for k in shots})
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("shots per class")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8, frameon=False)
    return _save(fig, path)
