"""Glue: run every analysis that applies to a model on a batch of images, write PNGs + HTML + arrays.

The analyses themselves are pure functions (filters, posemb, distance, rollout); this module only
collects attention in batches under `torch.no_grad`, calls them, and draws the figures.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.inspect import figures
from vitlab.inspect.distance import attention_distance, uniform_attention_distance
from vitlab.inspect.filters import FilterPCA, embedding_filter_pca
from vitlab.inspect.posemb import posemb_similarity, scale_text
from vitlab.inspect.report import Section, write_report
from vitlab.inspect.rollout import attention_maps, probe_weights, rollout_maps
from vitlab.inspect.summary import distance_summary, filter_summary, posemb_summary, summary_lines
from vitlab.progress import progress_bar

FIGURE_NAMES = {
    "filters": "inspect_filters.png",
    "posemb": "inspect_posemb.png",
    "distance": "inspect_distance.png",
    "rollout": "inspect_rollout.png",
    "attention": "inspect_attention.png",
}


@dataclass
class InspectResult:
    """Everything `inspect_model` computed; arrays are numpy, figures and report are paths."""

    out_dir: Path
    figures: dict[str, Path] = field(default_factory=dict)
    report: Path | None = None
    filter_pca: FilterPCA | None = None
    posemb_similarity: np.ndarray | None = None  # (h, w, h, w)
    attention_distance: np.ndarray | None = None  # (layers, heads), pixels, mean over images
    attention_distance_per_image: np.ndarray | None = None  # (N, layers, heads)
    rollout_maps: np.ndarray | None = None  # (K, h, w), each divided by its max
    attention_maps: np.ndarray | None = None  # (layers, heads, h, w) for the first image
    predictions: np.ndarray | None = None  # (N,) argmax of the logits
    grid: tuple[int, int] | None = None  # token grid of the images
    image_width: int | None = None  # pixels
    notes: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (analysis, why), listed in the report
    summary: dict = field(default_factory=dict)  # inspect/summary.py: the Fig. 7 findings as numbers
    settings: dict = field(default_factory=dict)  # data source, split, seed, number of images, analysis options


def check_inspectable(model: nn.Module) -> None:
    """ResNets (and anything without attention) have none of the paper's ViT inspection figures."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "arch", "vit") != "vit" or not hasattr(model, "blocks"):
        raise VitlabError(
            "this model is a ResNet (no attention, no position or patch embeddings), so none of the "
            "inspection analyses apply; pass a ViT or hybrid R+ViT model"
        )


@torch.no_grad()
def collect(
    model: nn.Module,
    images: torch.Tensor,
    *,
    batch_size: int = 32,
    rollout_images: int = 8,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    cls: str = "exclude",
    progress: bool = True,
    forward=None,
) -> dict[str, np.ndarray]:
    """One pass over `images` (N, C, H, W, normalised) collecting per-image distances, rollout maps of
    the first `rollout_images`, raw per-head maps of image 0 and predictions; attention is reduced batch
    by batch, so memory stays at one batch of attention."""
    check_inspectable(model)
    if images.dim() != 4 or len(images) == 0:
        raise VitlabError(f"expected a non-empty (N, C, H, W) batch of images, got shape {tuple(images.shape)}")
    device = next(model.parameters()).device
    stride = model.config.stride
    grid = model.config.grid_for(tuple(images.shape[-2:]))
    prefix = model.num_prefix_tokens
    was_training = model.training
    model.eval()
    dists, preds, rolls = [], [], []
    raw = None
    starts = range(0, len(images), batch_size)
    for start in progress_bar(starts, desc=f"inspect: attention of {len(images)} images", unit="batch",
                              enabled=progress):
        x = images[start: start + batch_size].to(device)
        # `forward` (vitlab.engine.attention) may run the same model in ONNX Runtime
        logits, attn = forward(x) if forward is not None else model(x, return_attention=True)
        preds.append(logits.argmax(-1).cpu())
        dists.append(attention_distance(attn, grid, stride, prefix, cls))
        keep = max(0, min(rollout_images - start, len(x)))
        if keep:
            rolls.append(rollout_maps([a[:keep] for a in attn], grid, prefix, head_fusion, discard_ratio,
                                      _map_probe(model, x[:keep], head_fusion)))
        if raw is None:
            raw = attention_maps([a[:1] for a in attn], grid, prefix, index=0)
    model.train(was_training)
    return {
        "distance_per_image": np.concatenate(dists, axis=0),
        "rollout_maps": np.concatenate(rolls, axis=0) if rolls else np.zeros((0, *grid)),
        "attention_maps": raw,
        "predictions": torch.cat(preds).numpy(),
        "grid": np.array(grid),
    }


