"""Named models of the paper: "vit-b/16", "r50+vit-b/16", "resnet-50", "bit-r50x1", ... -> config -> module.

Three ResNet families, with names that say which is which (docs/models.md):
  resnet-N[-small]               standard BatchNorm ResNet v1.5 (torchvision / Hugging Face / timm `resnetN`)
  bit-rNxW[-small]               pre-activation BiT (big_transfer; GroupNorm + weight-standardised conv)
  bit-rNxW-postact[-small]       the ViT code's post-activation BiT units (the hybrid stem's blocks)
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.models.config import ResNetConfig, ViTConfig, canonical_fields, size_to_run_at
from vitlab.weights import peer_names

# size -> (depth, width, mlp, heads); the paper's Table 1 plus Ti/S of the official configs and
# big_vision's "mu" for tests and tiny demos.
VIT_SIZES: dict[str, tuple[int, int, int, int]] = {
    "mu": (1, 32, 128, 2),
    "ti": (12, 192, 768, 3),
    "s": (12, 384, 1536, 6),
    "b": (12, 768, 3072, 12),
    "l": (24, 1024, 4096, 16),
    "h": (32, 1280, 5120, 16),
}
PATCH_SIZES = (8, 14, 16, 32)
# The official configs keep dropout 0.1 only for L/16 and H/14 (and the R50 hybrids).
_DROPOUT_01 = {("l", 16), ("h", 14)}

# name -> (base ViT size, ResNet layers, patch size on the feature map, dropout)
HYBRIDS: dict[str, tuple[str, tuple[int, ...], int, float]] = {
    "r50+vit-b/16": ("b", (3, 4, 9), 1, 0.1),
    "r26+vit-b/32": ("b", (2, 2, 2, 2), 1, 0.0),
    "r26+vit-s/32": ("s", (2, 2, 2, 2), 1, 0.0),
    "r50+vit-l/32": ("l", (3, 4, 6, 3), 1, 0.1),
    "r+vit-ti/16": ("ti", (), 8, 0.0),
}
# depth -> blocks per stage of the bottleneck ResNets (BiT and standard); 26 is HF's / the hybrids'.
RESNETS: dict[int, tuple[int, ...]] = {
    26: (2, 2, 2, 2),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
}
# depth -> (blocks per stage, block) of the standard ResNets (torchvision's five plus HF's resnet-26).
STANDARD_RESNETS: dict[int, tuple[tuple[int, ...], str]] = {
    18: ((2, 2, 2, 2), "basic"),
    26: ((2, 2, 2, 2), "bottleneck"),
    34: ((3, 4, 6, 3), "basic"),
    50: ((3, 4, 6, 3), "bottleneck"),
    101: ((3, 4, 23, 3), "bottleneck"),
    152: ((3, 8, 36, 3), "bottleneck"),
}
# The released BiT sizes (big_transfer KNOWN_MODELS) plus the R26 of the ViT hybrids; listed by `vitlab models`.
BIT_LISTED = ((26, 1), (50, 1), (50, 3), (101, 1), (101, 3), (152, 2), (152, 4))
_RESNET_FIELDS = ("layers", "width_factor", "base_width", "stem", "block", "ws_eps")

_VIT_RE = re.compile(r"^vit-(mu|ti|s|b|l|h)/(\d+)(-gap)?$")
_RESNET_RE = re.compile(r"^resnet-(\d+)(-small)?$")
_OLD_RESNET_RE = re.compile(r"^resnet-(\d+)x(\d+)(-small)?$")
_BIT_RE = re.compile(r"^bit-r(\d+)x(\d+)(-postact)?(-small)?$")


def normalize_name(name: str) -> str:
    """'ViT-B_16' and 'vit_b/16' -> 'vit-b/16'; 'R50+ViT-B_16' -> 'r50+vit-b/16'; the peers' ResNet names:
    timm/torchvision 'resnet50' -> 'resnet-50', timm 'resnetv2_50x1_bit' and big_transfer 'BiT-M-R50x1' -> 'bit-r50x1';
    timm's ViT names 'vit_base_patch16_384' -> 'vit-b/16' and 'vit_base_r50_s16_384' -> 'r50+vit-b/16' (peer_names:
    the size they state is `image_size_of`'s)."""
    peer = peer_names.timm_name(name)
    if peer is not None and peer.tag is None:
        return peer.model
    n = name.strip().lower()
    if m := re.match(r"^(?:resnetv2_(\d+)x(\d+)_bit|bit-[sm]-r(\d+)x(\d+))$", n):
        depth, width = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        return f"bit-r{depth}x{width}"
    n = n.replace("vit_", "vit-").replace("resnet_", "resnet-")
    n = re.sub(r"^resnet(\d+)$", r"resnet-\1", n)
    n = re.sub(r"(vit-[a-z]+)_(\d+)", r"\1/\2", n)
    return n


