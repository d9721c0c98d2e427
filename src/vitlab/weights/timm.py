"""timm state dicts in and out. vitlab's key names follow timm, so a plain ViT, a hybrid
(`vit_base_r50_s16_384`-style `patch_embed.backbone.stem/stages.*`) and a MAP head map 1:1; timm's
stem-only hybrids (`patch_embed.backbone.conv/norm`) are renamed both ways. This module infers the
config from the shapes and handles timm's layout options.

Lossless or refuse: vitlab's export stores what the keys cannot tell (heads, GELU form, pooling, image
size, class names, preprocessing) in the safetensors header or a `NAME.vitlab.json` sidecar; a foreign
file gets heads only for published widths and must be told its pooling when it has a class token and
its size when its grid is not square (docs/weights.md, "What each format carries").

Numerics of timm ViTs: exact (erf) GELU, LayerNorm eps 1e-6. timm's hybrid StdConv2dSame uses
eps 1e-8 inside the weight standardisation where the official code (and vitlab's default) uses 1e-5: a foreign
timm hybrid file is read with ws_eps=1e-8 (on weights of a trained scale the official eps moved the logits of
`vit_base_r50_s16` by 2.8e-4 relative), vitlab's own export with the eps it was made with.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.limits import check_size_pair
from vitlab.models.config import ResNetConfig, ViTConfig, check_fields
from vitlab.models.resnet import resnet_reduction
from vitlab.weights.io import folder_config, is_regular_file

# Attention heads of the published ViT widths: the paper's Ti, S, B, L, H (192, 384, 768, 1024, 1280) and
# timm's giant / gigantic (1408, 1664). timm and torchvision files do not store the heads; for any other
# width they must be given (`heads=`), because guessing head_dim 64 silently changes the model.
KNOWN_HEADS = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16, 1408: 16, 1664: 16}

# Config fields a timm state dict cannot tell from its keys and shapes. vitlab's own timm export stores
# them beside the weights (safetensors header, or a JSON sidecar next to a torch file), so its files load
# back to the same model; a foreign file without them follows the documented policy (docs/weights.md).
VIT_HINTS = ("heads", "gelu", "layer_norm_eps", "classifier", "image_size", "posemb", "posemb_resample", "dropout",
             "attention_dropout", "drop_path", "head_bias_init", "name")
HINTS_KEY = "vitlab_config"
CLASS_NAMES_KEY = "vitlab_class_names"
PREPROCESS_KEY = "vitlab_preprocess"
SIDECAR_SUFFIX = ".vitlab.json"
SIDECAR_FORMAT = "vitlab-timm-sidecar"
TIMM_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
# timm's VisionTransformer numerics: exact GELU, LayerNorm eps 1e-6.
TIMM_LAYER_NORM_EPS = 1e-6
# timm's hybrid backbones standardise weights with StdConv2dSame(eps=1e-8) (`vision_transformer_hybrid._resnetv2`).
TIMM_HYBRID_WS_EPS = 1e-8
_UNSET = object()  # "ws_eps" absent from the overrides (a foreign file), as opposed to given as None (official)
# timm's stem-only hybrids (`vit_tiny_r_s16_p8_*`: a ResNet with no stages) keep the stem's conv and norm
# directly under the backbone (`patch_embed.backbone.conv/norm`); vitlab nests them in `backbone.stem`.
_BACKBONE = "patch_embed.backbone."
# vitlab's key names are timm's, so `torch.save(model.state_dict())` of a vitlab model is read as a timm file.
OWN_STATE_DICT_HINT = ("A vitlab model's own state dict has timm's names and says no more; "
                       "`vitlab.save(model, folder)` keeps the config")


def guess_heads(dim: int) -> int:
    """Attention heads of a published ViT width (`KNOWN_HEADS`); other widths are refused, not guessed."""
    if dim in KNOWN_HEADS:
        return KNOWN_HEADS[dim]
    widths = ", ".join(f"{w}->{h}" for w, h in KNOWN_HEADS.items())
    raise VitlabError(f"the file does not store the attention heads and width {dim} is not a published ViT width "
                      f"({widths}); pass heads=N (--model-args heads=N on the command line)")


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
    if width % 32:
        raise VitlabError(f"ResNet stem width {width} is not a multiple of 32 (GroupNorm with 32 groups)")
    base, factor = (64, width // 64) if width % 64 == 0 else (width, 1)  # the same network either way
    counts: dict[int, int] = {}
    for key in sd:
        if m := re.match(rf"{re.escape(prefix)}stages\.(\d+)\.blocks\.(\d+)\.", key):
            s, b = int(m.group(1)), int(m.group(2))
            counts[s] = max(counts.get(s, 0), b + 1)
    layers = tuple(counts[s] for s in sorted(counts))
    return ResNetConfig(layers=layers, width_factor=factor, base_width=base, stem="bit" if k == 7 else "small"), in_chans


def check_override_fields(overrides: dict[str, Any]) -> None:
    """Overrides must be model config fields: one line naming the unknown ones (not a TypeError)."""
    check_fields(ViTConfig, overrides)


def file_image_size(
    pos_embed: torch.Tensor, has_class_token: bool, stride: int, image_size: Any = None, size_hint: Any = None,
    allow_no_class_slot: bool = True,
) -> tuple[tuple[int, int], torch.Tensor]:
    """The image size a position embedding was made for, and the embedding with a class slot.

    `image_size` is the file's own size (an override or vitlab's stored config): it must fit the table.
    `size_hint` is the size the caller wants (`load(..., image_size=)`): taken as the file's own when its
    grid has exactly the table's patch slots, else the table must be a square grid and is resampled later.
    timm `no_embed_class` files (class token, no class slot) get a zero class slot: adding zero to the
    class token is what timm computes. Without a size, a table that fits two grids is refused.
    """
    n = pos_embed.shape[1]
    for size, must_fit in ((image_size, True), (size_hint, False)):
        if size is None:
            continue
        h, w = _grid(size, stride)
        if n == h * w + (1 if has_class_token else 0):
            return (h * stride, w * stride), pos_embed
        if has_class_token and allow_no_class_slot and n == h * w:
            return (h * stride, w * stride), _with_class_slot(pos_embed)
        if must_fit:
            slots = n - 1 if has_class_token else n
            raise VitlabError(f"image_size {check_size_pair('image_size', size)} gives a {h}x{w} grid, but the file's position "
                              f"embedding has {slots} patch slots; pass the size the file was made for")
    side = _square_side(n - 1) if has_class_token else _square_side(n)
    if side is not None:
        return (side * stride, side * stride), pos_embed
    if has_class_token and allow_no_class_slot and (side := _square_side(n)) is not None:
        # n = s*s slots next to a class token: an s x s grid without a class slot (timm no_embed_class), or
        # an (s-1) x (s+1) grid with one (n - 1 = (s-1)(s+1)); the logits differ, so the size must be given.
        raise VitlabError(f"the file's position embedding has {n} slots next to a class token: a {side}x{side} grid "
                          f"without a class slot (timm no_embed_class) or a {side - 1}x{side + 1} grid with one; pass "
                          f"the image size it was made for as image_size=(H, W) (--image-size HxW), e.g. "
                          f"{side * stride}x{side * stride}")
    slots = n - 1 if has_class_token else n
    raise VitlabError(f"the file's position embedding has {slots} patch slots, not a square grid; pass the image "
                      f"size it was made for as image_size=(H, W) (--image-size HxW), with (H/{stride})*(W/{stride}) "
                      f"= {slots}")


def _grid(size: Any, stride: int) -> tuple[int, int]:
    h, w = check_size_pair("image_size", size)  # a stored [16.5, 16] is refused, not read as 16
    if h % stride or w % stride:
        raise VitlabError(f"image_size {(h, w)} is not a multiple of the model's stride {stride}; use multiples of {stride}")
    return h // stride, w // stride


def _square_side(n: int) -> int | None:
    side = int(round(n**0.5))
    return side if side > 0 and side * side == n else None


def _with_class_slot(pos_embed: torch.Tensor) -> torch.Tensor:
    return torch.cat([pos_embed.new_zeros(1, 1, pos_embed.shape[2]), pos_embed], dim=1)


def _refuse_non_paper_layouts(sd: dict[str, torch.Tensor]) -> None:
    """timm options the paper's ViT does not have: one line naming the option."""
    for bad, why in (("norm_pre.weight", "a pre-norm (CLIP-style) ViT"), ("reg_token", "register tokens"),
                     ("blocks.0.ls1.gamma", "LayerScale"), ("blocks.0.attn.q_norm.weight", "QK-norm")):
        if bad in sd:
            raise VitlabError(f"this timm checkpoint uses {why} ('{bad}'), which the paper's ViT does not have")
    if "fc_norm.weight" in sd:
        if "norm.weight" in sd:
            raise VitlabError("timm checkpoint has both 'norm' and 'fc_norm'; not a paper ViT")
        raise VitlabError("this timm checkpoint normalises after pooling ('fc_norm', e.g. BEiT/MAE-style global pool); "
                          "vitlab's 'gap' follows the official code (LayerNorm, then mean)")


