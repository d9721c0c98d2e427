"""Official Google ViT `.npz` checkpoints (google-research/vision_transformer) -> vitlab.

Handles the released (pre-Linen) naming (`MultiHeadDotProductAttention_1`, `LayerNorm_2`,
`MlpBlock_3`) and the current Flax Linen naming (`_0`, `_1`, `_0`), the `opt/target/` prefix, and
infers the whole model config from the array shapes.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from vitlab.errors import VitlabError
from vitlab.models.config import ViTConfig

_PREFIXES = ("opt/target/", "params/img/", "params/")


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


def is_official_npz(arrays: dict[str, np.ndarray]) -> bool:
    return "embedding/kernel" in strip_prefix(arrays)


def block_names(arrays: dict[str, np.ndarray]) -> tuple[str, str, str]:
    """(attention, second LayerNorm, MLP) module names: released pre-Linen or current Linen."""
    if any("MultiHeadDotProductAttention_1/" in k for k in arrays):
        return "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3"
    return "MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0"


def infer_config(arrays: dict[str, np.ndarray], **overrides) -> ViTConfig:
    """Read the model config off the checkpoint's shapes."""
    a = strip_prefix(arrays)
    kh, kw, cin, dim = a["embedding/kernel"].shape
    if kh != kw:
        raise VitlabError(f"non-square patches {kh}x{kw} are not supported")
    depth = 1 + max(int(m.group(1)) for k in a if (m := re.match(r"Transformer/encoderblock_(\d+)/", k)))
    attn, _, mlp = block_names(a)
    heads = a[f"Transformer/encoderblock_0/{attn}/query/kernel"].shape[1]
    mlp_dim = a[f"Transformer/encoderblock_0/{mlp}/Dense_0/kernel"].shape[1]
    token = "cls" in a
    posemb = a.get("Transformer/posembed_input/pos_embedding")
    n_patch = posemb.shape[1] - (1 if token else 0)
    side = int(round(n_patch**0.5))
    if side * side != n_patch:
        raise VitlabError(f"position embedding with {n_patch} patch slots is not a square grid")
    head = a.get("head/kernel")
    rep = a["pre_logits/kernel"].shape[1] if "pre_logits/kernel" in a else None
    config = dict(
        name="official-npz", image_size=side * kh, patch_size=kh, in_chans=cin, dim=dim, depth=depth,
        heads=heads, mlp_dim=mlp_dim, classifier="token" if token else "gap",
        representation_size=rep, num_classes=head.shape[1] if head is not None else 0,
    )
    config.update(overrides)
    return ViTConfig(**config)


def to_state_dict(arrays: dict[str, np.ndarray], config: ViTConfig) -> dict[str, torch.Tensor]:
    """Map official arrays to vitlab (timm) names and PyTorch layouts."""
    a = strip_prefix(arrays)
    attn, ln2, mlp = block_names(a)

    def t(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).float()

    sd = {
        "patch_embed.proj.weight": t(a["embedding/kernel"].transpose(3, 2, 0, 1)),
        "patch_embed.proj.bias": t(a["embedding/bias"]),
        "pos_embed": t(a["Transformer/posembed_input/pos_embedding"]),
        "norm.weight": t(a["Transformer/encoder_norm/scale"]),
        "norm.bias": t(a["Transformer/encoder_norm/bias"]),
    }
    if "cls" in a:
        sd["cls_token"] = t(a["cls"])
    for i in range(config.depth):
        p, q = f"Transformer/encoderblock_{i}/", f"blocks.{i}."
        d = config.dim
        sd[q + "norm1.weight"] = t(a[p + "LayerNorm_0/scale"])
        sd[q + "norm1.bias"] = t(a[p + "LayerNorm_0/bias"])
        # (D, heads, head_dim) kernels -> (heads*head_dim, D) rows, stacked q, k, v.
        sd[q + "attn.qkv.weight"] = torch.cat([t(a[f"{p}{attn}/{n}/kernel"].reshape(d, -1).T) for n in ("query", "key", "value")])
        sd[q + "attn.qkv.bias"] = torch.cat([t(a[f"{p}{attn}/{n}/bias"].reshape(-1)) for n in ("query", "key", "value")])
        sd[q + "attn.proj.weight"] = t(a[f"{p}{attn}/out/kernel"].reshape(-1, d).T)
        sd[q + "attn.proj.bias"] = t(a[f"{p}{attn}/out/bias"])
        sd[q + "norm2.weight"] = t(a[f"{p}{ln2}/scale"])
        sd[q + "norm2.bias"] = t(a[f"{p}{ln2}/bias"])
        for j, name in ((0, "fc1"), (1, "fc2")):
            sd[f"{q}mlp.{name}.weight"] = t(a[f"{p}{mlp}/Dense_{j}/kernel"].T)
            sd[f"{q}mlp.{name}.bias"] = t(a[f"{p}{mlp}/Dense_{j}/bias"])
    if config.representation_size:
        sd["pre_logits.fc.weight"] = t(a["pre_logits/kernel"].T)
        sd["pre_logits.fc.bias"] = t(a["pre_logits/bias"])
    if config.num_classes and "head/kernel" in a:
        sd["head.weight"] = t(a["head/kernel"].T)
        sd["head.bias"] = t(a["head/bias"])
    return sd


def read_official(path: str | Path, **overrides) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, state dict, meta) of an official `.npz`."""
    arrays = read_npz(path)
    if not is_official_npz(arrays):
        raise VitlabError(f"{path} is an .npz but not an official ViT checkpoint (no 'embedding/kernel')")
    config = infer_config(arrays, **overrides)
    return config, to_state_dict(arrays, config), {"format": "official", "class_names": None}