def _map_probe(model: nn.Module, x: torch.Tensor, head_fusion: str) -> torch.Tensor | None:
    """A MAP model's probe attention over its output tokens (B, N), heads fused; None for other heads. Computed
    by the model itself, also where `forward` runs another engine: the engines return the blocks' attention only."""
    pool = getattr(model, "attn_pool", None)
    if pool is None:
        return None
    return probe_weights(pool.probe_attention(model.forward_features(x)), head_fusion)


def _to_display(images: torch.Tensor, mean, std) -> np.ndarray:
    """Undo the normalisation for display: (K, C, H, W) -> (K, H, W, C) in [0, 1]."""
    c = images.shape[1]
    m = torch.as_tensor(mean, dtype=images.dtype).reshape(-1)[:c].reshape(1, -1, 1, 1) if mean is not None else 0.5
    s = torch.as_tensor(std, dtype=images.dtype).reshape(-1)[:c].reshape(1, -1, 1, 1) if std is not None else 0.5
    if isinstance(m, torch.Tensor) and m.shape[1] != c:
        m, s = m.mean(), s.mean()
    return (images * s + m).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()


def inspect_model(
    model: nn.Module,
    images: torch.Tensor | None,
    out_dir: str | Path,
    *,
    mean=(0.5, 0.5, 0.5),
    std=(0.5, 0.5, 0.5),
    labels: list[str] | None = None,
    class_names: list[str] | None = None,
    batch_size: int = 32,
    rollout_images: int = 8,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    cls: str = "exclude",
    num_components: int = 28,
    title: str = "vitlab inspect",
    progress: bool = True,
    extra_sections: Sequence[Section] = (),
    skipped: Sequence[tuple[str, str]] = (),
    forward=None,
    settings: dict | None = None,
    notes: Sequence[str] = (),
    position_table: tuple[torch.Tensor, tuple[int, int]] | None = None,
) -> InspectResult:
    """Run the analyses that apply to `model` and write `out_dir/inspect_*.png`, `report.html`,
    `inspect.npz` and `inspect.json`.

    `images` are (N, C, H, W) normalised with `mean`/`std` (used to undo it for display); N is how
    many images the attention distance averages over. `labels` are true labels of the first images.
    `extra_sections` (e.g. the demo's training curves) open the report; `skipped` lists (analysis, why)
    pairs the caller left out, shown with the ones skipped here in the report's "Skipped analyses".
    `settings` (e.g. the command's data source, split, seed and -n) are recorded with the analysis settings in the
    report's "Settings" table and in inspect.json; `notes` (e.g. "-n capped by the split") go with the notes here.
    """
    check_inspectable(model)
    cfg = model.config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res = InspectResult(out_dir=out, skipped=list(skipped), notes=list(notes))
    sections: list[Section] = list(extra_sections)
    prefix = model.num_prefix_tokens
    have_images = images is not None and len(images) > 0
    steps = ["embedding filters", "position embeddings", *(["attention", "figures"] if have_images else []), "report"]
    bar = progress_bar(total=len(steps), desc="inspect: analyses", unit="step", enabled=progress)

    def step(name: str) -> None:
        bar.set_postfix_str(name, refresh=True)

    # 1. Embedding filters (plain ViTs only: a hybrid's patch embedding sees CNN features, not pixels).
    step(steps[0])
    if cfg.is_hybrid:
        why = _hybrid_filters_reason(cfg)
        res.skipped.append(("Embedding filters (paper Fig. 7 left)", why))
        res.notes.append(f"embedding filters: skipped, {why}")
    else:
        w = model.patch_embed.proj.weight
        res.filter_pca = embedding_filter_pca(w, num_components)
        k = len(res.filter_pca.components)
        if num_components != 28 and k < num_components:  # asked for (not the paper's default 28) but capped
            res.notes.append(f"embedding filters: {k} principal components, not {num_components}: the kernel has "
                             f"{w.shape[0]} filters of {w.shape[1] * w.shape[2] * w.shape[3]} values")
        res.figures["filters"] = figures.plot_filters(
            res.filter_pca, out / FIGURE_NAMES["filters"],
            title=f"Embedding filters of {cfg.name} (first {k} principal components)",
        )
        evr = res.filter_pca.explained_variance_ratio
        res.summary["filters"] = filter_summary(res.filter_pca, tuple(w.shape))
        sections.append(Section(
            "Embedding filters (paper Fig. 7 left)",
            f"PCA of the {w.shape[0]} patch-embedding filters of size {w.shape[1]}x{w.shape[2]}x{w.shape[3]} "
            f"(C x P x P); the top {k} components, each scaled symmetrically around grey, the percentage above each "
            f"its share of the filters' variance. The first 5 explain {100 * evr[:5].sum():.1f}% of the variance."
            + ("" if w.shape[1] in (1, 3) else f" The kernel has {w.shape[1]} channels, not RGB: each component "
               f"shows its channels side by side in grey (at most {figures.MAX_FILTER_CHANNELS})."),
            res.figures["filters"],
        ))

    bar.update()
    # 2. Position-embedding similarity.
    step(steps[1])
    # the model's own table at its own grid: a table resampled for --image-size gets neighbour similarity from the
    # interpolation itself, and random embeddings looked like the paper's learned 2-D structure
    table, grid0 = position_table or (model.pos_embed, cfg.grid_size)
    own_grid = "" if position_table is None or tuple(grid0) == tuple(cfg.grid_size) else (
        f" It is the table at the model's own {grid0[0]}x{grid0[1]} grid, not the one resampled to "
        f"{cfg.grid_size[0]}x{cfg.grid_size[1]} for the images (interpolation alone makes neighbours similar).")
    res.posemb_similarity = posemb_similarity(table, grid0, prefix)
    res.figures["posemb"] = figures.plot_posemb_similarity(
        res.posemb_similarity, out / FIGURE_NAMES["posemb"],
        title=f"Position embedding similarity ({cfg.name}, {grid0[0]}x{grid0[1]} grid)",
    )
    res.summary["posemb"] = posemb_summary(res.posemb_similarity)
    kind = "learned" if cfg.posemb == "learn" else "fixed 2D sin-cos (not learned)"
    sections.append(Section(
        "Position-embedding similarity (paper Fig. 7 centre, Fig. 10)",
        f"Tile (r, c) shows the cosine similarity between the {kind} position embedding of the patch at "
        f"row r, column c and those of all patches; the class-token slot is excluded. The colour scale is this "
        f"figure's own ({scale_text(res.posemb_similarity)}), not -1..1, so the structure shows even when all "
        "similarities are high, as for a fixed sin-cos table; the colour bar gives the values." + own_grid,
        res.figures["posemb"],
    ))
    bar.update()

    if have_images:
        step(steps[2])
        stats = collect(model, images, batch_size=batch_size, rollout_images=rollout_images,
                        head_fusion=head_fusion, discard_ratio=discard_ratio, cls=cls, progress=progress, forward=forward)
        grid = tuple(int(g) for g in stats["grid"])
        res.attention_distance_per_image = stats["distance_per_image"]
        res.attention_distance = res.attention_distance_per_image.mean(0)
        res.rollout_maps = stats["rollout_maps"]
        res.attention_maps = stats["attention_maps"]
        res.predictions = stats["predictions"]
        bar.update()
        step(steps[3])
        width = images.shape[-1]
        n = len(images)
        res.grid, res.image_width = grid, width
        # 3. Mean attention distance.
        res.figures["distance"] = figures.plot_attention_distance(
            res.attention_distance, out / FIGURE_NAMES["distance"], image_width=width,
            title=f"Mean attention distance ({cfg.name}, {n} images, {width} px wide)",
            uniform=uniform_attention_distance(grid, cfg.stride),
        )
        how = ("over patch tokens only (class-token row and column dropped, rows renormalised)" if cls == "exclude"
               else "with attention to the class token counted as distance 0 (class-token row dropped, no renormalisation)")
        d = res.attention_distance
        res.summary["distance"] = distance_summary(d, uniform_attention_distance(grid, cfg.stride), width)
        table = [["layer", *[f"head {i + 1}" for i in range(d.shape[1])], "mean", "mean / width"]]
        for li, row in enumerate(d):
            table.append([str(li + 1), *[f"{v:.2f}" for v in row], f"{row.mean():.2f}", f"{row.mean() / width:.3f}"])
        sections.append(Section(
            "Mean attention distance (paper Fig. 7 right, Fig. 11)",
            f"Per layer and head, the attention-weighted Euclidean distance between query and key patch centres "
            f"in pixels (grid distance x stride {cfg.stride}), averaged over query patches and over {n} images; "
            f"computed {how}. Image width {width} px. Dashed line: uniform attention over all patches "
            f"({uniform_attention_distance(grid, cfg.stride):.2f} px); 0 = each patch attends only to itself.",
            res.figures["distance"], table,
        ))
        # 4. Rollout and raw attention.
        k = len(res.rollout_maps)
        disp = _to_display(images[:max(k, 1)], mean, std)
        names = []
        for i in range(k):
            pred = int(res.predictions[i])
            pname = class_names[pred] if class_names and pred < len(class_names) else str(pred)
            true = labels[i] if labels and i < len(labels) else None
            names.append(f"{true}\npred: {pname}" if true is not None else f"pred: {pname}")
        if k:
            res.figures["rollout"] = figures.plot_rollout(
                disp[:k], res.rollout_maps, out / FIGURE_NAMES["rollout"], labels=names,
                title=f"Attention rollout ({cfg.name}, heads fused by {head_fusion}"
                      f"{f', discard {discard_ratio:g}' if discard_ratio else ''})",
            )
        source = "the class token's row R[0, 1:]" if prefix else "the mean over all query rows (no class token: the output is the mean of all tokens)"
        if cfg.classifier == "map":  # its output is the probe's attention-weighted mix of the tokens
            source = (f"the MAP head's probe attention over the output tokens (heads fused by {head_fusion}) times R: "
                      "the output is that mix of the tokens, so the map traces it back to the input patches")
            res.notes.append("raw attention of a MAP model: the mean over all query rows (its probe's own weighting "
                             "is in the rollout, not in the per-layer tiles)")
        if not k:  # --rollout-images 0: no section with a heading and no figure
            res.skipped.append(("Attention rollout", "--rollout-images 0"))
        else:
            sections.append(Section(
                "Attention rollout (paper Fig. 6, Fig. 14)",
                f"Abnar & Zuidema (2020): heads fused by {head_fusion}"
                f"{f' with the lowest {discard_ratio:g} of entries discarded' if discard_ratio else ''}, the identity "
                f"added for the residual connection and every row renormalised to sum to one, then the product over "
                f"layers R = A_L ... A_1. The map is {source} on the {grid[0]}x{grid[1]} patch grid (stored divided by "
                f"its maximum), upsampled, stretched from its own minimum (blue) to its maximum (red) and overlaid on "
                f"the input, as in the paper's figures: the colours say where attention is highest within an image, "
                f"not how peaked it is (here each map's minimum is {_min_text(res.rollout_maps)} of its maximum)."
                + (f" The input has {cfg.in_chans} channels, shown as their grey mean." if cfg.in_chans not in (1, 3)
                   else ""),
                res.figures.get("rollout"),
            ))
        res.figures["attention"] = figures.plot_attention_maps(
            res.attention_maps, out / FIGURE_NAMES["attention"], image=disp[0],
            title=f"Raw attention of image 1 per layer and head ({'class-token row' if prefix else 'mean over queries'})",
        )
        sections.append(Section(
            "Raw attention per layer and head (image 1)",
            "Without rollout: the attention of the class token (or the mean over queries) to every patch, "
            "one tile per layer (rows) and head (columns), each tile scaled to its own maximum.",
            res.figures["attention"],
        ))
        bar.update()
    else:
        why = "no images (pass --images or --data, with -n above 0)"
        res.skipped.append(("Mean attention distance, attention rollout, raw attention", why))
        res.notes.append(f"attention distance and rollout: skipped, {why}")

    step(steps[-1])
    # What the numbers depend on, in one place: the caller's (data source, split, seed, -n) and this run's own.
    n_images = 0 if images is None else len(images)
    res.settings = {
        **(settings or {}),
        "num_images": n_images,
        "image_size": list(images.shape[-2:]) if have_images else list(cfg.image_size),
        "rollout_images": 0 if res.rollout_maps is None else len(res.rollout_maps),
        "head_fusion": head_fusion, "discard_ratio": discard_ratio, "cls": cls, "components": num_components,
    }
    _save_arrays(res, cfg, cls, head_fusion, discard_ratio)
    source = res.settings.get("data")
    summary = [
        f"model: {cfg.name} ({'hybrid ' if cfg.is_hybrid else ''}ViT, dim {cfg.dim}, depth {cfg.depth}, heads {cfg.heads}, "
        f"stride {cfg.stride} px, classifier {cfg.classifier}, image {cfg.image_size[0]}x{cfg.image_size[1]})",
        f"images: {n_images}" + (f" (data {source}, {res.settings.get('split')} split, seed {res.settings.get('seed')})"
                                 if source else ""),
        *summary_lines(res.summary),
        *res.notes,
    ]
    sections.append(Section("Settings", "What produced this report: the images' source and the analyses' options.",
                            table=[["setting", "value"], *_settings_rows(res, cfg)]))
    if res.skipped:
        sections.append(Section("Skipped analyses", "What this report leaves out, and why.",
                                table=[["analysis", "why skipped"], *[list(s) for s in res.skipped]]))
    res.report = write_report(out / "report.html", title, sections, summary)
    bar.update()
    bar.close()
    return res


