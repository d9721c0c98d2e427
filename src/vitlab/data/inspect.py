"""What is in a data source: classes, counts per class and split, image sizes, unreadable files, sample grid."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from vitlab.data.dataset import DataSplits, skipped_summary
from vitlab.data.images import one_line


def describe(splits: DataSplits) -> dict:
    """Counts per class and split, image size statistics (of the files when known) and skipped files."""
    parts = splits.splits()
    counts = {name: ds.class_counts() for name, ds in parts.items()}
    sizes = []
    for ds in parts.values():
        if getattr(ds, "original_sizes", None):
            sizes.extend(ds.original_sizes)
    stored = next(iter(parts.values())).image_size
    info = {
        "name": splits.name,
        "classes": list(splits.class_names),
        "channels": splits.channels,
        "counts": counts,
        "stored_size": list(stored),
        "skipped": [list(s) for s in splits.all_skipped()],
        "notes": list(splits.notes),
    }
    if sizes:
        w = np.array([s[0] for s in sizes])
        h = np.array([s[1] for s in sizes])
        info["file_sizes"] = {
            "n": len(sizes),
            "width": [int(w.min()), float(np.median(w)), int(w.max())],
            "height": [int(h.min()), float(np.median(h)), int(h.max())],
            "distinct": len(set(sizes)),
        }
    return info


def format_table(info: dict, max_skipped: int = 10) -> str:
    """The printed report: one row per class, one column per split, then sizes and skipped files."""
    splits = list(info["counts"])
    classes = [one_line(c) for c in info["classes"]]  # a CSV label may hold a line break ("a\nb", quoted)
    width = max([len("class"), len("total"), *(len(c) for c in classes)])
    lines = [f"source: {info['name']}  ({len(info['classes'])} classes, {info['channels']} channel"
             f"{'s' if info['channels'] != 1 else ''}, stored {info['stored_size'][0]}x{info['stored_size'][1]})"]
    lines.append(f"{'class':<{width}}  " + "  ".join(f"{s:>7}" for s in splits))
    for i, c in enumerate(classes):
        lines.append(f"{c:<{width}}  " + "  ".join(f"{info['counts'][s][i]:>7}" for s in splits))
    lines.append(f"{'total':<{width}}  " + "  ".join(f"{sum(info['counts'][s]):>7}" for s in splits))
    fs = info.get("file_sizes")
    if fs:
        lines.append(f"image files: {fs['n']}, {fs['distinct']} distinct sizes; width min/median/max "
                     f"{fs['width'][0]}/{fs['width'][1]:g}/{fs['width'][2]}, height "
                     f"{fs['height'][0]}/{fs['height'][1]:g}/{fs['height'][2]}")
    else:
        lines.append(f"image size: all {info['stored_size'][0]}x{info['stored_size'][1]}")
    skipped = info["skipped"]
    lines.append(skipped_summary([tuple(s) for s in skipped]))
    for path, reason in skipped[:max_skipped]:
        lines.append(f"  {one_line(path)}: {one_line(reason)}")
    if len(skipped) > max_skipped:
        lines.append(f"  ... and {len(skipped) - max_skipped} more")
    lines.extend(f"note: {n}" for n in info["notes"])
    return "\n".join(lines)


def sample_grid(splits: DataSplits, path: str | os.PathLike, per_class: int = 8, seed: int = 0,
                max_classes: int = 20) -> Path:
    """PNG grid: one row per class (up to max_classes), `per_class` seeded random training images each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds = splits.train
    classes = splits.class_names[:max_classes]
    rng = np.random.default_rng(seed)
    labels = ds.labels.numpy()
    fig, axes = plt.subplots(len(classes), per_class, figsize=(per_class * 1.1, len(classes) * 1.1 + 0.4),
                             squeeze=False)
    for r, name in enumerate(classes):
        idx = np.flatnonzero(labels == r)
        pick = rng.choice(idx, size=min(per_class, len(idx)), replace=False) if len(idx) else []
        for c in range(per_class):
            ax = axes[r, c]
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_visible(False)
            if c < len(pick):
                img: torch.Tensor = ds[int(pick[c])][0]
                arr = img.permute(1, 2, 0).numpy()
                if arr.shape[2] == 1:
                    ax.imshow(arr[:, :, 0], cmap="gray", vmin=0, vmax=255)
                else:
                    ax.imshow(arr)
            if c == 0:
                ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
    more = f" (first {max_classes} of {len(splits.class_names)} classes)" if len(splits.class_names) > max_classes else ""
    fig.suptitle(f"{splits.name}: training samples{more}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
