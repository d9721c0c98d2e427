"""Position-embedding similarity (ViT paper Fig. 7 centre, Fig. 10).

For every patch (r, c), the cosine similarity of its position embedding with those of all
patches, as an h x w tile; tiles are placed on the patch grid. The class-token slot is excluded.
"""

from __future__ import annotations

import numpy as np
import torch

from vitlab.errors import VitlabError


def posemb_similarity(
    pos_embed: np.ndarray | torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int = 1,
) -> np.ndarray:
    """Cosine similarities (h, w, h, w): [r, c] is the tile of patch (r, c) against every patch."""
    e = torch.as_tensor(pos_embed).detach().to("cpu", torch.float64)
    if e.dim() == 3:
        e = e[0]
    h, w = grid
    if e.dim() != 2 or e.shape[0] != num_prefix_tokens + h * w:
        raise VitlabError(
            f"position embedding of shape {tuple(e.shape)} does not match a {h}x{w} grid "
            f"with {num_prefix_tokens} prefix token(s)"
        )
    e = e[num_prefix_tokens:]
    norms = e.norm(dim=-1, keepdim=True)
    unit = e / norms.clamp_min(1e-12)
    sim = (unit @ unit.T).clamp(-1.0, 1.0)
    return sim.reshape(h, w, h, w).numpy()


def similarity_mosaic(sim: np.ndarray, gap: int = 1) -> np.ndarray:
    """(h, w, h, w) tiles -> one 2D image with the tiles on the grid, separated by `gap` NaN pixels."""
    h, w, th, tw = sim.shape
    out = np.full((h * (th + gap) - gap, w * (tw + gap) - gap), np.nan)
    for r in range(h):
        for c in range(w):
            out[r * (th + gap): r * (th + gap) + th, c * (tw + gap): c * (tw + gap) + tw] = sim[r, c]
    return out


def similarity_limits(sim: np.ndarray, lo_pct: float = 1.0, hi_pct: float = 99.0) -> tuple[float, float]:
    """The colour limits of one similarity figure: robust min..max (percentiles) of the off-diagonal values.

    A fixed -1..1 scale paints a 2-D sin-cos table, whose similarities all lie near 1, one uniform colour;
    scaling each figure to its own off-diagonal range (self-similarity, always 1, excluded) keeps the
    structure visible for fixed and learned embeddings alike.
    """
    h, w = sim.shape[:2]
    flat = np.asarray(sim, np.float64).reshape(h * w, h * w)
    off = flat[~np.eye(h * w, dtype=bool)]
    off = off[np.isfinite(off)]
    if off.size == 0:
        return -1.0, 1.0
    lo, hi = (float(v) for v in np.percentile(off, [lo_pct, hi_pct]))
    if hi - lo < 1e-6:  # all equal: a small band around the value
        lo, hi = lo - 0.05, hi + 0.05
    return max(lo, -1.0), min(hi, 1.0)


def scale_text(sim: np.ndarray) -> str:
    """The colour scale of `similarity_limits` in words, for titles and captions."""
    lo, hi = similarity_limits(sim)
    return f"{lo:.2f}..{hi:.2f}, the 1st..99th percentile of the off-diagonal similarities"
