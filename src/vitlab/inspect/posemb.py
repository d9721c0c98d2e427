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