def timm_classifier(sd: dict[str, torch.Tensor], requested: str | None) -> str:
    """vitlab's classifier of a timm ViT state dict.

    Without a class token the keys decide ('map' with `attn_pool`, else 'gap': timm's global_pool='avg'
    with fc_norm=False; 'max'/'avgmax' pooling cannot be told apart and is read as 'avg'). With a class
    token the keys cannot tell timm's global_pool='token' from 'avg' with fc_norm=False (the logits differ),
    so the caller must say `classifier='token'` unless vitlab's own export stored it.
    """
    if "cls_token" not in sd:
        found = "map" if "attn_pool.latent" in sd else "gap"
        if requested not in (None, found):
            raise VitlabError(f"this timm file has no class token, so its pooling is '{found}'; "
                              f"classifier={requested!r} cannot apply: leave it out")
        return found
    if "attn_pool.latent" in sd:
        raise VitlabError("this timm file has a class token and an attention-pool head (attn_pool); vitlab's "
                          "'map' models have no class token, as big_vision's")
    if requested is None:
        raise VitlabError("a timm state dict with a class token does not say how it pools (global_pool='token', "
                          "timm's default, or 'avg' with fc_norm=False; the logits differ): if it was made with "
                          "global_pool='token', pass classifier='token' (--model-args classifier=token)")
    if requested != "token":
        raise VitlabError(f"classifier={requested!r} next to a class token (timm global_pool='avg', fc_norm=False) "
                          "cannot be expressed: vitlab's 'gap' and 'map' models have no class token, as the "
                          "official code; only classifier='token' reads this file")
    return "token"