def model_names() -> list[str]:
    """Every registered name, in the order of the paper's tables."""
    names = [f"vit-{s}/{p}" for s in VIT_SIZES if s != "mu" for p in PATCH_SIZES]
    names.append("vit-b/16-gap")
    names += list(HYBRIDS)
    names += [f"resnet-{d}" for d in STANDARD_RESNETS]
    names += [f"bit-r{d}x{w}" for d, w in BIT_LISTED]
    names += [f"bit-r{d}x1-postact" for d in RESNETS]
    return names


def _old_resnet_hint(name: str, depth: int, width: int, small: str) -> VitlabError:
    return VitlabError(
        f"{name!r} is an old BiT name: 'resnet-N' now means the standard torchvision ResNet; use "
        f"'bit-r{depth}x{width}{small}' (pre-activation BiT) or 'bit-r{depth}x{width}-postact{small}' "
        "(the ViT code's post-activation units, what the old name built)"
    )


def _merged_resnet(resnet: dict[str, Any], overrides: dict[str, Any]) -> ResNetConfig:
    """A named model's ResNet config with the overrides' ResNet fields (`layers=`, `base_width=`, `width_factor=`,
    `stem=`, `ws_eps=` ...) and a `resnet={...}` mapping (from a YAML config) merged in, taken out of `overrides`.
    (A hybrid's `resnet={...}` used to replace its stem whole: R50's three stages became the default four.)"""
    for key in _RESNET_FIELDS:
        if key in overrides:
            resnet[key] = overrides.pop(key)
    if isinstance(overrides.get("resnet"), dict):
        resnet.update(overrides.pop("resnet"))
    return ResNetConfig.from_dict(resnet)


