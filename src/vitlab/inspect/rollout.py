"""Attention rollout (Abnar & Zuidema 2020) and raw attention maps, as the ViT paper's Fig. 6 and 14.

Rollout models the residual connection as identity attention: per layer the heads are fused,
the identity is added and every ROW is renormalised to sum to one (each query's attention is a
probability distribution; normalising columns instead is the bug of a well-known script), and
the layers are multiplied, last layer on the left: R = A_L ... A_1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vitlab.errors import VitlabError

HEAD_FUSIONS = ("mean", "max", "min")


def _as_tensor(a: np.ndarray | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(a)
    return t.detach().to("cpu", torch.float64)


def _stack_layers(attentions: Sequence[np.ndarray | torch.Tensor]) -> torch.Tensor:
    """A list of per-layer (B, heads, N, N) or (heads, N, N) maps -> one (L, B, heads, N, N) tensor."""
    if len(attentions) == 0:
        raise VitlabError("no attention maps given; call the model with return_attention=True")
    layers = [_as_tensor(a) for a in attentions]
    layers = [a.unsqueeze(0) if a.dim() == 3 else a for a in layers]
    shape = layers[0].shape
    if len(shape) != 4 or shape[-1] != shape[-2] or any(a.shape != shape for a in layers):
        raise VitlabError(
            f"attention maps must all be (B, heads, N, N) or (heads, N, N); got {[tuple(a.shape) for a in layers][:3]}"
        )
    return torch.stack(layers)


def fuse_heads(attention: torch.Tensor, head_fusion: str = "mean") -> torch.Tensor:
    """(..., heads, N, N) -> (..., N, N) by the mean (the paper's choice), max or min over heads."""
    if head_fusion == "mean":
        return attention.mean(dim=-3)
    if head_fusion == "max":
        return attention.amax(dim=-3)
    if head_fusion == "min":
        return attention.amin(dim=-3)
    raise VitlabError(f"head fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}")


def _discard_lowest(fused: torch.Tensor, ratio: float, num_prefix_tokens: int) -> torch.Tensor:
    """Zero the lowest `ratio` fraction of each matrix's entries, per image, keeping the class->class entry."""
    if ratio <= 0.0:
        return fused
    if not 0.0 <= ratio < 1.0:
        raise VitlabError(f"discard ratio must be in [0, 1), got {ratio}")
    b, n, _ = fused.shape
    flat = fused.reshape(b, n * n).clone()
    k = int(n * n * ratio)
    if k == 0:
        return fused
    protected = flat[:, 0].clone() if num_prefix_tokens else None
    idx = flat.topk(k, dim=-1, largest=False).indices
    flat.scatter_(1, idx, 0.0)
    if protected is not None:
        flat[:, 0] = protected
    return flat.reshape(b, n, n)


def attention_rollout(
    attentions: Sequence[np.ndarray | torch.Tensor],
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    num_prefix_tokens: int = 1,
) -> np.ndarray:
    """Rolled-out attention R = A_L ... A_1 with A_l = rownorm(fuse(attn_l) + I).

    `attentions`: one (B, heads, N, N) (or (heads, N, N)) probability tensor per layer, first layer
    first. Returns R as (B, N, N) float64 (or (N, N) when the input had no batch axis); every row of
    R sums to one. `discard_ratio` zeroes the lowest fraction of each fused matrix (per image; the
    class->class entry is kept) before the identity is added.
    """
    unbatched = _as_tensor(attentions[0]).dim() == 3 if len(attentions) else False
    stacked = _stack_layers(attentions)  # (L, B, H, N, N)
    n = stacked.shape[-1]
    eye = torch.eye(n, dtype=stacked.dtype)
    rollout = eye.expand(stacked.shape[1], n, n).clone()
    for layer in stacked:
        fused = _discard_lowest(fuse_heads(layer, head_fusion), discard_ratio, num_prefix_tokens)
        aug = fused + eye
        aug = aug / aug.sum(dim=-1, keepdim=True)  # rows sum to one (keepdim: the axis that matters)
        rollout = aug @ rollout
    out = rollout.numpy()
    return out[0] if unbatched else out


def token_map(
    matrix: np.ndarray | torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    query_weights: np.ndarray | torch.Tensor | None = None,
) -> np.ndarray:
    """What the output attends to, on the patch grid: (..., N, N) -> (..., h, w).

    With a class token it is the class token's row over the patch columns, R[0, prefix:]. Without
    one (global average pooling) the output is the mean of all tokens, so it is the mean over the
    query rows, R.mean(rows)[patches]. `query_weights` (..., N), e.g. a MAP head's probe attention,
    weights the rows instead: the output is that mix of the tokens, so the map is weights @ R.
    """
    m = _as_tensor(matrix)
    h, w = grid
    n = m.shape[-1]
    if n != num_prefix_tokens + h * w:
        raise VitlabError(
            f"attention over {n} tokens does not match a {h}x{w} grid with {num_prefix_tokens} prefix token(s)"
        )
    if query_weights is not None:
        row = (_as_tensor(query_weights).unsqueeze(-2) @ m).squeeze(-2)[..., num_prefix_tokens:]
    elif num_prefix_tokens:
        row = m[..., 0, num_prefix_tokens:]
    else:
        row = m.mean(dim=-2)
    return row.reshape(*row.shape[:-1], h, w).numpy()


def rollout_maps(
    attentions: Sequence[np.ndarray | torch.Tensor],
    grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    query_weights: np.ndarray | torch.Tensor | None = None,
) -> np.ndarray:
    """Per image, the rollout map on the patch grid (B, h, w), divided by its maximum (the paper's display);
    `query_weights` (B, N) as in `token_map`."""
    r = attention_rollout(attentions, head_fusion, discard_ratio, num_prefix_tokens)
    maps = token_map(r, grid, num_prefix_tokens, query_weights)
    peak = maps.reshape(*maps.shape[:-2], -1).max(axis=-1)[..., None, None]
    return maps / np.where(peak > 0, peak, 1.0)


def probe_weights(probe_attention: torch.Tensor, head_fusion: str = "mean") -> torch.Tensor:
    """A MAP probe's attention (B, heads, N) -> (B, N): heads fused as the layers' are, rows summing to one."""
    fused = fuse_heads(_as_tensor(probe_attention).unsqueeze(-2), head_fusion).squeeze(-2)
    return fused / fused.sum(dim=-1, keepdim=True)


def attention_maps(
    attentions: Sequence[np.ndarray | torch.Tensor],
    grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    index: int = 0,
) -> np.ndarray:
    """Raw attention of one image, per layer and head, on the patch grid: (L, heads, h, w).

    Class token's row (or the mean over queries for models without one), without rollout.
    """
    stacked = _stack_layers(attentions)  # (L, B, H, N, N)
    if not 0 <= index < stacked.shape[1]:
        raise VitlabError(f"image index {index} out of range for a batch of {stacked.shape[1]}")
    return token_map(stacked[:, index], grid, num_prefix_tokens)
