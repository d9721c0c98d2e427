"""timm's pre-activation BiT ResNets (`resnetv2_50x1_bit`, `resnetv2_{50,101,152}x{1,2,3,4}_bit`) <-> `BiTResNet`.

vitlab's BiT key names are timm's, except the head: timm stores `head.fc` as a 1x1 convolution
(K, C, 1, 1), vitlab an `nn.Linear` (K, C). timm's files carry no buffers. timm standardises
weights with eps 1e-8 (`partial(StdConv2d, eps=1e-8)`), so the config read here says ws_eps=1e-8.

Told apart from the two other timm ResNet layouts vitlab reads:
- the ViT hybrid backbone: keys under `patch_embed.backbone.`;
- the post-activation ResNetV2 (the ViT code's units): `stem.norm`, `downsample.norm`, no final `norm`,
  and `norm3` with the unit's output width; here `norm3` has the bottleneck width (conv3's input). vitlab reads
  that layout only from its own `save_timm` export (the record says its numerics); a foreign one is refused.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.models.config import ResNetConfig, ViTConfig

TIMM_BIT_WS_EPS = 1e-8


def is_timm_bit(sd: dict[str, torch.Tensor]) -> bool:
    """True for a timm pre-activation ResNetV2 state dict (BiT, or a BatchNorm one that `read_timm_bit` rejects)."""
    if "stem.conv.weight" not in sd or "norm.weight" not in sd or "stem.norm.weight" in sd:
        return False
    if any(k.startswith("patch_embed.") for k in sd):
        return False
    norm3, conv3 = sd.get("stages.0.blocks.0.norm3.weight"), sd.get("stages.0.blocks.0.conv3.weight")
    if norm3 is None or conv3 is None or conv3.ndim != 4:
        return False
    return norm3.shape[0] == conv3.shape[1]  # pre-activation: norm3 comes before conv3


def _layout(sd: dict[str, torch.Tensor]) -> tuple[ResNetConfig, int]:
    stem = sd["stem.conv.weight"]
    if stem.ndim != 4 or stem.shape[-1] not in (7, 3):
        raise VitlabError(f"timm BiT stem.conv.weight has shape {tuple(stem.shape)}; expected (width, Cin, 7, 7) "
                          "or (width, Cin, 3, 3)")
    width, in_chans, k, _ = stem.shape
    counts: dict[int, int] = {}
    for key in sd:
        if m := re.match(r"stages\.(\d+)\.blocks\.(\d+)\.", key):
            s, b = int(m.group(1)), int(m.group(2))
            counts[s] = max(counts.get(s, 0), b + 1)
    if not counts or sorted(counts) != list(range(len(counts))):
        raise VitlabError(f"timm BiT state dict has stages {sorted(counts)}; expected stages.0..stages.N")
    base, factor = (64, width // 64) if width % 64 == 0 else (width, 1)
    resnet = ResNetConfig(layers=tuple(counts[s] for s in sorted(counts)), width_factor=factor, base_width=base,
                          stem="bit" if k == 7 else "small", kind="bit", ws_eps=TIMM_BIT_WS_EPS)
    return resnet, int(in_chans)


def timm_bit_preprocess(config: ViTConfig) -> dict:
    """timm's `goog_in21k` BiT cfg: mean = std = 0.5 (inputs in [-1, 1]), bilinear, crop 0.875 at 224 px."""
    c = config.in_chans
    crop = 0.875 if max(config.image_size) <= 224 else 1.0
    return timm_eval_sizes({"image_size": list(config.image_size), "mean": [0.5] * c, "std": [0.5] * c,
                            "interpolation": "bilinear", "channels": c}, crop)


def timm_eval_sizes(pre: dict, crop_pct: float) -> dict:
    """`pre` with timm's evaluation sizes for `crop_pct` (`transforms_imagenet_eval`, crop mode "center"): the
    shorter side resized to floor(size / crop_pct), then the centre crop, also at crop_pct 1.0. A crop fraction of
    1.0 means a plain resize to vitlab (the official evaluation), which squashed non-square photos where timm
    crops them (up to 2.0 apart after normalisation at 384 px). A non-square input keeps crop_pct as a fraction."""
    import math

    pre = dict(pre)
    h, w = pre["image_size"]
    crop_pct = min(float(crop_pct), 1.0)
    if h == w:
        pre["resize"], pre["crop_fraction"] = math.floor(h / crop_pct), 1.0
    else:
        pre["resize"], pre["crop_fraction"] = None, crop_pct
    return pre


def read_timm_bit(sd: dict[str, torch.Tensor], **overrides: Any) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, vitlab state dict, meta) of a timm `resnetv2_*_bit` state dict."""
    from vitlab.weights.big_transfer import _expected_shapes, _first

    if any(k.endswith("running_mean") for k in sd):
        raise VitlabError("this timm pre-activation ResNetV2 uses BatchNorm (e.g. resnetv2_50); vitlab reads the "
                          "BiT ones with GroupNorm and weight standardisation (resnetv2_*_bit)")
    sd = dict(sd)
    resnet, in_chans = _layout(sd)
    ws_eps = overrides.pop("ws_eps", None)  # stored by vitlab's own export of a big_transfer model
    if ws_eps is not None:
        resnet = dataclasses.replace(resnet, ws_eps=float(ws_eps))
    from vitlab.weights.timm import linear_head_from_conv

    config = dict(name="timm-resnetv2-bit", arch="resnet", resnet=resnet, in_chans=in_chans, patch_size=1,
                  num_classes=linear_head_from_conv(sd), image_size=224)
    config.update(overrides)
    config = ViTConfig(**config)
    shapes = _expected_shapes(config)
    missing = [k for k in shapes if k not in sd]
    extra = [k for k in sd if k not in shapes]
    bad = [f"{k} (expected {shapes[k]}, found {tuple(sd[k].shape)})" for k in shapes if k in sd and tuple(sd[k].shape) != shapes[k]]
    problems = [f"{what} {_first(items)}" for what, items in
                (("missing keys", missing), ("unexpected keys", extra), ("shape mismatch", bad)) if items]
    if problems:
        raise VitlabError("timm BiT state dict does not fit a pre-activation BiT ResNet: " + "; ".join(problems))
    # kept in the file's dtype: the load casts to the model's, and `vitlab convert` keeps a float64 file exact
    return config, sd, {"format": "timm", "class_names": None, "preprocess": timm_bit_preprocess(config)}


def to_timm_bit_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """BiTResNet -> timm `resnetv2_*_bit` state dict (strict-loadable; head as the 1x1 conv `head.fc`)."""
    cfg = model.config
    if cfg.arch != "resnet" or cfg.resnet is None or cfg.resnet.kind != "bit":
        raise VitlabError("to_timm_bit_state_dict needs a BiT ResNet (kind 'bit')")
    from vitlab.weights.timm import to_timm_state_dict

    return to_timm_state_dict(model)  # BiTResNet already uses timm's ResNetV2 names but for the head