def _resnet_base(name: str, resnet: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A ResNet classifier config; `layers=`, `base_width=`, `width_factor=`, `stem=` ... reach the ResNetConfig."""
    return ViTConfig(name=name, arch="resnet", resnet=_merged_resnet(resnet, overrides), patch_size=1).to_dict()


def _suggest(name: str, written: str | None = None) -> str:
    """' (did you mean ...?)' with the registered names closest to `name`, or ''; a name `written` in timm's
    spelling (`vit_bsae_patch16_224`) is matched against timm's names of the same models."""
    if written is not None and written.strip().lower().startswith("vit_"):
        close = difflib.get_close_matches(written.strip().lower(), peer_names.timm_architecture_names(), n=3,
                                          cutoff=0.8)
        if close:
            return f" (did you mean {' or '.join(repr(c) for c in close)}?)"
    close = difflib.get_close_matches(name, model_names() + [f"vit-mu/{p}" for p in PATCH_SIZES], n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _unpublished_patch(name: str, size: str, patch: int) -> VitlabError:
    """A named ViT with a patch size no paper or peer uses is most likely a typo (vit-b/61 for vit-b/16)."""
    hint = _suggest(normalize_name(name)) or f" (e.g. 'vit-{size}/16')"
    return VitlabError(
        f"unknown model {name!r}: patch size {patch} is not one of the published {', '.join(map(str, PATCH_SIZES))}"
        f"{hint}; for another patch size use 'custom' with patch_size={patch} (and dim, depth, heads, mlp_dim)"
    )


def get_config(name: str, **overrides: Any) -> ViTConfig:
    """The config of a named model with field overrides applied (an explicit `patch_size=` is free)."""
    n = normalize_name(name)
    overrides = canonical_fields(overrides)
    named_size = None
    if "image_size" not in overrides and (size := peer_names.image_size_of(name)) is not None:
        overrides["image_size"] = named_size = size  # timm's vit_base_patch16_384 is vit-b/16 at 384
    if n == "custom":
        base = ViTConfig(name="custom").to_dict()
    elif m := _VIT_RE.match(n):
        size, patch = m.group(1), int(m.group(2))
        if patch not in PATCH_SIZES:
            raise _unpublished_patch(name, size, patch)
        depth, dim, mlp, heads = VIT_SIZES[size]
        base = ViTConfig(
            name=n, patch_size=patch, depth=depth, dim=dim, mlp_dim=mlp, heads=heads,
            classifier="gap" if m.group(3) else "token",
            dropout=0.1 if (size, patch) in _DROPOUT_01 else 0.0,
        ).to_dict()
    elif n in HYBRIDS:
        size, layers, patch, dropout = HYBRIDS[n]
        depth, dim, mlp, heads = VIT_SIZES[size]
        base = ViTConfig(
            name=n, patch_size=patch, depth=depth, dim=dim, mlp_dim=mlp, heads=heads,
            dropout=dropout, resnet=_merged_resnet({"layers": layers}, overrides),
        ).to_dict()
    elif m := _RESNET_RE.match(n):
        depth, small = int(m.group(1)), m.group(2) or ""
        if depth not in STANDARD_RESNETS:
            raise VitlabError(f"unknown ResNet depth {depth}; choose one of {sorted(STANDARD_RESNETS)} "
                              "(resnet-N is the standard torchvision ResNet; BiT: bit-rNxW)")
        layers, block = STANDARD_RESNETS[depth]
        resnet = {"layers": layers, "block": block, "kind": "standard", "stem": "small" if small else "bit"}
        base = _resnet_base(n, resnet, overrides)
    elif m := _OLD_RESNET_RE.match(n):
        raise _old_resnet_hint(name, int(m.group(1)), int(m.group(2)), m.group(3) or "")
    elif m := _BIT_RE.match(n):
        depth, width = int(m.group(1)), int(m.group(2))
        if depth not in RESNETS:
            raise VitlabError(f"unknown BiT ResNet depth {depth}; choose one of {sorted(RESNETS)}")
        resnet = {"layers": RESNETS[depth], "width_factor": width, "kind": "bit-post" if m.group(3) else "bit",
                  "stem": "small" if m.group(4) else "bit"}
        base = _resnet_base(n, resnet, overrides)
    else:
        raise VitlabError(_checkpoint_not_model(name) or (
            f"unknown model {name!r}{_suggest(n, name)}; run `vitlab models` for the list "
            "(e.g. vit-b/16, vit-s/32-gap, r50+vit-b/16, resnet-50, bit-r152x2, bit-r50x1-postact, custom; timm's "
            "vit_base_patch16_224 and Hugging Face's google/vit-base-patch16-224 name the same models)"
        ))
    if named_size is not None:
        stride = ViTConfig.from_dict({**base, **overrides, "image_size": 224 * 16}).stride
        if named_size % stride:  # a typo in the size a timm name states (vit_base_patch16_2244), not a size to fix
            raise VitlabError(f"unknown model {name!r}: the image size its name states ({named_size}) is not a "
                              f"multiple of the model's stride {stride}{_suggest(n, name)}")
    base.update(overrides)
    return ViTConfig.from_dict(base)


def _checkpoint_not_model(name: str) -> str | None:
    """The message for a checkpoint name (vitlab's, timm's, a Hugging Face repo) given where a model name belongs."""
    from vitlab.weights.pretrained import lookup

    entry = lookup(name)
    if entry is None:
        return None
    return (f"{name!r} names a checkpoint ({entry.name}), not a model: create_model({name!r}, pretrained=True) or "
            f"vitlab.load({name!r}) loads it; the model alone is {entry.model!r}")


def build_model(config: ViTConfig) -> nn.Module:
    """The module for a config: VisionTransformer (plain or hybrid) or a ResNet classifier of its kind."""
    if config.arch == "resnet":
        kind = config.resnet.kind
        if kind == "standard":
            from vitlab.models.resnet_standard import StandardResNet

            return StandardResNet(config)
        if kind == "bit":
            from vitlab.models.bit import BiTResNet

            return BiTResNet(config)
        from vitlab.models.resnet import ResNet

        return ResNet(config)
    from vitlab.models.vit import VisionTransformer

    return VisionTransformer(config)


def build_unfilled(config: ViTConfig) -> nn.Module:
    """`build_model` for a loader that then puts in every parameter and stored buffer from a file
    (`load_state_dict(..., assign=True)`). Built on the meta device: no memory and no random initialisation, which
    was most of a load's time (ViT-B/16: 0.77 s with it, 0.09 s without; docs/results/load_time.txt) and moved
    torch's global random stream. The tables a model computes instead of storing (the fixed sin-cos position
    table) are computed for real. A model with any other state a file does not hold is built normally instead,
    so nothing is ever left unfilled."""
    try:
        with torch.device("meta"):
            model = build_model(config)
    except Exception:  # a model whose construction reads values (not possible on meta): the full build, whose
        return build_model(config)  # errors, if any, are the config's own
    compute = getattr(model, "compute_unstored_buffers", None)
    if compute is not None:
        compute()
    return model if not _unfilled_beyond_file(model) else build_model(config)


def _unfilled_beyond_file(model: nn.Module) -> list[str]:
    """The meta tensors of `model` that a strict load of its state dict would not replace: its parameters and
    buffers outside the state dict, and tensors kept as plain attributes."""
    stored = set(model.state_dict())
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    left = [k for k, t in named.items() if t.is_meta and k not in stored]
    for prefix, module in model.named_modules():
        left += [f"{prefix}.{k}" for k, v in vars(module).items() if isinstance(v, torch.Tensor) and v.is_meta]
    return left


def create_model(
    name: str = "vit-b/16",
    num_classes: int | None = None,
    image_size: int | tuple[int, int] | None = None,
    seed: int | None = None,
    pretrained: bool | str | Path = False,
    **overrides: Any,
) -> nn.Module:
    """Build a named model, e.g. `create_model("vit-b/16", num_classes=10, image_size=384)`.

    Small custom models by overrides: `create_model("custom", dim=64, depth=6, heads=4,
    mlp_dim=128, patch_size=4, image_size=28, in_chans=1, num_classes=10)`.
    With `seed`, the initial weights are the same on every call.

    `pretrained` (like timm): True = the model's default published checkpoint, a tag
    ("augreg-in21k-ft-in1k-224") or full name ("vit-b/16.augreg-in21k-ft-in1k-224"), or a weights path.
    The checkpoint's head and size are kept unless `num_classes` (a new zero head) or `image_size`
    (resampled position embeddings) are given; `vitlab models --pretrained` lists the checkpoints.
    Defaults without weights: 1000 classes at 224 px.

    `features_only=True` (timm's): a `models.features.FeatureExtractor` whose forward returns the feature maps of
    `out_indices` (default: a ViT's last 3 blocks, a ResNet's stem and stages); `feature_cfg={"output_fmt": "NLC",
    "norm": True}` for tokens or the final norm.
    """
    from vitlab.models.features import FeatureExtractor, feature_options

    features, overrides = feature_options(overrides)
    model = _create(name, num_classes, image_size, seed, pretrained, overrides)
    return model if features is None else FeatureExtractor(model, **features)


def _create(name: str, num_classes: int | None, image_size: Any, seed: int | None, pretrained: bool | str | Path,
            overrides: dict[str, Any]) -> nn.Module:
    name, pretrained = _checkpoint_as_model(name, pretrained)
    image_size, overrides = size_to_run_at(image_size, overrides)
    overrides = canonical_fields(overrides)
    if pretrained is not False and pretrained is not None:
        return _create_pretrained(name, pretrained, num_classes, image_size, overrides)
    default_size = peer_names.image_size_of(name) or 224  # timm's names state theirs
    config = get_config(name, num_classes=1000 if num_classes is None else num_classes,
                        image_size=default_size if image_size is None else image_size, **overrides)
    if seed is None:
        return build_model(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(config)


def _checkpoint_as_model(name: str, pretrained: bool | str | Path) -> tuple[str, bool | str | Path]:
    """(model name, pretrained) where a checkpoint is named as the model (`vit-b/16.augreg-in21k`, timm's
    `vit_base_patch16_224.augreg_in21k`, a Hugging Face repo id): with pretrained=True it selects that checkpoint;
    without, it is an error rather than the architecture alone (timm builds such a name with its checkpoint's head)."""
    from vitlab.weights.pretrained import lookup, names

    entry = lookup(name)
    if entry is None:
        peer = peer_names.timm_name(name)
        if peer is not None and peer.tag is not None:
            raise VitlabError(f"{name!r} is not a checkpoint vitlab lists (those of {peer.model}: "
                              f"{', '.join(names(peer.model)) or 'none'}); timm's own file loads with "
                              f"vitlab.load('hf:timm/{name.strip()}')")
        return name, pretrained
    if pretrained is not True:
        raise VitlabError(f"{name!r} names a checkpoint ({entry.name}): pass pretrained=True to load it, or the model "
                          f"name alone ({entry.model!r}) for random weights")
    return entry.model, entry.name


def _create_pretrained(name: str, pretrained: bool | str | Path, num_classes: int | None,
                       image_size: int | tuple[int, int] | None, overrides: dict[str, Any]) -> nn.Module:
    """`create_model(name, pretrained=...)`: the checkpoint through `vitlab.load`, checked to be a `name`."""
    from vitlab.weights import load
    from vitlab.weights.pretrained import for_model

    model_name = normalize_name(name)
    get_config(model_name)  # an unknown name fails as usual
    if isinstance(pretrained, Path) or (isinstance(pretrained, str) and Path(pretrained).expanduser().exists()):
        source, label = pretrained, str(pretrained)
    else:
        entry = for_model(model_name, pretrained, peer_names.image_size_of(name))
        source, label = entry.name, entry.name
    model = load(source, num_classes=num_classes, image_size=image_size, **overrides)
    _check_same_architecture(model.config, get_config(model_name), label, model_name)
    return model


def _check_same_architecture(found: ViTConfig, want: ViTConfig, source: str, name: str) -> None:
    """The loaded weights must be the named architecture (width, depth, heads, patch, ResNet stages)."""
    fields = ("arch", "dim", "depth", "heads", "patch_size")
    diff = [f"{f} {getattr(found, f)} != {getattr(want, f)}" for f in fields if getattr(found, f) != getattr(want, f)]
    if (found.resnet is None) != (want.resnet is None) or (
            found.resnet is not None and tuple(found.resnet.layers) != tuple(want.resnet.layers)):
        diff.append("ResNet stages differ")
    if diff:
        raise VitlabError(f"{source} does not hold a {name} ({'; '.join(diff)}); pass the model name that fits "
                          "the weights, or load them with vitlab.load()")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def forward_flops(config: ViTConfig, image_size: tuple[int, int]) -> float:
    """Forward FLOPs of one image of this size: twice `analytic_macs` (what the engines' one-thread rules count)."""
    return 2.0 * analytic_macs(config.replace(image_size=tuple(image_size)))


def analytic_macs(config: ViTConfig) -> int:
    """Multiply-accumulates of one forward pass (linear layers, convolutions and attention matmuls).

    torchvision and timm tables quote this number as "GFLOPS"; a FLOP count is twice it.
    """
    h, w = config.image_size
    if config.arch == "resnet" or config.resnet is not None:
        macs, (fh, fw), chans = _resnet_macs(config.resnet, config.in_chans, (h, w))
    elif config.conv_stem:
        macs, (fh, fw), chans = _conv_stem_macs(config.conv_stem, config.in_chans, (h, w))
    else:
        macs, (fh, fw), chans = 0, (h, w), config.in_chans
    if config.arch == "resnet":
        return macs + chans * config.num_classes
    p = config.patch_size
    gh, gw = fh // p, fw // p
    n_patch = gh * gw
    n = n_patch + config.num_prefix_tokens
    d, m = config.dim, config.mlp_dim
    macs += n_patch * chans * p * p * d
    per_block = 4 * n * d * d + 2 * n * n * d + 2 * n * d * m
    macs += config.depth * per_block
    if config.representation_size:
        macs += d * config.representation_size
    macs += (config.representation_size or d) * config.num_classes
    return macs


def _conv_stem_macs(channels: tuple[int, ...], in_chans: int, size: tuple[int, int]) -> tuple[int, tuple[int, int], int]:
    """The conv stem's 3x3 stride-2 convolutions (padded: each side halves, rounding up)."""
    (h, w), cin, macs = size, in_chans, 0
    for cout in channels:
        h, w = -(-h // 2), -(-w // 2)
        macs += h * w * cin * 9 * cout
        cin = cout
    return macs, (h, w), cin


def _resnet_macs(cfg: ResNetConfig, in_chans: int, size: tuple[int, int]) -> tuple[int, tuple[int, int], int]:
    import math

    def out(s: int, stride: int) -> int:
        return math.ceil(s / stride)

    width = cfg.width
    h, w = size
    k, s = (7, 2) if cfg.stem == "bit" else (3, 1)
    h, w = out(h, s), out(w, s)
    macs = h * w * in_chans * k * k * width
    if cfg.stem == "bit":
        h, w = out(h, 2), out(w, 2)
    chans, e = width, cfg.expansion
    for i, depth in enumerate(cfg.layers):
        f = width * 2**i
        for j in range(depth):
            stride = 2 if (i > 0 and j == 0) else 1
            ho, wo = out(h, stride), out(w, stride)
            if cfg.block == "basic":  # 3x3 (strided) + 3x3
                macs += ho * wo * chans * 9 * f + ho * wo * f * 9 * f
            else:  # 1x1 at the input size, 3x3 (strided, v1.5), 1x1 to e*f
                macs += h * w * chans * f + ho * wo * f * 9 * f + ho * wo * f * e * f
            if chans != e * f or stride != 1:
                macs += ho * wo * chans * e * f
            h, w, chans = ho, wo, e * f
    return macs, (h, w), chans
