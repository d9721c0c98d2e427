"""Numbers that say whether a model shows the paper's Fig. 7 findings, next to the figures themselves.

The paper reads its figures qualitatively; these statistics make the same reading checkable and
comparable between models (docs/inspect.md, "Reading the summary"):

- filters: do the leading principal components look like smooth basis functions? Share of their energy
  at low spatial frequencies (2-D DCT), against a random kernel of the same shape (the untrained baseline).
- position embeddings: are nearby patches more similar, and is there row/column structure? Mean cosine
  similarity by relation on the grid and its correlation with grid distance.
- attention distance: are some heads local in the lowest layers, and does distance grow with depth?
"""

from __future__ import annotations

import numpy as np

from vitlab.inspect.filters import FilterPCA, embedding_filter_pca

# A head counts as "local" when its mean distance is below this fraction of uniform attention's.
LOCAL_FRACTION = 0.5


def _dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II basis (n, n): row u is the frequency-u cosine (numpy only; scipy is not a dependency)."""
    k = np.arange(n)
    m = np.cos(np.pi * (2 * k[None, :] + 1) * k[:, None] / (2 * n)) * np.sqrt(2.0 / n)
    m[0] /= np.sqrt(2.0)
    return m


def low_frequency_share(components: np.ndarray) -> float:
    """Mean share of each (C, P, P) component's energy at 2-D DCT frequencies u + v < P / 2."""
    _, _, ph, pw = components.shape
    coeff = np.einsum("up,kcpq,vq->kcuv", _dct_matrix(ph), components, _dct_matrix(pw))
    energy = (coeff**2).sum(1)  # over channels -> (k, P, P)
    u, v = np.meshgrid(np.arange(ph), np.arange(pw), indexing="ij")
    low = (u / ph + v / pw) < 0.5
    share = energy[:, low].sum(1) / np.maximum(energy.sum((1, 2)), 1e-30)
    return float(share.mean())


def filter_summary(pca: FilterPCA, weight_shape: tuple[int, ...], top: int = 8, seed: int = 0) -> dict:
    """Low-frequency share and explained variance of the top components, and the same for a random kernel."""
    rng = np.random.default_rng(seed)
    random_pca = embedding_filter_pca(rng.standard_normal(weight_shape), len(pca.components))
    top = min(top, len(pca.components))
    return {
        "top_components": top,
        "low_frequency_share": round(low_frequency_share(pca.components[:top]), 4),
        "low_frequency_share_random_kernel": round(low_frequency_share(random_pca.components[:top]), 4),
        "explained_variance_top5": round(float(pca.explained_variance_ratio[:5].sum()), 4),
        "explained_variance_top5_random_kernel": round(float(random_pca.explained_variance_ratio[:5].sum()), 4),
    }


def posemb_summary(sim: np.ndarray) -> dict:
    """Mean cosine similarity by relation on the (h, w, h, w) grid, and its correlation with grid distance."""
    h, w = sim.shape[:2]
    pos = np.array([(r, c) for r in range(h) for c in range(w)])
    s = sim.reshape(h * w, h * w)
    dist = np.hypot(*(pos[:, None] - pos[None]).transpose(2, 0, 1))
    other = dist > 0
    same_row = (pos[:, None, 0] == pos[None, :, 0]) & other
    same_col = (pos[:, None, 1] == pos[None, :, 1]) & other

    def mean(mask: np.ndarray) -> float | None:
        return round(float(s[mask].mean()), 4) if mask.any() else None

    return {
        "neighbours": mean(dist == 1),
        "diagonal_neighbours": mean(np.isclose(dist, np.sqrt(2))),
        "same_row": mean(same_row),
        "same_column": mean(same_col),
        "neither_row_nor_column": mean(other & ~same_row & ~same_col),
        # negative when closer patches have more similar embeddings
        "correlation_with_distance": round(float(np.corrcoef(s[other], dist[other])[0, 1]), 4)
        if other.sum() > 1 and s[other].std() > 0 else None,
    }


def distance_summary(distance: np.ndarray, uniform: float, width: int) -> dict:
    """Per-layer spread of the (layers, heads) mean attention distance, local heads and the trend with depth."""
    layers = np.arange(1, len(distance) + 1)
    layer_mean = distance.mean(1)
    slope = float(np.polyfit(layers, layer_mean, 1)[0]) if len(layers) > 1 else 0.0
    local = distance < LOCAL_FRACTION * uniform
    return {
        "image_width_px": int(width),
        "uniform_px": round(float(uniform), 4),
        "layer_min_px": np.round(distance.min(1), 3).tolist(),
        "layer_mean_px": np.round(layer_mean, 3).tolist(),
        "layer_max_px": np.round(distance.max(1), 3).tolist(),
        "local_heads_per_layer": local.sum(1).astype(int).tolist(),
        "local_threshold_px": round(LOCAL_FRACTION * float(uniform), 4),
        "slope_px_per_layer": round(slope, 4),
    }


def summary_lines(summary: dict) -> list[str]:
    """The summary as short sentences for the HTML report and the terminal."""
    out = []
    if f := summary.get("filters"):
        out.append(
            f"filters: top {f['top_components']} components hold {100 * f['low_frequency_share']:.0f}% of their "
            f"energy at low frequencies (random kernel {100 * f['low_frequency_share_random_kernel']:.0f}%); "
            f"top 5 explain {100 * f['explained_variance_top5']:.1f}% "
            f"(random {100 * f['explained_variance_top5_random_kernel']:.1f}%)")
    if p := summary.get("posemb"):
        out.append(
            f"position embeddings: mean cosine similarity {p['neighbours']} for direct neighbours, "
            f"{p['same_row']} same row, {p['same_column']} same column, {p['neither_row_nor_column']} neither; "
            f"correlation with grid distance {p['correlation_with_distance']}")
    if d := summary.get("distance"):
        out.append(
            f"attention distance: layer 1 heads {d['layer_min_px'][0]}-{d['layer_max_px'][0]} px, last layer "
            f"{d['layer_min_px'][-1]}-{d['layer_max_px'][-1]} px (uniform {d['uniform_px']:.1f} px); local heads "
            f"(< {d['local_threshold_px']:.1f} px) per layer {d['local_heads_per_layer']}; "
            f"trend {d['slope_px_per_layer']:+} px per layer")
    return out
