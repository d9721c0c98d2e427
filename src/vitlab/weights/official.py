"""Official Google ViT `.npz` checkpoints (google-research/vision_transformer and big_vision) -> vitlab.

Handles:
- the released (pre-Linen) naming (`MultiHeadDotProductAttention_1`, `LayerNorm_2`, `MlpBlock_3`)
  and the current Flax Linen naming (`_0`, `_1`, `_0`);
- the `opt/target/`, `params/` and `params/img/` prefixes;
- the big_vision layout: top-level `pos_embedding` without a class slot (the class slot becomes a zero
  row, which equals BV's `fix_old_checkpoints` summing it into `cls`), `gap` and `map` (`MAPHead_0`)
  heads, scan-stacked `Transformer/encoderblock/...`, no stored posemb (fixed sin-cos);
- hybrids: `conv_root`, `gn_root`, `block{s}/unit{u}/{conv,gn}{1,2,3}|conv_proj|gn_proj`, with
  GroupNorm parameters stored as (1, 1, 1, C) squeezed as VT's `_fix_groupnorm`;
- i21k files with `pre_logits` and a zeroed 21843-way head.
The whole model config is inferred from the array shapes.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from vitlab.errors import VitlabError
from vitlab.models.config import ResNetConfig, ViTConfig
from vitlab.models.resnet import resnet_reduction

_PREFIXES = ("opt/target/", "params/img/", "params/")
_GN_RE = re.compile(r"(^|/)gn(\d+|_root|_proj)/(scale|bias)$")


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    """Read a flat `.npz` of arrays with pickling disabled."""
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise
    except Exception as exc:  # zipfile.BadZipFile, ValueError (object arrays), EOFError (truncated)
        raise VitlabError(f"cannot read {path} as an .npz checkpoint ({type(exc).__name__}: {exc}); "
                          "is the file complete?") from exc


def strip_prefix(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Remove the `opt/target/` or `params/` prefix some checkpoints nest everything under."""
    for prefix in _PREFIXES:
        if any(k.startswith(prefix + "embedding/") for k in arrays):
            return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
    return arrays


def normalize(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Prefix removed, GroupNorm (1,1,1,C) squeezed to (C,), scan-stacked blocks split per layer."""
    a = dict(strip_prefix(arrays))
    for k in list(a):
        if _GN_RE.search(k) and a[k].ndim > 1:
            a[k] = a[k].reshape(-1)
    stacked = [k for k in a if k.startswith("Transformer/encoderblock/")]
    if stacked:
        depth = a[stacked[0]].shape[0]
        for k in stacked:
            arr = a.pop(k)
            rest = k[len("Transformer/encoderblock/"):]
            for i in range(depth):
                a[f"Transformer/encoderblock_{i}/{rest}"] = arr[i]
    return a


def is_official_npz(arrays: dict[str, np.ndarray]) -> bool:
    return "embedding/kernel" in strip_prefix(arrays)


def is_big_vision(a: dict[str, np.ndarray]) -> bool:
    """big_vision layout: top-level posemb (or none at all) or a MAP head."""
    return "Transformer/posembed_input/pos_embedding" not in a


def block_names(arrays: dict[str, np.ndarray]) -> tuple[str, str, str]:
    """(attention, second LayerNorm, MLP) module names: released pre-Linen or current Linen."""
    if any("/MultiHeadDotProductAttention_1/" in k and k.startswith("Transformer/") for k in arrays):
        return "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3"
    return "MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0"


def _posemb(a: dict[str, np.ndarray]) -> np.ndarray | None:
    return a.get("Transformer/posembed_input/pos_embedding", a.get("pos_embedding"))


def _resnet_config(a: dict[str, np.ndarray]) -> ResNetConfig | None:
    if "conv_root/kernel" not in a:
        return None
    kh, _, _, width = a["conv_root/kernel"].shape
    counts: dict[int, int] = {}
    for k in a:
        if m := re.match(r"block(\d+)/unit(\d+)/", k):
            s, u = int(m.group(1)), int(m.group(2))
            counts[s] = max(counts.get(s, 0), u)
    if sorted(counts) != list(range(1, len(counts) + 1)):
        raise VitlabError(f"hybrid checkpoint has ResNet stages {sorted(counts)}; expected block1..blockN")
    return ResNetConfig(layers=tuple(counts[s] for s in sorted(counts)), width_factor=width // 64,
                        stem="bit" if kh == 7 else "small")


def infer_config(arrays: dict[str, np.ndarray], **overrides) -> ViTConfig:
    """Read the model config off the checkpoint's shapes."""
    a = normalize(arrays)
    kh, kw, cin, dim = a["embedding/kernel"].shape
    if kh != kw:
        raise VitlabError(f"non-square patches {kh}x{kw} are not supported")
    resnet = _resnet_config(a)
    if resnet is not None:
        cin = a["conv_root/kernel"].shape[2]
    blocks = [int(m.group(1)) for k in a if (m := re.match(r"Transformer/encoderblock_(\d+)/", k))]
    if not blocks:
        raise VitlabError("official checkpoint has no Transformer/encoderblock_N arrays")
    depth = 1 + max(blocks)
    attn, _, mlp = block_names(a)
    heads = a[f"Transformer/encoderblock_0/{attn}/query/kernel"].shape[1]
    mlp_dim = a[f"Transformer/encoderblock_0/{mlp}/Dense_0/kernel"].shape[1]
    token = "cls" in a
    classifier = "token" if token else ("map" if "MAPHead_0/probe" in a else "gap")
    stride = kh * (resnet_reduction(resnet) if resnet else 1)
    posemb = _posemb(a)
    config = dict(
        name="official-npz", patch_size=kh, in_chans=cin, dim=dim, depth=depth, heads=heads, mlp_dim=mlp_dim,
        classifier=classifier, resnet=resnet,
        representation_size=a["pre_logits/kernel"].shape[1] if "pre_logits/kernel" in a else None,
        num_classes=a["head/kernel"].shape[1] if "head/kernel" in a else 0,
        posemb="learn" if posemb is not None else "sincos2d",
    )
    if posemb is not None:
        n_patch = posemb.shape[1]
        if token and int(round((n_patch - 1) ** 0.5)) ** 2 == n_patch - 1:
            n_patch -= 1  # a class slot is stored
        side = int(round(n_patch**0.5))
        if side * side != n_patch:
            raise VitlabError(f"position embedding with {n_patch} patch slots is not a square grid")
        config["image_size"] = side * stride
    else:
        config["image_size"] = 224  # big_vision's default; pass image_size= for another grid
    config.update(overrides)
    return ViTConfig(**config)


def _t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).float()


