"""Numerics audit: how each source resamples position embeddings to another grid, written out here from the
sources (no peer library needed).

- official / big_vision: scipy.ndimage.zoom(order=1) = bilinear, align_corners=True (tests/test_model_official.py
  checks it against the Flax fixtures);
- timm: `resample_abs_pos_embed`, bicubic with antialias, align_corners=False;
- Hugging Face: `interpolate_pos_encoding`, bicubic, align_corners=False;
- torchvision: `vision_transformer.interpolate_embeddings`, bicubic with **align_corners=True**. vitlab read
  torchvision files with align_corners=False: 6.7e-3 relative on the logits of a 32 -> 48 px resize against
  torchvision's own `interpolate_embeddings` (torch 2.14.1, torchvision 0.29.1, by hand).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vitlab
from vitlab.models.posemb import resample_posemb


def _torchvision_vit_state_dict(dim=64, depth=1, mlp=128, patch=8, size=32, classes=5, seed=0):
    """A torchvision `VisionTransformer` state dict (its key names), random values."""
    g = torch.Generator().manual_seed(seed)
    n = (size // patch) ** 2 + 1
    sd = {"class_token": torch.randn(1, 1, dim, generator=g), "encoder.pos_embedding": torch.randn(1, n, dim, generator=g),
          "conv_proj.weight": torch.randn(dim, 3, patch, patch, generator=g) * 0.05, "conv_proj.bias": torch.zeros(dim),
          "encoder.ln.weight": torch.ones(dim), "encoder.ln.bias": torch.zeros(dim),
          "heads.head.weight": torch.randn(classes, dim, generator=g) * 0.1, "heads.head.bias": torch.zeros(classes)}
    for i in range(depth):
        p = f"encoder.layers.encoder_layer_{i}."
        sd.update({p + "ln_1.weight": torch.ones(dim), p + "ln_1.bias": torch.zeros(dim),
                   p + "self_attention.in_proj_weight": torch.randn(3 * dim, dim, generator=g) * 0.05,
                   p + "self_attention.in_proj_bias": torch.zeros(3 * dim),
                   p + "self_attention.out_proj.weight": torch.randn(dim, dim, generator=g) * 0.05,
                   p + "self_attention.out_proj.bias": torch.zeros(dim),
                   p + "ln_2.weight": torch.ones(dim), p + "ln_2.bias": torch.zeros(dim),
                   p + "mlp.0.weight": torch.randn(mlp, dim, generator=g) * 0.05, p + "mlp.0.bias": torch.zeros(mlp),
                   p + "mlp.3.weight": torch.randn(dim, mlp, generator=g) * 0.05, p + "mlp.3.bias": torch.zeros(dim)})
    return sd


def _interpolate_embeddings(pos: torch.Tensor, new_side: int) -> torch.Tensor:
    """torchvision.models.vision_transformer.interpolate_embeddings (interpolation_mode='bicubic')."""
    token, img = pos[:, :1], pos[:, 1:]
    side = int(math.sqrt(img.shape[1]))
    img = img.permute(0, 2, 1).reshape(1, pos.shape[2], side, side)
    img = F.interpolate(img, size=new_side, mode="bicubic", align_corners=True)
    return torch.cat([token, img.reshape(1, pos.shape[2], new_side * new_side).permute(0, 2, 1)], dim=1)


def test_torchvision_vit_resamples_as_torchvisions_interpolate_embeddings(tmp_path):
    sd = _torchvision_vit_state_dict()
    torch.save(sd, tmp_path / "tv.pth")
    want = _interpolate_embeddings(sd["encoder.pos_embedding"], 6)
    model = vitlab.load(tmp_path / "tv.pth", heads=4, image_size=48)
    torch.testing.assert_close(model.pos_embed.detach(), want, rtol=1e-5, atol=1e-6)
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():  # the resize on the fly (a 32-px model given 48-px images) is the same one
        torch.testing.assert_close(vitlab.load(tmp_path / "tv.pth", heads=4)(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode, kwargs", [
    ("bilinear_ac", dict(mode="bilinear", align_corners=True)),
    ("bilinear", dict(mode="bilinear", align_corners=False)),
    ("bicubic", dict(mode="bicubic", align_corners=False)),
    ("bicubic_aa", dict(mode="bicubic", align_corners=False, antialias=True)),
    ("bicubic_ac", dict(mode="bicubic", align_corners=True)),
])
def test_every_resample_mode_is_the_interpolation_it_names(mode, kwargs):
    pos = torch.randn(1, 1 + 4 * 5, 8)
    grid = pos[:, 1:].reshape(1, 4, 5, 8).permute(0, 3, 1, 2)
    want = F.interpolate(grid, size=(3, 7), **kwargs).permute(0, 2, 3, 1).reshape(1, 21, 8)
    got = resample_posemb(pos, (3, 7), (4, 5), 1, mode)
    torch.testing.assert_close(got, torch.cat([pos[:, :1], want], dim=1))


# torchvision's published ViT weights and their eval transforms (torchvision 0.29.1, `Weights.transforms()`):
#   224 px: IMAGENET1K_V1 = shorter side 256 (ViT-L/16: 242), crop 224, bilinear; SWAG_LINEAR_V1 = 224, bicubic
#   (the same file shape as V1: V1's is kept); above 224 only SWAG_E2E_V1 exists: shorter side = crop
#   (384 / 512 / 518), bicubic. All ImageNet mean/std.
def _meta_vit(dim, depth, patch, size):
    """A torchvision ViT state dict on the meta device (shapes only: read_torchvision builds no model)."""
    mlp, grid = 4 * dim, size // patch
    sd = {"class_token": (1, 1, dim), "encoder.pos_embedding": (1, grid * grid + 1, dim),
          "conv_proj.weight": (dim, 3, patch, patch), "conv_proj.bias": (dim,), "encoder.ln.weight": (dim,),
          "encoder.ln.bias": (dim,), "heads.head.weight": (1000, dim), "heads.head.bias": (1000,)}
    for i in range(depth):
        p = f"encoder.layers.encoder_layer_{i}."
        sd.update({p + "ln_1.weight": (dim,), p + "ln_1.bias": (dim,), p + "self_attention.in_proj_weight": (3 * dim, dim),
                   p + "self_attention.in_proj_bias": (3 * dim,), p + "self_attention.out_proj.weight": (dim, dim),
                   p + "self_attention.out_proj.bias": (dim,), p + "ln_2.weight": (dim,), p + "ln_2.bias": (dim,),
                   p + "mlp.0.weight": (mlp, dim), p + "mlp.0.bias": (mlp,), p + "mlp.3.weight": (dim, mlp),
                   p + "mlp.3.bias": (dim,)})
    return {k: torch.empty(s, device="meta") for k, s in sd.items()}


@pytest.mark.parametrize("dim, depth, patch, size, resize, interpolation", [
    (768, 12, 16, 224, 256, "bilinear"),   # vit_b_16 IMAGENET1K_V1
    (768, 12, 32, 224, 256, "bilinear"),   # vit_b_32 IMAGENET1K_V1
    (1024, 24, 16, 224, 242, "bilinear"),  # vit_l_16 IMAGENET1K_V1: resize_size=242
    (768, 12, 16, 384, 384, "bicubic"),    # vit_b_16 IMAGENET1K_SWAG_E2E_V1
    (1024, 24, 16, 512, 512, "bicubic"),   # vit_l_16 IMAGENET1K_SWAG_E2E_V1
    (1280, 32, 14, 518, 518, "bicubic"),   # vit_h_14 IMAGENET1K_SWAG_E2E_V1
])
def test_torchvision_vit_preprocessing_is_its_weights_transform(dim, depth, patch, size, resize, interpolation):
    from vitlab.weights.torchvision import read_torchvision

    config, _, meta = read_torchvision(_meta_vit(dim, depth, patch, size))
    pre = meta["preprocess"]
    assert config.image_size == (size, size) and pre["image_size"] == [size, size]
    assert (pre["resize"], pre["interpolation"]) == (resize, interpolation)
    assert pre["mean"] == [0.485, 0.456, 0.406] and pre["std"] == [0.229, 0.224, 0.225]
