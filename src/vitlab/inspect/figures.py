"""Matplotlib figures for the four inspection analyses (PNG files, Agg backend, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vitlab.inspect.filters import FilterPCA, tile_for_display  # noqa: E402
from vitlab.inspect.posemb import similarity_limits, similarity_mosaic  # noqa: E402


def _save(fig: plt.Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


MAX_FILTER_CHANNELS = 8  # channels drawn side by side for a kernel that is neither grey nor RGB


def channel_strip(tile: np.ndarray, channels: int = MAX_FILTER_CHANNELS) -> np.ndarray:
    """(P, P, C) display tile -> (P, C' * (P + 1) - 1) grey strip, the first C' <= `channels` channels side by
    side with a NaN gap: a kernel of 2, 4 or more channels has no RGB picture (matplotlib refuses 2 channels and
    reads a 4th as transparency), so each channel is shown on its own."""
    p, q, c = tile.shape
    c = min(c, channels)
    strip = np.full((p, c * (q + 1) - 1), np.nan)
    for j in range(c):
        strip[:, j * (q + 1): j * (q + 1) + q] = tile[..., j]
    return strip


def plot_filters(pca: FilterPCA, path: str | Path, title: str | None = None, cols: int = 7) -> Path:
    """Top principal components as P x P x C tiles, 7 per row as in Fig. 7: RGB for 3 channels, grey for one,
    the channels side by side in grey otherwise; above each tile its share of the filters' variance."""
    k = len(pca.components)
    c = pca.components.shape[1]
    strip = c not in (1, 3)
    shown = min(c, MAX_FILTER_CHANNELS)
    cols = max(1, min(cols, 14 // shown)) if strip else cols  # wide strips: fewer per row
    rows = int(np.ceil(k / cols))
    cell_w = 1.1 * shown if strip else 1.1
    fig, axes = plt.subplots(rows, cols, figsize=(max(cell_w * cols, 4.0), 1.1 * rows + 0.6), squeeze=False)
    grey = plt.get_cmap("gray").with_extremes(bad="white")
    for i, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if i >= k:
            continue
        tile = tile_for_display(pca.components[i])
        if strip:
            ax.imshow(np.ma.masked_invalid(channel_strip(tile)), cmap=grey, vmin=0, vmax=1, interpolation="nearest")
        elif c == 1:
            ax.imshow(tile[..., 0], cmap="gray", vmin=0, vmax=1, interpolation="nearest")
        else:
            ax.imshow(np.clip(tile, 0, 1), interpolation="nearest")
        ax.set_title(f"{100 * pca.explained_variance_ratio[i]:.1f}%", fontsize=8, pad=1)
    what = (f"channels 1-{shown}{f' of {c}' if shown < c else ''} side by side, grey" if strip else "")
    fig.suptitle((title or f"Embedding filters (first {k} principal components)")
                 + f"\n% above each: share of the filters' variance{f'; {what}' if what else ''}", fontsize=9)
    return _save(fig, path)


def plot_posemb_similarity(sim: np.ndarray, path: str | Path, title: str | None = None, scale: str = "robust") -> Path:
    """Tiles of cosine similarity on the patch grid (Fig. 7 centre / Fig. 10), viridis as the paper.

    The colour scale is the figure's own robust off-diagonal range (`similarity_limits`), not -1..1: a
    fixed sin-cos table has all similarities near 1 and would otherwise be one flat colour. `scale="paper"`
    gives the paper's fixed -1..1 instead.
    """
    h, w, th, tw = sim.shape
    mosaic = similarity_mosaic(sim, gap=1)
    size = min(9.0, max(4.5, 0.45 * max(h, w) + 1.5))
    fig, ax = plt.subplots(figsize=(size * w / max(h, w) + 1.0, size * h / max(h, w)))
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")
    lo, hi = (-1.0, 1.0) if scale == "paper" else similarity_limits(sim)
    im = ax.imshow(np.ma.masked_invalid(mosaic), cmap=cmap, vmin=lo, vmax=hi, interpolation="nearest")
    step_r, step_c = th + 1, tw + 1
    every = max(1, max(h, w) // 12)
    ax.set_xticks([c * step_c + (tw - 1) / 2 for c in range(0, w, every)], [str(c + 1) for c in range(0, w, every)])
    ax.set_yticks([r * step_r + (th - 1) / 2 for r in range(0, h, every)], [str(r + 1) for r in range(0, h, every)])
    ax.tick_params(length=0, labelsize=9)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_xlabel("Input patch column")
    ax.set_ylabel("Input patch row")
    extend = {(False, False): "neither", (True, False): "min", (False, True): "max", (True, True): "both"}[
        (bool(np.nanmin(mosaic) < lo), bool(np.nanmax(mosaic) > hi))]
    # a colour bar axis cut from the image's own (aspect-fixed) box is exactly as tall as the tiles; colorbar(ax=)
    # took a share of the axes' box, which on a wide or tall grid ran far above or below them
    from mpl_toolkits.axes_grid1 import make_axes_locatable

    bar = make_axes_locatable(ax).append_axes("right", size=0.18, pad=0.12)
    fig.colorbar(im, cax=bar, extend=extend,
                 label="Cosine similarity" + ("" if scale == "paper" else "\n(this figure's own scale)"))
    ax.set_title(title or "Position embedding similarity", fontsize=10)
    return _save(fig, path)


def plot_attention_distance(
    distance: np.ndarray, path: str | Path, image_width: int | None = None, title: str | None = None,
    uniform: float | None = None,
) -> Path:
    """One dot per head at each depth (Fig. 7 right / Fig. 11); right axis as a fraction of the image width.

    `uniform`: the distance of uniform attention over all patches, drawn as a dashed reference line.
    """
    layers, heads = distance.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * layers + 2.5), 3.6))
    colours = plt.get_cmap("tab20")(np.arange(heads) % 20)
    for hd in range(heads):
        ax.scatter(np.arange(1, layers + 1), distance[:, hd], s=14, color=colours[hd], label=f"head {hd + 1}",
                   edgecolors="none")
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_xticks(np.arange(1, layers + 1, max(1, layers // 12)))
    top = float(np.nanmax(distance))
    if uniform is not None:
        ax.axhline(uniform, color="grey", ls="--", lw=0.8, label="uniform attention")
        top = max(top, uniform)
    ax.set_ylim(0, max(top * 1.1, 1e-6))
    ax.grid(alpha=0.3)
    if image_width:
        sec = ax.secondary_yaxis("right", functions=(lambda y: y / image_width, lambda f: f * image_width))
        sec.set_ylabel("Fraction of image width")
    if heads <= 16:
        ax.legend(fontsize=8, ncol=2, loc="lower right", framealpha=0.85)
    ax.set_title(title or "Mean attention distance per head", fontsize=10)
    return _save(fig, path)


def upsample_map(token_map: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(h, w) map -> (H, W) with bicubic interpolation, min-max normalised to [0, 1] for overlay."""
    t = torch.as_tensor(np.asarray(token_map, dtype=np.float32))[None, None]
    up = F.interpolate(t, size=size, mode="bicubic", align_corners=False)[0, 0].numpy()
    lo, hi = float(up.min()), float(up.max())
    return (up - lo) / (hi - lo) if hi > lo else np.zeros_like(up)


def _show_image(ax: plt.Axes, image: np.ndarray) -> None:
    """RGB as it is, one channel in grey; any other channel count (2, 4, ...) as the grey mean of its channels:
    matplotlib refuses 2 channels and would read a 4th as transparency."""
    if image.ndim == 3 and image.shape[-1] != 3:
        ax.imshow(image.mean(-1), cmap="gray", vmin=0, vmax=1)
    else:
        ax.imshow(np.clip(image, 0, 1))
    ax.set_axis_off()


TITLE_PT = 9  # per-image titles and tick labels: readable at the saved size (1 pt = 1/72 inch of the figure)
_TITLE_CHARS = 20  # a title line wraps after this many characters (20 x 9 pt fits the 1.6 inch column)
_CELL_W = 1.6  # inches per image: 6 columns at 110 dpi fit the report's 1100 px unscaled


def rollout_layout(k: int, cols: int, aspect: float, labels: list[str] | None) -> tuple[int, int, float, float, int]:
    """(blocks, cols, width, height in inches, title lines) for `k` images: the size follows the image count,
    each column wide enough for a 9 pt title of `_TITLE_CHARS` characters per line; rows are balanced
    (8 images: 2 rows of 4, not 6 + 2)."""
    cols = max(1, min(cols, k))
    blocks = int(np.ceil(k / cols))
    cols = int(np.ceil(k / blocks))
    lines = max((len(_wrap(t)) for t in labels), default=0) if labels else 0
    cell_w = _CELL_W
    cell_h = cell_w * aspect
    title_h = lines * TITLE_PT * 1.3 / 72  # inches of title above each input image
    width = cell_w * cols + 0.2
    height = blocks * (2 * cell_h + title_h + 0.25) + 0.5
    return blocks, cols, width, height, lines


def _wrap(text: str) -> list[str]:
    import textwrap

    out: list[str] = []
    for part in str(text).split("\n"):
        out.extend(textwrap.wrap(part, _TITLE_CHARS, break_long_words=True) or [""])
    return out


def plot_rollout(
    images: np.ndarray,
    maps: np.ndarray,
    path: str | Path,
    labels: list[str] | None = None,
    title: str | None = None,
    cols: int = 6,
) -> Path:
    """Each input image (top) and its rollout map overlaid (below), as in Fig. 6 / Fig. 14.

    `images`: (K, H, W, C) in [0, 1]; `maps`: (K, h, w) on the patch grid. The figure's size is computed
    from K so that the per-image titles (`labels`, wrapped, may contain newlines) are 9 pt at the saved size.
    """
    k = len(images)
    blocks, cols, width, height, lines = rollout_layout(k, cols, images.shape[1] / images.shape[2], labels)
    cell_h = _CELL_W * images.shape[1] / images.shape[2]
    title_h = lines * TITLE_PT * 1.3 / 72
    ratios = [v for _ in range(blocks) for v in (cell_h + title_h, cell_h)]
    fig, axes = plt.subplots(2 * blocks, cols, figsize=(width, height), squeeze=False,
                             gridspec_kw={"height_ratios": ratios, "hspace": 0.08, "wspace": 0.06,
                                          "top": 1 - 0.45 / height, "bottom": 0.01, "left": 0.01, "right": 0.99})
    for ax in axes.flat:
        ax.set_axis_off()
    for i in range(k):
        r, c = 2 * (i // cols), i % cols
        img = images[i]
        _show_image(axes[r, c], img)
        axes[r, c].set_anchor("S")  # the image at the bottom of its slot, the title in the room above
        axes[r + 1, c].set_anchor("N")
        if labels:
            axes[r, c].set_title("\n".join(_wrap(labels[i])), fontsize=TITLE_PT, pad=2, linespacing=1.1)
        _show_image(axes[r + 1, c], img)
        axes[r + 1, c].imshow(upsample_map(maps[i], img.shape[:2]), cmap="jet", alpha=0.5, vmin=0, vmax=1)
    fig.suptitle(title or "Attention rollout (top: input, bottom: rollout overlay)", fontsize=11)
    return _save(fig, path)


def plot_attention_maps(
    maps: np.ndarray, path: str | Path, image: np.ndarray | None = None, title: str | None = None
) -> Path:
    """Raw attention of one image per layer (rows) and head (columns), each tile scaled to its maximum."""
    layers, heads, h, w = maps.shape
    gap = 1
    mosaic = np.full((layers * (h + gap) - gap, heads * (w + gap) - gap), np.nan)
    for li in range(layers):
        for hd in range(heads):
            m = maps[li, hd]
            peak = m.max()
            mosaic[li * (h + gap): li * (h + gap) + h, hd * (w + gap): hd * (w + gap) + w] = m / peak if peak > 0 else m
    extra = 1 if image is not None else 0
    scale = min(0.6, 10.0 / max(heads, layers))
    # Constrained layout reserves room for the suptitle above the axes' own titles and labels: with fixed
    # subplot margins the suptitle of a short (1-2 layer) figure sat on the "input" title.
    fig, axes = plt.subplots(
        1, 1 + extra, figsize=(scale * heads + 2.5 * extra + 1.0, max(2.2, scale * layers + 1.0)),
        squeeze=False, gridspec_kw={"width_ratios": ([1.0] if extra else []) + [max(1.0, heads / 4)]},
        layout="constrained",
    )
    if image is not None:
        _show_image(axes[0, 0], image)
        axes[0, 0].set_title("input", fontsize=8)
    ax = axes[0, extra]
    cmap = plt.get_cmap("inferno").with_extremes(bad="white")
    ax.imshow(np.ma.masked_invalid(mosaic), cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks([hd * (w + gap) + (w - 1) / 2 for hd in range(heads)], [str(i + 1) for i in range(heads)])
    ax.set_yticks([li * (h + gap) + (h - 1) / 2 for li in range(layers)], [str(i + 1) for i in range(layers)])
    ax.tick_params(length=0, labelsize=8)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    fig.suptitle(title or "Raw attention per layer and head", fontsize=9)
    return _save(fig, path)
