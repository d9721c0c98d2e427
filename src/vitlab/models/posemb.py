"""Position embeddings: resampling a learned grid to another grid, and fixed 2D sin-cos tables."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vitlab.errors import VitlabError


def resample_grid(
    grid: torch.Tensor, new_size: tuple[int, int], mode: str = "bilinear_ac"
) -> torch.Tensor:
    """Resample a (1, H*W, D) or (H, W, D) grid of embeddings given as (1, H, W, D) to `new_size`.

    mode "bilinear_ac" (default) is the official algorithm: scipy.ndimage.zoom(order=1) equals
    bilinear interpolation with align_corners=True. "bilinear" and "bicubic" use
    align_corners=False (Hugging Face: bicubic); "bicubic_aa" adds antialiasing (timm's default);
    "bicubic_ac" is bicubic with align_corners=True (torchvision's `interpolate_embeddings`).
    """
    if grid.dim() != 4:
        raise ValueError("grid must have shape (1, H, W, D)")
    if tuple(grid.shape[1:3]) == tuple(new_size):
        return grid
    x = grid.permute(0, 3, 1, 2).float()
    if mode == "bilinear_ac":
        x = F.interpolate(x, size=new_size, mode="bilinear", align_corners=True)
    elif mode == "bilinear":
        x = F.interpolate(x, size=new_size, mode="bilinear", align_corners=False)
    elif mode == "bicubic":
        x = F.interpolate(x, size=new_size, mode="bicubic", align_corners=False)
    elif mode == "bicubic_aa":
        x = F.interpolate(x, size=new_size, mode="bicubic", align_corners=False, antialias=True)
    elif mode == "bicubic_ac":
        x = F.interpolate(x, size=new_size, mode="bicubic", align_corners=True)
    else:
        raise VitlabError(f"unknown position-embedding resample mode {mode!r}")
    return x.permute(0, 2, 3, 1).to(grid.dtype)


def resample_posemb(
    posemb: torch.Tensor,
    new_grid: tuple[int, int],
    old_grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
    mode: str = "bilinear_ac",
) -> torch.Tensor:
    """Resample a (1, prefix + H*W, D) position embedding to a new grid, keeping the prefix slots.

    Without `old_grid` the stored grid is assumed square, as in the official code.
    """
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    n = grid.shape[1]
    if old_grid is None:
        side = int(round(n**0.5))
        if side * side != n:
            raise VitlabError(
                f"cannot infer the grid of a position embedding with {n} patch slots; pass old_grid"
            )
        old_grid = (side, side)
    if old_grid[0] * old_grid[1] != n:
        raise VitlabError(f"position embedding has {n} patch slots, not {old_grid[0]}x{old_grid[1]}")
    if tuple(old_grid) == tuple(new_grid):
        return posemb
    grid = grid.reshape(1, old_grid[0], old_grid[1], -1)
    grid = resample_grid(grid, tuple(new_grid), mode).reshape(1, new_grid[0] * new_grid[1], -1)
    return torch.cat([prefix, grid], dim=1)


def sincos_2d(grid: tuple[int, int], dim: int, temperature: float = 10_000.0) -> torch.Tensor:
    """Fixed 2D sin-cos position embedding (1, H*W, dim), as big_vision's `posemb_sincos_2d`."""
    if dim % 4:
        raise VitlabError(f"sincos2d position embeddings need dim divisible by 4, got {dim}")
    h, w = grid
    y, x = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    omega = torch.arange(dim // 4, dtype=torch.float64) / (dim // 4 - 1 if dim > 4 else 1)
    omega = 1.0 / temperature**omega
    y = y.flatten()[:, None] * omega[None, :]
    x = x.flatten()[:, None] * omega[None, :]
    pe = torch.cat([torch.sin(x), torch.cos(x), torch.sin(y), torch.cos(y)], dim=1)
    return pe[None].float()
