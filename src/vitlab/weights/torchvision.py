"""torchvision state dicts -> vitlab: `vit_*` (1:1 renames; torchvision's in_proj is timm's fused qkv)
and `resnet*` (identical keys: vitlab's StandardResNet uses torchvision's names, as timm's `resnet*` do).

torchvision ViTs use exact GELU and LayerNorm eps 1e-6; their published weights (ViT and ResNet V1)
expect ImageNet mean/std with a 256 -> 224 bilinear resize and centre crop (ViT-L/16 242 -> 224; the SWAG ViTs
at 384/512/518 px resize the shorter side to the crop size, bicubic).
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


def read_torchvision(sd: dict[str, torch.Tensor], size_hint: Any = None,
                     **overrides: Any) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, vitlab state dict, meta) of a torchvision VisionTransformer state dict.

    torchvision ViTs always pool the class token; `heads=` is needed for widths outside the published ones,
    `image_size=(H, W)` (or `size_hint`, see `timm.file_image_size`) for a non-square grid.
    """
    from vitlab.weights.timm import check_override_fields, file_image_size, guess_heads

    check_override_fields(overrides)
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
    image_size, _ = file_image_size(out["pos_embed"], True, patch, overrides.pop("image_size", None), size_hint,
                                    allow_no_class_slot=False)
    if overrides.get("classifier", "token") != "token":
        raise VitlabError(f"torchvision ViTs pool the class token; classifier={overrides['classifier']!r} cannot apply")
    config = dict(
        name="torchvision-vit", image_size=image_size, patch_size=patch, in_chans=in_chans, dim=dim, depth=depth,
        heads=overrides.pop("heads", None) or guess_heads(dim), mlp_dim=out["blocks.0.mlp.fc1.weight"].shape[0],
        classifier="token", num_classes=out["head.weight"].shape[0] if "head.weight" in out else 0,
        representation_size=out["pre_logits.fc.weight"].shape[0] if "pre_logits.fc.weight" in out else None,
        # torchvision's interpolate_embeddings: bicubic with align_corners=True (align_corners=False, read before,
        # moved the logits of a 32 -> 48 px resize by 6.7e-3 relative)
        gelu="exact", layer_norm_eps=1e-6, posemb_resample="bicubic_ac",
    )
    config.update(overrides)
    config = ViTConfig(**config)
    c = config.in_chans
    resize, interpolation = _vit_eval_transform(config)
    pre = {"image_size": list(config.image_size), "mean": IMAGENET_MEAN if c == 3 else [0.449],
           "std": IMAGENET_STD if c == 3 else [0.226], "resize": resize, "crop_fraction": 1.0,
           "interpolation": interpolation, "channels": c}
    return config, out, {"format": "torchvision", "class_names": None, "preprocess": pre}


def _vit_eval_transform(config: ViTConfig) -> tuple[int, str]:
    """(shorter side before the centre crop, interpolation) of torchvision's published ViT weights
    (`ViT_*_Weights.*.transforms()`, torchvision 0.29): at 224 px IMAGENET1K_V1, 256 -> 224 bilinear (ViT-L/16:
    242); above 224 only the SWAG_E2E_V1 weights exist (384, 512, 518 px), which resize the shorter side to the
    crop size, bicubic. (SWAG_LINEAR_V1, 224 bicubic without a margin, has V1's shapes: V1's is the default.)
    Before, every size got V1's 256/224 margin and bilinear: 439 -> 384 px for the SWAG ViT-B/16."""
    h, _w = config.image_size
    if h > 224:
        return h, "bicubic"
    if (config.dim, config.depth, config.patch_size) == (1024, 24, 16):
        return round(h * 242 / 224), "bilinear"
    return round(h * 256 / 224), "bilinear"


# ------------------------------------------------------------------------------ standard ResNets
def is_torchvision_resnet(sd: dict[str, torch.Tensor]) -> bool:
    """torchvision / timm `resnet*` keys (BatchNorm stem + `layer1`); timm's are the same names."""
    return "conv1.weight" in sd and "layer1.0.conv1.weight" in sd and "bn1.running_mean" in sd