def from_timm_stem_only(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm's stem-only hybrid keys (`patch_embed.backbone.conv/norm.*`) -> vitlab's (`...backbone.stem.conv/norm.*`)."""
    if _BACKBONE + "conv.weight" not in sd:
        return sd
    return {(_BACKBONE + "stem." + k[len(_BACKBONE):]) if k.startswith(_BACKBONE) else k: v for k, v in sd.items()}


def to_timm_stem_only(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vitlab's stem-only hybrid keys -> timm's (`vit_tiny_r_s16_p8_224`: `patch_embed.backbone.conv/norm.*`)."""
    stem = _BACKBONE + "stem."
    return {(_BACKBONE + k[len(stem):]) if k.startswith(stem) else k: v for k, v in sd.items()}


def read_timm(sd: dict[str, torch.Tensor], size_hint: Any = None,
              **overrides: Any) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, vitlab state dict, meta) of a timm ViT / hybrid / non-preact ResNetV2 state dict.

    `overrides` set what the keys cannot tell (`heads` for unpublished widths, `classifier='token'` when a
    class token is present, `image_size` of a non-square grid); `size_hint`: see `file_image_size`.
    """
    sd = dict(sd)
    from vitlab.weights import timm_bit

    if timm_bit.is_timm_bit(sd):  # pre-activation BiT (resnetv2_*_bit), e.g. from a timm Hub folder
        return timm_bit.read_timm_bit(sd, **overrides)
    overrides = dict(overrides)
    ws_eps = overrides.pop("ws_eps", _UNSET)  # a ResNet field: the hybrid backbone's or the ResNet's, not the ViT's
    check_override_fields(overrides)
    if "patch_embed.proj.weight" not in sd:
        if not all(k in overrides for k in _RESNET_RECORD):
            raise VitlabError(_foreign_postact_refusal(sd))
        return _read_timm_resnet(sd, ws_eps=None if ws_eps is _UNSET else ws_eps, **overrides)
    _refuse_non_paper_layouts(sd)
    sd = from_timm_stem_only(sd)
    w = sd["patch_embed.proj.weight"]
    dim, _, patch, patch_w = w.shape
    if patch != patch_w:
        raise VitlabError(f"non-square patches {patch}x{patch_w} are not supported")
    resnet, in_chans = None, w.shape[1]
    if _BACKBONE + "stem.conv.weight" in sd:
        resnet, in_chans = _resnet_layout(sd, _BACKBONE)
        # timm's eps for a foreign file (it computes with it), else the one given or stored (None: official 1e-5)
        resnet = dataclasses.replace(resnet, ws_eps=TIMM_HYBRID_WS_EPS if ws_eps is _UNSET else ws_eps)
    elif ws_eps not in (_UNSET, None):
        raise VitlabError("ws_eps is a setting of a hybrid's ResNet stem, and this timm ViT has none: leave it out")
    depth = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k)))
    try:
        classifier = timm_classifier(sd, overrides.pop("classifier", None))
        heads = overrides.pop("heads", None) or guess_heads(dim)
    except VitlabError as missing:  # what the file does not say: also where vitlab's own bare state dicts land
        raise VitlabError(f"{missing}. {OWN_STATE_DICT_HINT}") from None
    image_size = overrides.pop("image_size", None)
    posemb = "learn" if "pos_embed" in sd else "sincos2d"
    if posemb == "learn":
        stride = patch * (resnet_reduction(resnet) if resnet else 1)
        image_size, sd["pos_embed"] = file_image_size(sd["pos_embed"], classifier == "token", stride, image_size,
                                                      size_hint)
    config = dict(
        name="timm-vit", patch_size=patch, in_chans=in_chans, dim=dim, depth=depth,
        heads=heads, mlp_dim=sd["blocks.0.mlp.fc1.weight"].shape[0],
        classifier=classifier, qkv_bias="blocks.0.attn.qkv.bias" in sd,
        representation_size=sd["pre_logits.fc.weight"].shape[0] if "pre_logits.fc.weight" in sd else None,
        num_classes=sd["head.weight"].shape[0] if "head.weight" in sd else 0,
        gelu="exact", layer_norm_eps=TIMM_LAYER_NORM_EPS, posemb=posemb, posemb_resample="bicubic_aa", resnet=resnet,
    )
    if image_size is not None or size_hint is not None:
        config["image_size"] = image_size or size_hint
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


# What vitlab's export of a ResNet always records beside a timm file (`file_hints`): a post-activation ResNetV2 file
# with them is vitlab's own, whose numerics vitlab knows.
_RESNET_RECORD = ("name", "image_size")


def _foreign_postact_refusal(sd: dict[str, torch.Tensor]) -> str:
    """Why a timm post-activation ResNetV2 file with no vitlab record is not read: its keys do not say how timm
    computed it (timm registers no such classifier; `ResNetV2(preact=False)` is built by hand or inside a hybrid),
    and vitlab's post-activation ResNet computes one variant only. Read as that variant (as they were before),
    timm-built files gave outputs 2e-6 to 5e-3 away from timm's: the padding of stem_type '' and 'fixed', the eps,
    and the standardisation's formula (timm: sqrt(var + eps)) even for stem_type='same' with StdConv2dSame."""
    own = f" {OWN_STATE_DICT_HINT}" if "head.weight" in sd else ""
    return ("this timm post-activation ResNetV2 (ResNetV2(preact=False): stem.norm, no final norm) carries no "
            "vitlab record, and its keys do not say how timm computed it (stem_type '' or 'fixed' pad "
            "symmetrically, 'same' as TensorFlow; StdConv eps 1e-6 or 1e-8), while vitlab's post-activation "
            "ResNet computes the ViT code's units only ('SAME' padding, (w - mean) / (std + eps)): load the timm "
            "hybrid ViT it belongs to, or a file vitlab wrote (vitlab.save, or save_timm, which keeps a record)"
            f"{own}")


