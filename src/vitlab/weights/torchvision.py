"""torchvision `vit_*` state dicts -> vitlab (1:1 renames; torchvision's in_proj is timm's fused qkv).

torchvision ViTs use exact GELU and LayerNorm eps 1e-6; their published weights expect ImageNet
mean/std with a 256 -> 224 bilinear resize and centre crop.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from vitlab.errors import VitlabError
from vitlab.models.config import ViTConfig

_LAYER = {
    "ln_1": "norm1", "ln_2": "norm2",
    "self_attention.in_proj_weight": "attn.qkv.weight", "self_attention.in_proj_bias": "attn.qkv.bias",
    "self_attention.out_proj": "attn.proj",
    "mlp.0": "mlp.fc1", "mlp.3": "mlp.fc2",
    "mlp.linear_1": "mlp.fc1", "mlp.linear_2": "mlp.fc2",  # before torchvision PR #6053
}
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def is_torchvision(sd: dict[str, torch.Tensor]) -> bool:
    return "conv_proj.weight" in sd and "encoder.pos_embedding" in sd


def read_torchvision(sd: dict[str, torch.Tensor], **overrides: Any) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, vitlab state dict, meta) of a torchvision VisionTransformer state dict."""
    if any(k.startswith("conv_proj.conv_") or k.startswith("conv_proj.bn_") for k in sd):
        raise VitlabError("torchvision conv-stem ViTs (conv_stem_configs) are not supported")
    out: dict[str, torch.Tensor] = {}
    left = []
    for k, v in sd.items():
        if k == "class_token":
            out["cls_token"] = v
        elif k == "encoder.pos_embedding":
            out["pos_embed"] = v
        elif k.startswith("conv_proj."):
            out["patch_embed.proj." + k[len("conv_proj."):]] = v
        elif k.startswith("encoder.ln."):
            out["norm." + k[len("encoder.ln."):]] = v
        elif k.startswith("heads.head."):
            out["head." + k[len("heads.head."):]] = v
        elif k.startswith("heads.pre_logits."):
            out["pre_logits.fc." + k[len("heads.pre_logits."):]] = v
        elif m := re.match(r"encoder\.layers\.encoder_layer_(\d+)\.(.+)$", k):
            i, rest = m.group(1), m.group(2)
            for src, dst in _LAYER.items():
                if rest == src or rest.startswith(src + "."):
                    out[f"blocks.{i}.{dst}{rest[len(src):]}"] = v
                    break
            else:
                left.append(k)
        else:
            left.append(k)
    if left:
        raise VitlabError(f"torchvision state dict has keys vitlab cannot place: {', '.join(left[:3])}")
    w = out["patch_embed.proj.weight"]
    dim, in_chans, patch, _ = w.shape
    depth = 1 + max(int(m.group(1)) for k in out if (m := re.match(r"blocks\.(\d+)\.", k)))
    n = out["pos_embed"].shape[1] - 1
    side = int(round(n**0.5))
    if side * side != n:
        raise VitlabError(f"position embedding with {n} patch slots is not a square grid; pass image_size=(H, W)")
    from vitlab.weights.timm import guess_heads

    config = dict(
        name="torchvision-vit", image_size=side * patch, patch_size=patch, in_chans=in_chans, dim=dim, depth=depth,
        heads=overrides.pop("heads", None) or guess_heads(dim), mlp_dim=out["blocks.0.mlp.fc1.weight"].shape[0],
        classifier="token", num_classes=out["head.weight"].shape[0] if "head.weight" in out else 0,
        representation_size=out["pre_logits.fc.weight"].shape[0] if "pre_logits.fc.weight" in out else None,
        gelu="exact", layer_norm_eps=1e-6, posemb_resample="bicubic",
    )
    config.update(overrides)
    config = ViTConfig(**config)
    c = config.in_chans
    h, _w = config.image_size
    pre = {"image_size": list(config.image_size), "mean": IMAGENET_MEAN if c == 3 else [0.449],
           "std": IMAGENET_STD if c == 3 else [0.226], "resize": round(h * 256 / 224), "crop_fraction": 1.0,
           "interpolation": "bilinear", "channels": c}
    return config, out, {"format": "torchvision", "class_names": None, "preprocess": pre}
