"""Mean attention distance (ViT paper Fig. 7 right, Fig. 11): how far, in pixels, each head looks.

d(l, h) = mean over images and query patches of sum_k A_lh[q, k] * ||p_q - p_k|| * stride,
with p the (row, col) of a patch on the token grid; the analogue of a CNN's receptive field size.

The class token has no position. Default `cls="exclude"`: drop its row and column and renormalise
each remaining row over the patch keys (the distance among patches only). `cls="zero"`: drop its
row, keep the attention sent to it as distance 0 without renormalising (Raghu et al. 2021 and the
probing-vits notebooks), which gives smaller numbers when heads attend to the class token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vitlab.errors import VitlabError

CLS_MODES = ("exclude", "zero")


def patch_distances(grid: tuple[int, int], stride: float = 1.0) -> np.ndarray:
    """(h*w, h*w) Euclidean distances between patch centres in pixels (grid distance x stride), row-major."""
    h, w = grid
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    pos = np.stack([rows.ravel(), cols.ravel()], axis=1).astype(np.float64)
    diff = pos[:, None, :] - pos[None, :, :]
    return np.sqrt((diff**2).sum(-1)) * float(stride)


def attention_distance(
    attentions: Sequence[np.ndarray | torch.Tensor],
    grid: tuple[int, int],
    stride: float,
    num_prefix_tokens: int = 1,
    cls: str = "exclude",
) -> np.ndarray:
    """Per image, layer and head, the attention-weighted query-key distance averaged over queries: (B, L, heads)."""
    if cls not in CLS_MODES:
        raise VitlabError(f"class-token mode must be one of {CLS_MODES}, got {cls!r}")
    if len(attentions) == 0:
        raise VitlabError("no attention maps given; call the model with return_attention=True")
    h, w = grid
    p = num_prefix_tokens
    dist = torch.from_numpy(patch_distances(grid, stride))
    out = []
    for a in attentions:
        a = torch.as_tensor(a).detach().to(torch.float64)  # on the attention's device (GPU stays GPU)
        if a.dim() == 3:
            a = a.unsqueeze(0)
        if a.dim() != 4 or a.shape[-1] != p + h * w or a.shape[-2] != p + h * w:
            raise VitlabError(
                f"attention of shape {tuple(a.shape)} does not match a {h}x{w} grid with {p} prefix token(s)"
            )
        patches = a[..., p:, p:]  # queries and keys that are patches
        weighted = (patches * dist.to(a.device)).sum(-1)
        if cls == "exclude":
            mass = patches.sum(-1)
            weighted = weighted / mass.clamp_min(torch.finfo(mass.dtype).tiny)
        out.append(weighted.mean(-1))  # mean over query patches -> (B, heads)
    return torch.stack(out, dim=1).cpu().numpy()


def mean_attention_distance(
    attentions: Sequence[np.ndarray | torch.Tensor],
    grid: tuple[int, int],
    stride: float,
    num_prefix_tokens: int = 1,
    cls: str = "exclude",
) -> np.ndarray:
    """(L, heads) mean attention distance in pixels, averaged over the images of the batch."""
    return attention_distance(attentions, grid, stride, num_prefix_tokens, cls).mean(0)


def uniform_attention_distance(grid: tuple[int, int], stride: float = 1.0) -> float:
    """Closed form for uniform attention over all patches: the mean distance over all ordered patch pairs."""
    return float(patch_distances(grid, stride).mean())