def _read_timm_resnet(sd: dict[str, torch.Tensor], ws_eps: float | None = None,
                      **overrides: Any) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """timm ResNetV2 with preact=False (the official BiT post-activation units) -> vitlab ResNet; `ws_eps` as
    given or stored by vitlab's export (None: the official 1e-5; timm has no such registered classifier)."""
    if "norm.weight" in sd:
        raise VitlabError("this is a pre-activation timm ResNetV2 (final 'norm'); vitlab's ResNet is the "
                          "post-activation BiT of the ViT paper's code")
    resnet, in_chans = _resnet_layout(sd, "")
    resnet = dataclasses.replace(resnet, ws_eps=ws_eps)  # the stored ws_eps reached ViTConfig(...) and failed
    config = dict(name="timm-resnetv2", arch="resnet", resnet=resnet, in_chans=in_chans, patch_size=1,
                  num_classes=linear_head_from_conv(sd), image_size=224)
    config.update(overrides)
    config = ViTConfig(**config)
    return config, sd, {"format": "timm", "class_names": None, "preprocess": timm_preprocess(config)}


def is_timm_folder(folder: Path) -> bool:
    """A timm Hub folder (`hf:timm/...`): config.json with `architecture` (+ `pretrained_cfg`) and weights."""
    data = folder_config(folder)
    return data is not None and "architecture" in data and "model_type" not in data


