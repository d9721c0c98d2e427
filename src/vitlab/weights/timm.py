"""timm state dicts in and out. vitlab's key names follow timm, so a plain ViT, a hybrid
(`vit_base_r50_s16_384`-style `patch_embed.backbone.stem/stages.*`) and a MAP head map 1:1;
this module infers the config from the shapes and handles timm's layout options.

Numerics of timm ViTs: exact (erf) GELU, LayerNorm eps 1e-6. timm's hybrid StdConv2dSame uses
eps 1e-8 inside the weight standardisation where the official code (and vitlab) uses 1e-5.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.models.config import ResNetConfig, ViTConfig
from vitlab.models.resnet import resnet_reduction
from vitlab.weights.io import folder_config

# The paper's and timm's widths -> heads (head_dim 64 except H/14 with 80).
_HEADS = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16, 1408: 16, 1664: 16}


def guess_heads(dim: int) -> int:
    """Attention heads for a width: the state dict does not store it; the standard models fix it."""
    if dim in _HEADS:
        return _HEADS[dim]
    if dim % 64 == 0:
        return dim // 64
    raise VitlabError(f"cannot tell the number of attention heads of a width-{dim} model from the file; "
                      "pass heads=N to vitlab.load (--heads N on the command line)")


def is_timm(sd: dict[str, torch.Tensor]) -> bool:
    """A timm ViT / hybrid, or a post-activation ResNetV2 (the ViT code's units). Pre-activation ResNetV2
    (BiT, final `norm`) is `weights.timm_bit`'s; timm's BatchNorm `resnet*` use torchvision's keys
    (`weights.torchvision.is_torchvision_resnet`)."""
    return "patch_embed.proj.weight" in sd or any(k.startswith("patch_embed.backbone.") for k in sd) \
        or is_timm_resnetv2_postact(sd)


def is_timm_resnetv2_postact(sd: dict[str, torch.Tensor]) -> bool:
    """timm ResNetV2 with preact=False: per-block `norm3` (post-activation) and no final `norm`."""
    return "stem.conv.weight" in sd and "norm.weight" not in sd and any(k.startswith("stages.") for k in sd) \
        and not any(k.startswith("conv1.") or k.startswith("layer1.") for k in sd)


def _resnet_layout(sd: dict[str, torch.Tensor], prefix: str) -> tuple[ResNetConfig, int]:
    """(ResNetConfig, in_chans) read off `prefix + stem.conv.weight` and the stage/block indices."""
    stem = sd[prefix + "stem.conv.weight"]
    width, in_chans, k, _ = stem.shape
    if width % 64:
        raise VitlabError(f"ResNet stem width {width} is not a multiple of 64")
    counts: dict[int, int] = {}
    for key in sd:
        if m := re.match(rf"{re.escape(prefix)}stages\.(\d+)\.blocks\.(\d+)\.", key):
            s, b = int(m.group(1)), int(m.group(2))
            counts[s] = max(counts.get(s, 0), b + 1)
    layers = tuple(counts[s] for s in sorted(counts))
    return ResNetConfig(layers=layers, width_factor=width // 64, stem="bit" if k == 7 else "small"), in_chans


def _square_side(n: int, what: str) -> int:
    side = int(round(n**0.5))
    if side * side != n:
        raise VitlabError(f"{what} has {n} patch slots, not a square grid; pass image_size=(H, W) explicitly")
    return side


def read_timm(sd: dict[str, torch.Tensor], **overrides: Any) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, vitlab state dict, meta) of a timm ViT / hybrid / non-preact ResNetV2 state dict."""
    sd = dict(sd)
    from vitlab.weights import timm_bit

    if timm_bit.is_timm_bit(sd):  # pre-activation BiT (resnetv2_*_bit), e.g. from a timm Hub folder
        return timm_bit.read_timm_bit(sd, **overrides)
    if "patch_embed.proj.weight" not in sd:
        return _read_timm_resnet(sd, **overrides)
    for bad, why in (("norm_pre.weight", "a pre-norm (CLIP-style) ViT"), ("reg_token", "register tokens"),
                     ("blocks.0.ls1.gamma", "LayerScale"), ("blocks.0.attn.q_norm.weight", "QK-norm")):
        if bad in sd:
            raise VitlabError(f"this timm checkpoint uses {why} ('{bad}'), which the paper's ViT does not have")
    if "fc_norm.weight" in sd:
        if "norm.weight" in sd:
            raise VitlabError("timm checkpoint has both 'norm' and 'fc_norm'; not a paper ViT")
        raise VitlabError("this timm checkpoint normalises after pooling ('fc_norm', e.g. BEiT/MAE-style global pool); "
                          "vitlab's 'gap' follows the official code (LayerNorm, then mean)")
    w = sd["patch_embed.proj.weight"]
    dim, _, patch, patch_w = w.shape
    if patch != patch_w:
        raise VitlabError(f"non-square patches {patch}x{patch_w} are not supported")
    resnet, in_chans = None, w.shape[1]
    if "patch_embed.backbone.stem.conv.weight" in sd:
        resnet, in_chans = _resnet_layout(sd, "patch_embed.backbone.")
    depth = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k)))
    token = "cls_token" in sd
    classifier = "token" if token else ("map" if "attn_pool.latent" in sd else "gap")
    if "pos_embed" in sd:
        n = sd["pos_embed"].shape[1]
        if token and int(round(n**0.5)) ** 2 == n:  # timm no_embed_class: no slot for the class token
            sd["pos_embed"] = torch.cat([sd["pos_embed"].new_zeros(1, 1, dim), sd["pos_embed"]], dim=1)
            n += 1
        side = _square_side(n - (1 if token else 0), "pos_embed")
        posemb = "learn"
    else:
        side, posemb = None, "sincos2d"
    config = dict(
        name="timm-vit", patch_size=patch, in_chans=in_chans, dim=dim, depth=depth,
        heads=overrides.pop("heads", None) or guess_heads(dim), mlp_dim=sd["blocks.0.mlp.fc1.weight"].shape[0],
        classifier=classifier, qkv_bias="blocks.0.attn.qkv.bias" in sd,
        representation_size=sd["pre_logits.fc.weight"].shape[0] if "pre_logits.fc.weight" in sd else None,
        num_classes=sd["head.weight"].shape[0] if "head.weight" in sd else 0,
        gelu="exact", layer_norm_eps=1e-6, posemb=posemb, posemb_resample="bicubic_aa", resnet=resnet,
    )
    if side is not None:
        config["image_size"] = side * patch * (resnet_reduction(resnet) if resnet else 1)
    config.update(overrides)
    config = ViTConfig(**config)
    meta = {"format": "timm", "class_names": None, "preprocess": timm_preprocess(config)}
    return config, sd, meta