# The report's names for the analysis options; inspect.json keeps the short keys. A bare "components 28" said
# neither what was counted nor that a small kernel (a grey 4x4 patch: 16 values) has fewer.
SETTING_LABELS = {
    "components": "embedding-filter principal components (--components)",
    "cls": "attention distance: class token (--cls)",
    "head_fusion": "rollout: head fusion (--head-fusion)",
    "discard_ratio": "rollout: discard ratio (--discard-ratio)",
    "rollout_images": "images with rollout overlays (--rollout-images)",
}


def _components_text(res: InspectResult, cfg) -> str:
    """How many principal components were asked for and shown, and why fewer when fewer."""
    asked = res.settings.get("components")
    if res.filter_pca is None:
        return f"{asked} asked, none shown: a hybrid has no pixel filters"
    k = len(res.filter_pca.components)
    if k >= asked:
        return f"{asked}: the top {k} principal components of the patch-embedding filters"
    c, ph, pw = res.filter_pca.components.shape[1:]
    d = cfg.dim
    why = (f"a {c}x{ph}x{pw} filter has only {c * ph * pw} values" if c * ph * pw <= d
           else f"there are only {d} filters")
    return f"{asked} asked, {k} shown: {why}"


def _settings_rows(res: InspectResult, cfg) -> list[list[str]]:
    """The Settings table: readable names for the analysis options, the rest as recorded."""
    rows = []
    for key, value in res.settings.items():
        text = _components_text(res, cfg) if key == "components" else _setting_text(value)
        if key == "cls" and not cfg.num_prefix_tokens:  # a GAP/MAP model: the option changes nothing
            text += " (no effect: the model has no class token)"
        rows.append([SETTING_LABELS.get(key, key), text])
    return rows