# timm's `global_pool` -> vitlab's classifier ('avg' without a class token and without fc_norm: see timm_classifier).
_POOL_TO_CLASSIFIER = {"token": "token", "avg": "gap", "map": "map"}


def read_timm_folder(folder: str | Path, size_hint: Any = None,
                     **overrides: Any) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, state dict, meta) of a timm Hub folder: weights by name, pooling and preprocessing from config.json."""
    from vitlab.weights.io import read_json, read_tensors

    folder = Path(folder)
    data = read_json(folder / "config.json", "config.json")  # size-bounded (docs/weights.md, Limits)
    weights = next((folder / n for n in ("model.safetensors", "pytorch_model.bin") if is_regular_file(folder / n)),
                   None)
    if weights is None:
        raise VitlabError(f"{folder} has a timm config.json but no model.safetensors or pytorch_model.bin")
    arch = str(data.get("architecture", ""))
    sd = read_tensors(weights)
    pool = data.get("global_pool", (data.get("model_args") or {}).get("global_pool"))
    if pool == "avg" and "cls_token" in sd:
        raise VitlabError(f"timm {arch} averages the patch tokens next to a class token; vitlab's 'gap' models have "
                          "no class token, as the official code")
    if pool in _POOL_TO_CLASSIFIER and "patch_embed.proj.weight" in sd:  # the folder says how it pools
        overrides.setdefault("classifier", _POOL_TO_CLASSIFIER[pool])
    pc = data.get("pretrained_cfg") or {}
    if size_hint is None and pc.get("input_size"):  # the size the weights were made for
        size_hint = tuple(pc["input_size"][-2:])
    config, sd, meta = read_timm(sd, size_hint, **overrides)
    config = config.replace(name=arch or config.name)
    pre = meta["preprocess"]
    c = config.in_chans
    if pc.get("mean") is not None:
        pre["mean"], pre["std"] = list(pc["mean"])[:c], list(pc.get("std", [0.5] * c))[:c]
    if pc.get("interpolation") in ("bilinear", "bicubic", "nearest", "box", "hamming", "lanczos"):  # timm's PIL names
        pre["interpolation"] = pc["interpolation"]
    if pc.get("input_size") or pc.get("crop_pct"):
        from vitlab.weights.timm_bit import timm_eval_sizes

        if pc.get("input_size"):
            pre["image_size"] = list(pc["input_size"][-2:])
        crop = pc.get("crop_pct") or (0.9 if max(pre["image_size"]) <= 224 else 1.0)  # timm's defaults, as above
        meta["preprocess"] = pre = timm_eval_sizes(pre, float(crop))
    meta["preprocess"] = _with_crop_mode(pre, pc.get("crop_mode") or "center", folder)
    names = data.get("label_names")
    if isinstance(names, list) and len(names) == config.num_classes:
        meta["class_names"] = [str(n) for n in names]
    return config, sd, meta


def _with_crop_mode(pre: dict, mode: str, folder: Path) -> dict:
    """`pre` with timm's pretrained_cfg `crop_mode`: "center" (the shorter side, vitlab's default) or "squash"
    (both sides to floor(size / crop_pct), then the crop, `timm.data.transforms_imagenet_eval`); "border" (the
    longer side, then padding) and a squash to a non-square size are refused rather than run another way."""
    if mode == "center":
        return pre
    h, w = pre["image_size"]
    if mode != "squash" or h != w or pre.get("resize") is None:
        raise VitlabError(f"{folder}: timm's crop_mode {mode!r} at {h}x{w} is a preprocessing vitlab does not "
                          "reproduce (it does 'center', and 'squash' at a square size); set pretrained_cfg's "
                          "crop_mode to 'center' in config.json to run it with a centre crop")
    return {**pre, "crop_mode": "squash"}


def timm_preprocess(config: ViTConfig) -> dict:
    """timm's usual ViT eval transform: mean = std = 0.5, bicubic, crop 0.9 at 224 px (1.0 above: the shorter side
    to the size, then the centre crop; `timm_bit.timm_eval_sizes`)."""
    from vitlab.weights.timm_bit import timm_eval_sizes

    c = config.in_chans
    crop = 0.9 if max(config.image_size) <= 224 else 1.0
    return timm_eval_sizes({"image_size": list(config.image_size), "mean": [0.5] * c, "std": [0.5] * c,
                            "interpolation": "bicubic", "channels": c}, crop)


def to_timm_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """vitlab state dict -> timm names (identical for ViTs and standard ResNets; stem-only hybrids get timm's
    `patch_embed.backbone.conv/norm`; BiT-post-activation ResNet heads become timm ResNetV2's 1x1 conv `head.fc`).

    Refuses what timm's models cannot load: a conv stem, a representation layer (`pre_logits`).
    """
    cfg: ViTConfig = model.config
    if cfg.conv_stem:
        raise VitlabError("timm's VisionTransformer has no conv stem (conv_stem); save this model with --to native")
    if cfg.arch == "vit" and cfg.representation_size:
        raise VitlabError(f"timm's VisionTransformer has no representation layer (this model's pre_logits is "
                          f"{cfg.representation_size} wide), so timm would refuse the file: save with --to native, "
                          "or replace the head with --num-classes K (which drops pre_logits)")
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
    if cfg.resnet is not None and not cfg.resnet.layers:
        sd = to_timm_stem_only(sd)
    return sd


def file_hints(config: ViTConfig) -> dict[str, Any]:
    """What vitlab stores beside a timm file: the config fields its keys and shapes cannot tell."""
    if config.arch == "vit":
        fields = config.to_dict()
        hints = {k: fields[k] for k in VIT_HINTS}
        if config.resnet is not None:  # the hybrid's WS eps, None (official) included: foreign files get timm's
            hints["ws_eps"] = config.resnet.ws_eps
        return hints
    # a ResNet takes any size, so the keys cannot tell the one it was made for (export's default, preprocessing)
    hints: dict[str, Any] = {"name": config.name, "image_size": list(config.image_size)}
    if config.resnet.kind == "bit":
        from vitlab.models.bit import bit_ws_eps

        # the eps in use, also when the config leaves it to the default (big_transfer's 1e-10): without it timm's
        # reader takes timm's own 1e-8, and the logits move by about 1e-5
        hints["ws_eps"] = bit_ws_eps(config.resnet)
    elif config.resnet.ws_eps is not None:
        hints["ws_eps"] = config.resnet.ws_eps
    return hints


def timm_model_args(config: ViTConfig) -> dict[str, Any] | None:
    """Keyword arguments of `timm.models.vision_transformer.VisionTransformer` that build this plain ViT
    with the same numerics (None for hybrids, ResNets, and what keywords cannot say, e.g. LayerNorm eps)."""
    if config.arch != "vit" or config.is_hybrid or config.layer_norm_eps != TIMM_LAYER_NORM_EPS:
        return None
    ratio = config.mlp_dim / config.dim
    if int(config.dim * ratio) != config.mlp_dim:  # timm builds mlp_dim as int(dim * mlp_ratio)
        return None
    token = config.classifier == "token"
    return {"img_size": list(config.image_size), "patch_size": config.patch_size, "in_chans": config.in_chans,
            "num_classes": config.num_classes, "embed_dim": config.dim, "depth": config.depth,
            "num_heads": config.heads, "mlp_ratio": ratio, "qkv_bias": config.qkv_bias, "class_token": token,
            "global_pool": {"token": "token", "gap": "avg", "map": "map"}[config.classifier], "fc_norm": False,
            "act_layer": "gelu_tanh" if config.gelu == "tanh" else "gelu"}


def timm_output_path(path: str | Path) -> Path:
    """The file `save_timm` writes for `path`: the path itself for a known suffix, `model.safetensors` inside
    a folder (an existing one, or a name without suffix); any other suffix is refused."""
    path = Path(path)
    if path.suffix in TIMM_SUFFIXES:
        return path
    if path.is_dir() or not path.suffix:
        return path / "model.safetensors"
    raise VitlabError(f"--to timm writes {', '.join(TIMM_SUFFIXES)} files or a folder (model.safetensors inside), "
                      f"not {path.name!r}: choose one of those suffixes")


def sidecar_path(path: str | Path) -> Path:
    """Where vitlab keeps the config of a timm torch file (`x.pth` -> `x.pth.vitlab.json`)."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def keys_digest(sd: dict[str, torch.Tensor]) -> str:
    """A short fingerprint of a state dict's names and shapes, so a sidecar is never applied to another file."""
    import hashlib

    text = "\n".join(f"{k}:{list(sd[k].shape)}" for k in sorted(sd))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def save_timm(model: nn.Module, path: str | Path, class_names: list[str] | None = None,
              preprocess: Any = None) -> Path:
    """Write the timm-named state dict to `.safetensors` (default; vitlab's record in the header) or
    `.pth`/`.pt`/`.bin` (torch.save; the record in the `NAME.vitlab.json` sidecar), so that vitlab reads back
    the same model, class names and preprocessing (`stored_record`)."""
    import json

    from vitlab.weights.native import check_savable

    check_savable(model)  # a head put in by hand (nn.Sequential) was written, and refused only at load
    path = timm_output_path(path)
    sd = to_timm_state_dict(model)
    record: dict[str, Any] = {HINTS_KEY: file_hints(model.config)}
    if class_names is not None:
        record[CLASS_NAMES_KEY] = [str(n) for n in class_names]
    if preprocess is None:  # vitlab.save's default record, not the timm default a foreign file is read with
        from vitlab.weights.native import default_preprocess

        preprocess = default_preprocess(model.config)
    record[PREPROCESS_KEY] = preprocess.to_dict() if hasattr(preprocess, "to_dict") else dict(preprocess)
    args = timm_model_args(model.config)
    if args is not None:
        record["timm_args"] = args
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from vitlab.weights.io import save_safetensors

        save_safetensors(sd, path, metadata={"format": "pt", **{k: json.dumps(v) for k, v in record.items()}})
    else:
        torch.save(sd, path)
        sidecar = {"format": SIDECAR_FORMAT, "weights": path.name, "keys": keys_digest(sd), **record}
        sidecar_path(path).write_text(json.dumps(sidecar, indent=1) + "\n")
    return path


def crop_offset_note(preprocess: Any) -> str | None:
    """What timm cannot be told of a preprocessing: its evaluation transform (torchvision's CenterCrop) rounds the
    crop's start, so a crop_offset "floor" record (Hugging Face's placement) that crops has no timm setting."""
    from vitlab.data.preprocess import Preprocess

    if preprocess is None:  # save_timm stores vitlab.save's default record: round
        return None
    record = preprocess if isinstance(preprocess, Preprocess) else Preprocess.from_dict(dict(preprocess))
    if not record.crop_moves_under("round"):  # torchvision's CenterCrop
        return None
    return ("the preprocessing places its centre crop at (H - h) // 2 (Hugging Face's placement), which timm's "
            "transforms cannot (torchvision's CenterCrop rounds: a pixel away where the margin H - h is 3, 7, 11, "
            "...); vitlab reads it back from the stored record exactly")


def stored_record(path: str | Path, sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What vitlab's own export stored with a timm file ({} for a foreign file): config hints, class names,
    preprocessing, timm keywords; from the safetensors header or the sidecar of a torch file."""
    import json

    from vitlab.weights.io import safetensors_metadata

    path = Path(path)
    header = safetensors_metadata(path)
    if HINTS_KEY not in header:
        return _sidecar_record(path, sd)
    record = {}
    for key in (HINTS_KEY, CLASS_NAMES_KEY, PREPROCESS_KEY, "timm_args"):
        if key in header:
            try:
                record[key] = json.loads(header[key])
            except (ValueError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
                raise VitlabError(f"{path}: the stored '{key}' is not JSON ({exc}); re-export the file") from exc
    return record


def hints_from(record: dict[str, Any], sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The config overrides of a stored record (only fields a timm file cannot tell)."""
    hints = record.get(HINTS_KEY) or {}
    if not isinstance(hints, dict):
        raise VitlabError(f"the stored '{HINTS_KEY}' is not a JSON object; re-export the file")
    hints = {k: v for k, v in hints.items() if k in VIT_HINTS or k == "ws_eps"}
    if "heads" in hints and "cls_token" in sd:
        # vitlab never writes a class token next to other pooling: exports made before `classifier` was stored are 'token'
        hints.setdefault("classifier", "token")
    if "heads" in hints and any(k.startswith(_BACKBONE) for k in sd):
        # a hybrid exported before ws_eps was stored computed with the official eps (None), not timm's
        hints.setdefault("ws_eps", None)
    return hints


def meta_from(record: dict[str, Any], config: ViTConfig) -> dict[str, Any]:
    """Class names and preprocessing of a stored record, where they fit the model read."""
    meta: dict[str, Any] = {}
    names = record.get(CLASS_NAMES_KEY)
    if isinstance(names, list) and len(names) == config.num_classes:
        meta["class_names"] = [str(n) for n in names]
    pre = record.get(PREPROCESS_KEY)
    if isinstance(pre, dict):
        meta["preprocess"] = pre
    return meta


def _sidecar_record(path: Path, sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    from vitlab.weights.io import read_json

    side = sidecar_path(path)
    if not side.is_file():
        return {}
    try:
        data = read_json(side, "vitlab sidecar")  # size-bounded: a sidecar is a few KB
        keys = data["keys"]
    except VitlabError as exc:
        raise VitlabError(f"{side} is not a vitlab sidecar ({exc}); delete it or re-export {path.name}") from exc
    except (KeyError, TypeError) as exc:
        raise VitlabError(f"{side} is not a vitlab sidecar ({type(exc).__name__}); delete it or re-export {path.name}") from exc
    if keys != keys_digest(sd):
        raise VitlabError(f"{side} describes another model than {path.name} (other keys or shapes); delete the "
                          "sidecar, or re-export the weights")
    return {k: v for k, v in data.items() if k in (HINTS_KEY, CLASS_NAMES_KEY, PREPROCESS_KEY, "timm_args")}