def _conv(x: np.ndarray) -> torch.Tensor:
    """flax conv kernel (kH, kW, Cin, Cout) -> PyTorch (Cout, Cin, kH, kW)."""
    return _t(x.transpose(3, 2, 0, 1))


def _attention(a: dict[str, np.ndarray], p: str, dim: int) -> dict[str, torch.Tensor]:
    """q/k/v/out DenseGenerals under prefix `p` -> PyTorch (out, in) matrices."""
    def w(n):
        return _t(a[f"{p}{n}/kernel"].reshape(dim, -1).T)

    def b(n):
        return _t(a[f"{p}{n}/bias"].reshape(-1))

    return {"q.w": w("query"), "k.w": w("key"), "v.w": w("value"), "q.b": b("query"), "k.b": b("key"), "v.b": b("value"),
            "o.w": _t(a[f"{p}out/kernel"].reshape(-1, dim).T), "o.b": _t(a[f"{p}out/bias"])}


def _hybrid_state_dict(a: dict[str, np.ndarray], resnet: ResNetConfig) -> dict[str, torch.Tensor]:
    pre = "patch_embed.backbone."
    sd = {pre + "stem.conv.weight": _conv(a["conv_root/kernel"]),
          pre + "stem.norm.weight": _t(a["gn_root/scale"]), pre + "stem.norm.bias": _t(a["gn_root/bias"])}
    for s, n in enumerate(resnet.layers):
        for u in range(n):
            src, dst = f"block{s + 1}/unit{u + 1}/", f"{pre}stages.{s}.blocks.{u}."
            for r in (1, 2, 3):
                sd[f"{dst}conv{r}.weight"] = _conv(a[f"{src}conv{r}/kernel"])
                sd[f"{dst}norm{r}.weight"] = _t(a[f"{src}gn{r}/scale"])
                sd[f"{dst}norm{r}.bias"] = _t(a[f"{src}gn{r}/bias"])
            if f"{src}conv_proj/kernel" in a:
                sd[f"{dst}downsample.conv.weight"] = _conv(a[f"{src}conv_proj/kernel"])
                sd[f"{dst}downsample.norm.weight"] = _t(a[f"{src}gn_proj/scale"])
                sd[f"{dst}downsample.norm.bias"] = _t(a[f"{src}gn_proj/bias"])
    return sd