def _setting_text(value) -> str:
    """A setting as the report's table shows it: lists joined, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return f"{value[0]}x{value[1]}"  # an image size, height x width
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return str(value)


def _min_text(maps: np.ndarray) -> str:
    """The range of the rollout maps' minima (each map divided by its maximum), e.g. '0.39-0.68'."""
    lows = maps.reshape(len(maps), -1).min(1)
    lo, hi = float(lows.min()), float(lows.max())
    return f"{lo:.2f}" if round(lo, 2) == round(hi, 2) else f"{lo:.2f}-{hi:.2f}"


def _hybrid_filters_reason(cfg) -> str:
    """Why a hybrid has no pixel-space embedding filters, naming its CNN."""
    cnn = (f"a conv stem ({len(cfg.conv_stem)} stride-2 convolutions, {'/'.join(map(str, cfg.conv_stem))} channels)"
           if cfg.conv_stem else "a BiT ResNet")
    return (f"the model is a hybrid: its patch embedding ({cfg.patch_size}x{cfg.patch_size}) projects the feature "
            f"map of {cnn}, not pixels, so it has no pixel filters to show (Fig. 7 left is for plain ViTs)")


def _save_arrays(res: InspectResult, cfg, cls: str, head_fusion: str, discard_ratio: float) -> None:
    arrays = {}
    if res.filter_pca is not None:
        arrays["filter_components"] = res.filter_pca.components
        arrays["filter_explained_variance_ratio"] = res.filter_pca.explained_variance_ratio
    for name in ("posemb_similarity", "attention_distance", "attention_distance_per_image", "rollout_maps",
                 "attention_maps", "predictions"):
        value = getattr(res, name)
        if value is not None:
            arrays[name] = value
    np.savez_compressed(res.out_dir / "inspect.npz", **arrays)
    info = {
        "model": cfg.name,
        "stride": cfg.stride,
        "class_token": cfg.num_prefix_tokens == 1,
        "cls_mode": cls,
        "head_fusion": head_fusion,
        "discard_ratio": discard_ratio,
        "settings": res.settings,
        "figures": {k: v.name for k, v in res.figures.items()},
        "notes": res.notes,
        "summary": res.summary,
    }
    if res.attention_distance is not None:
        info["num_images"] = int(len(res.attention_distance_per_image))
        info["attention_distance_px"] = np.round(res.attention_distance, 4).tolist()
        info["attention_distance_layer_mean_px"] = np.round(res.attention_distance.mean(1), 4).tolist()
        info["image_width_px"] = int(res.image_width)
        info["uniform_attention_distance_px"] = round(uniform_attention_distance(res.grid, cfg.stride), 4)
    if res.filter_pca is not None:
        info["filter_explained_variance_ratio"] = np.round(res.filter_pca.explained_variance_ratio, 5).tolist()
    (res.out_dir / "inspect.json").write_text(json.dumps(info, indent=2))