def linear_head_from_conv(sd: dict[str, torch.Tensor]) -> int:
    """timm ResNetV2's 1x1-conv `head.fc` -> vitlab's linear `head`, in place; returns the classes (0: none)."""
    head = sd.pop("head.fc.weight", None)
    bias = sd.pop("head.fc.bias", None)
    if head is None:
        return 0
    sd["head.weight"] = head.reshape(head.shape[0], -1)
    sd["head.bias"] = bias if bias is not None else head.new_zeros(head.shape[0])
    return int(head.shape[0])


def _read_timm_resnet(sd: dict[str, torch.Tensor], **overrides: Any) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """timm ResNetV2 with preact=False (the official BiT post-activation units) -> vitlab ResNet."""
    if "norm.weight" in sd:
        raise VitlabError("this is a pre-activation timm ResNetV2 (final 'norm'); vitlab's ResNet is the "
                          "post-activation BiT of the ViT paper's code")
    resnet, in_chans = _resnet_layout(sd, "")
    config = dict(name="timm-resnetv2", arch="resnet", resnet=resnet, in_chans=in_chans, patch_size=1,
                  num_classes=linear_head_from_conv(sd), image_size=224)
    config.update(overrides)
    config = ViTConfig(**config)
    return config, sd, {"format": "timm", "class_names": None, "preprocess": timm_preprocess(config)}


def is_timm_folder(folder: Path) -> bool:
    """A timm Hub folder (`hf:timm/...`): config.json with `architecture` (+ `pretrained_cfg`) and weights."""
    data = folder_config(folder)
    return data is not None and "architecture" in data and "model_type" not in data