def to_state_dict(arrays: dict[str, np.ndarray], config: ViTConfig) -> dict[str, torch.Tensor]:
    """Map official arrays to vitlab (timm) names and PyTorch layouts."""
    a = normalize(arrays)
    attn, ln2, mlp = block_names(a)
    d = config.dim
    sd = {
        "patch_embed.proj.weight": _conv(a["embedding/kernel"]),
        "patch_embed.proj.bias": _t(a["embedding/bias"]),
        "norm.weight": _t(a["Transformer/encoder_norm/scale"]),
        "norm.bias": _t(a["Transformer/encoder_norm/bias"]),
    }
    if config.resnet is not None:
        sd.update(_hybrid_state_dict(a, config.resnet))
    posemb = _posemb(a)
    if posemb is not None:
        pe = _t(posemb)
        gh, gw = config.grid_size
        if config.num_prefix_tokens and pe.shape[1] == gh * gw:
            # big_vision adds posemb to the patches only: a zero class slot is the same model.
            pe = torch.cat([pe.new_zeros(1, 1, pe.shape[2]), pe], dim=1)
        sd["pos_embed"] = pe
    if "cls" in a:
        sd["cls_token"] = _t(a["cls"])
    for i in range(config.depth):
        p, q = f"Transformer/encoderblock_{i}/", f"blocks.{i}."
        sd[q + "norm1.weight"] = _t(a[p + "LayerNorm_0/scale"])
        sd[q + "norm1.bias"] = _t(a[p + "LayerNorm_0/bias"])
        at = _attention(a, f"{p}{attn}/", d)
        # (D, heads, head_dim) kernels -> (heads*head_dim, D) rows, stacked q, k, v.
        sd[q + "attn.qkv.weight"] = torch.cat([at["q.w"], at["k.w"], at["v.w"]])
        sd[q + "attn.qkv.bias"] = torch.cat([at["q.b"], at["k.b"], at["v.b"]])
        sd[q + "attn.proj.weight"], sd[q + "attn.proj.bias"] = at["o.w"], at["o.b"]
        sd[q + "norm2.weight"] = _t(a[f"{p}{ln2}/scale"])
        sd[q + "norm2.bias"] = _t(a[f"{p}{ln2}/bias"])
        for j, name in ((0, "fc1"), (1, "fc2")):
            sd[f"{q}mlp.{name}.weight"] = _t(a[f"{p}{mlp}/Dense_{j}/kernel"].T)
            sd[f"{q}mlp.{name}.bias"] = _t(a[f"{p}{mlp}/Dense_{j}/bias"])
    if config.classifier == "map":
        p = "MAPHead_0/"
        at = _attention(a, p + "MultiHeadDotProductAttention_0/", d)
        sd.update({
            "attn_pool.latent": _t(a[p + "probe"]),
            "attn_pool.q.weight": at["q.w"], "attn_pool.q.bias": at["q.b"],
            "attn_pool.kv.weight": torch.cat([at["k.w"], at["v.w"]]), "attn_pool.kv.bias": torch.cat([at["k.b"], at["v.b"]]),
            "attn_pool.proj.weight": at["o.w"], "attn_pool.proj.bias": at["o.b"],
            "attn_pool.norm.weight": _t(a[p + "LayerNorm_0/scale"]), "attn_pool.norm.bias": _t(a[p + "LayerNorm_0/bias"]),
        })
        for j, name in ((0, "fc1"), (1, "fc2")):
            sd[f"attn_pool.mlp.{name}.weight"] = _t(a[f"{p}MlpBlock_0/Dense_{j}/kernel"].T)
            sd[f"attn_pool.mlp.{name}.bias"] = _t(a[f"{p}MlpBlock_0/Dense_{j}/bias"])
    if config.representation_size:
        sd["pre_logits.fc.weight"] = _t(a["pre_logits/kernel"].T)
        sd["pre_logits.fc.bias"] = _t(a["pre_logits/bias"])
    if config.num_classes and "head/kernel" in a:
        sd["head.weight"] = _t(a["head/kernel"].T)
        sd["head.bias"] = _t(a["head/bias"])
    return sd


def read_official(path: str | Path, **overrides) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, state dict, meta) of an official ViT / hybrid / big_vision `.npz`."""
    arrays = read_npz(path)
    from vitlab.weights import big_transfer

    if big_transfer.is_big_transfer_keys(arrays):  # a released BiT ResNet, not a ViT
        return big_transfer.read_arrays(arrays, str(path), **overrides)
    if not is_official_npz(arrays):
        raise VitlabError(f"{path} is an .npz but not an official ViT checkpoint (no 'embedding/kernel')")
    try:
        config = infer_config(arrays, **overrides)
        sd = to_state_dict(arrays, config)
    except KeyError as exc:
        raise VitlabError(f"{path} lacks the array {exc.args[0]!r} an official ViT checkpoint has; is it complete?") from exc
    a = strip_prefix(arrays)
    zero_head = "head/kernel" in a and not np.any(a["head/kernel"])
    c = config.in_chans
    pre = {"image_size": list(config.image_size), "mean": [0.5] * c, "std": [0.5] * c, "resize": None,
           "crop_fraction": 1.0, "interpolation": "bilinear", "channels": c}
    meta = {"format": "big_vision" if is_big_vision(normalize(arrays)) else "official", "class_names": None,
            "preprocess": pre, "zero_head": zero_head}
    return config, sd, meta
