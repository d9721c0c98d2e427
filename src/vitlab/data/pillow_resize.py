"""Pillow's own resize on torch batches, for the filters torch has no counterpart of: nearest, box, hamming, lanczos.

timm's evaluation and Hugging Face's processors resize a photo with `PIL.Image.resize`. For bilinear and bicubic
torch's anti-aliased `interpolate` is the same filter (`preprocess.resize_batch`, within a grey level). For the
other four it is not: torch's `nearest` takes pixel floor(i * scale) where Pillow takes the one under the output
pixel's centre, its `area` averages other windows than Pillow's box, and it has no Hamming or Lanczos window. Those
are resized here by Pillow itself, channel by channel, so a model whose preprocessing names one gets the pixels
its own library gives it on the same machine. (A copy of Pillow's arithmetic would drift between releases: Pillow
13.0.0 runs its two passes vertical-first on some shapes and horizontal-first on others, where 12's source always
ran horizontal first; a copy in torch matched one order or the other, not both.)
"""

from __future__ import annotations

import numpy as np
import torch

# vitlab's names -> PIL.Image.Resampling codes (the numbers Hugging Face processors store as `resample`)
PILLOW_FILTERS = {"nearest": 0, "lanczos": 1, "box": 4, "hamming": 5}


def _resize_plane(plane: np.ndarray, size: tuple[int, int], code: int, eight_bit: bool) -> np.ndarray:
    """One channel (H, W) through `Image.resize`: as an 8-bit image ("L") where the values are 8-bit pixels, as
    a float image ("F", Pillow's float arithmetic) otherwise."""
    from PIL import Image

    image = Image.fromarray(plane.astype(np.uint8)) if eight_bit else Image.fromarray(plane.astype(np.float32), "F")
    return np.asarray(image.resize((size[1], size[0]), code), dtype=np.float32)


def pillow_resize(x: torch.Tensor, size: tuple[int, int], name: str) -> torch.Tensor:
    """Resize a batch (B, C, H, W) of 0..255 values to `size` (h, w) as `PIL.Image.resize` does with the filter
    `name` (`PILLOW_FILTERS`); the result has x's dtype and device. A whole RGB image and its three channels one
    by one come out of Pillow the same (its passes treat bands alike), so any channel count works."""
    if name not in PILLOW_FILTERS:
        raise ValueError(f"filter must be one of {tuple(PILLOW_FILTERS)}, got {name!r}")
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    planes = x.detach().to("cpu", torch.float32).numpy()
    # every photo is 8-bit: Pillow's 8-bit arithmetic then, as on the peers' side; other values (a float batch
    # already resized once) take its float arithmetic
    eight_bit = bool(((planes >= 0) & (planes <= 255) & (planes == np.round(planes))).all())
    out = np.stack([np.stack([_resize_plane(p, size, PILLOW_FILTERS[name], eight_bit) for p in image])
                    for image in planes.reshape(-1, *planes.shape[-3:])])
    return torch.from_numpy(out).reshape(*x.shape[:-2], *size).to(x.device, x.dtype)