def read_timm_folder(folder: str | Path, **overrides: Any) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, state dict, meta) of a timm Hub folder: weights by name, preprocessing from `pretrained_cfg`."""
    import json

    from vitlab.weights.io import read_tensors

    folder = Path(folder)
    data = json.loads((folder / "config.json").read_text())
    weights = next((folder / n for n in ("model.safetensors", "pytorch_model.bin") if (folder / n).is_file()), None)
    if weights is None:
        raise VitlabError(f"{folder} has a timm config.json but no model.safetensors or pytorch_model.bin")
    arch = str(data.get("architecture", ""))
    sd = read_tensors(weights)
    pool = data.get("global_pool", (data.get("model_args") or {}).get("global_pool"))
    if pool == "avg" and "cls_token" in sd:
        raise VitlabError(f"timm {arch} averages the patch tokens next to a class token; vitlab's 'gap' models have "
                          "no class token, as the official code")
    config, sd, meta = read_timm(sd, **overrides)
    config = config.replace(name=arch or config.name)
    pc = data.get("pretrained_cfg") or {}
    pre = meta["preprocess"]
    c = config.in_chans
    if pc.get("mean") is not None:
        pre["mean"], pre["std"] = list(pc["mean"])[:c], list(pc.get("std", [0.5] * c))[:c]
    if pc.get("interpolation") in ("bilinear", "bicubic", "nearest"):
        pre["interpolation"] = pc["interpolation"]
    if pc.get("crop_pct"):
        pre["crop_fraction"] = min(float(pc["crop_pct"]), 1.0)
    if pc.get("input_size"):
        pre["image_size"] = list(pc["input_size"][-2:])
    names = data.get("label_names")
    if isinstance(names, list) and len(names) == config.num_classes:
        meta["class_names"] = [str(n) for n in names]
    return config, sd, meta


def timm_preprocess(config: ViTConfig) -> dict:
    """timm's usual ViT eval transform: mean = std = 0.5, bicubic, crop 0.9 at 224 px (1.0 above)."""
    c = config.in_chans
    crop = 0.9 if max(config.image_size) <= 224 else 1.0
    return {"image_size": list(config.image_size), "mean": [0.5] * c, "std": [0.5] * c, "resize": None,
            "crop_fraction": crop, "interpolation": "bicubic", "channels": c}


def to_timm_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """vitlab state dict -> timm names (identical for ViTs and standard ResNets; BiT-post-activation ResNet
    heads become timm ResNetV2's 1x1 conv `head.fc`)."""
    cfg: ViTConfig = model.config
    if cfg.conv_stem:
        raise VitlabError("timm's VisionTransformer has no conv stem (conv_stem); save this model with --to native")
    sd = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    if cfg.arch == "resnet" and cfg.resnet.kind == "standard":
        return sd  # StandardResNet's keys are torchvision's, which are timm's `resnet*` keys
    if cfg.arch == "resnet":
        if "head.weight" in sd:
            w, b = sd.pop("head.weight"), sd.pop("head.bias")
            sd["head.fc.weight"], sd["head.fc.bias"] = w[:, :, None, None].contiguous(), b
        return sd
    if cfg.posemb != "learn":  # timm stores fixed tables as a (frozen) parameter too
        sd["pos_embed"] = model.pos_embed.detach().cpu().contiguous().clone()
    return sd


def save_timm(model: nn.Module, path: str | Path) -> Path:
    """Write the timm-named state dict to `.safetensors` (default) or `.pth`/`.bin` (torch.save)."""
    path = Path(path)
    if path.suffix not in (".safetensors", ".pth", ".pt", ".bin"):
        path = path / "model.safetensors" if path.is_dir() or not path.suffix else path
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = to_timm_state_dict(model)
    if path.suffix == ".safetensors":
        import json

        from safetensors.torch import save_file

        cfg = model.config
        hints = {"heads": cfg.heads, "gelu": cfg.gelu, "layer_norm_eps": cfg.layer_norm_eps,
                 "posemb_resample": cfg.posemb_resample} if cfg.arch == "vit" else {}
        if cfg.arch == "resnet" and cfg.resnet.kind == "bit" and cfg.resnet.ws_eps is not None:
            hints["ws_eps"] = cfg.resnet.ws_eps  # timm itself uses 1e-8; a big_transfer model keeps its 1e-10
        save_file(sd, str(path), metadata={"format": "pt", "vitlab_config": json.dumps(hints)})
    else:
        torch.save(sd, path)
    return path