def fill_bn_counters(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the `num_batches_tracked` buffers a file left out (older torch saves, some converters).

    They only matter for momentum=None (cumulative averaging), which vitlab never uses, so 0 is exact.
    """
    out = dict(sd)
    for key in list(sd):
        if key.endswith(".running_mean"):
            counter = key[: -len("running_mean")] + "num_batches_tracked"
            out.setdefault(counter, torch.tensor(0, dtype=torch.long))
    return out


def standard_resnet_config(sd: dict[str, torch.Tensor], source: str, **overrides: Any) -> ViTConfig:
    """The StandardResNet config of a torchvision-named state dict, read off its shapes."""
    from vitlab.models.config import ResNetConfig

    stem = sd["conv1.weight"]
    width, in_chans, k, _ = stem.shape
    if k not in (7, 3):
        raise VitlabError(f"{source}: a {k}x{k} ResNet stem convolution; vitlab builds the 7x7 (ImageNet) and "
                          "3x3 (small) stems only")
    counts: dict[int, int] = {}
    for key in sd:
        if m := re.match(r"layer(\d+)\.(\d+)\.", key):
            s, b = int(m.group(1)), int(m.group(2))
            counts[s] = max(counts.get(s, 0), b + 1)
    if sorted(counts) != list(range(1, len(counts) + 1)):
        raise VitlabError(f"{source}: ResNet stages {sorted(counts)} are not numbered layer1..layerN")
    layers = tuple(counts[s] for s in sorted(counts))
    block = "bottleneck" if "layer1.0.conv3.weight" in sd else "basic"
    inner = sd["layer1.0.conv1.weight"].shape[0]
    conv2 = sd["layer1.0.conv2.weight"]
    if inner != width or conv2.shape[1] != conv2.shape[0]:
        raise VitlabError(f"{source}: a wide ResNet or ResNeXt (stem width {width}, first block width {inner}, "
                          f"groups {conv2.shape[0] // conv2.shape[1]}); vitlab builds the plain ResNets only")
    factor = width // 64 if width % 64 == 0 else 1
    num_classes = sd["fc.weight"].shape[0] if "fc.weight" in sd else 0
    resnet = dict(layers=layers, width_factor=factor, base_width=width // factor, stem="bit" if k == 7 else "small",
                  kind="standard", block=block)
    for key in ("layers", "width_factor", "base_width", "stem"):
        if key in overrides:
            resnet[key] = overrides.pop(key)
    depth = sum(layers) * (3 if block == "bottleneck" else 2) + 2
    config = dict(name=f"resnet-{depth}", arch="resnet", resnet=ResNetConfig(**resnet), in_chans=in_chans,
                  patch_size=1, num_classes=num_classes, image_size=224 if k == 7 else 32)
    config.update(overrides)
    return ViTConfig(**config)


def resnet_v1_preprocess(config: ViTConfig) -> dict:
    """torchvision's V1 evaluation transform: shorter side 256, centre crop 224, bilinear, ImageNet mean/std.

    (V2 weights resize to 232 instead; the file does not say which it is, so V1's is the default.)"""
    c = config.in_chans
    h, _w = config.image_size
    return {"image_size": list(config.image_size), "mean": IMAGENET_MEAN if c == 3 else [0.449] * c,
            "std": IMAGENET_STD if c == 3 else [0.226] * c, "resize": round(h * 256 / 224), "crop_fraction": 1.0,
            "interpolation": "bilinear", "channels": c}


def read_torchvision_resnet(sd: dict[str, torch.Tensor], source: str = "state dict",
                            **overrides: Any) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, vitlab state dict, meta) of a torchvision or timm `resnet*` state dict (the keys are vitlab's)."""
    config = standard_resnet_config(sd, source, **overrides)
    out = fill_bn_counters(sd)
    meta = {"format": "torchvision", "class_names": None, "preprocess": resnet_v1_preprocess(config)}
    return config, out, meta
