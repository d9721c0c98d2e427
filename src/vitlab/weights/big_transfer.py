"""The released BiT checkpoints (google-research/big_transfer `.npz`) <-> vitlab's `BiTResNet`.

The files (`BiT-{S,M}-R{50x1,...,152x4}[-ILSVRC2012].npz`) are flat arrays named as
`bit_pytorch/models.py::ResNetV2.load_from` reads them:
`resnet/root_block/standardized_conv2d/kernel`, `resnet/block{S}/unit{UU}/{a,b,c}/group_norm/{gamma,beta}`,
`.../{a,b,c}/standardized_conv2d/kernel`, `.../a/proj/standardized_conv2d/kernel`,
`resnet/group_norm/{gamma,beta}`, `resnet/head/conv2d/{kernel,bias}`. Kernels are HWIO. Letter `a`
is the unit's first GroupNorm (input width) and 1x1 conv, `b` the 3x3, `c` the last 1x1.
The whole config is read off the key names and shapes; nothing is unpickled.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.models.config import ResNetConfig, ViTConfig

ROOT_KEY = "resnet/root_block/standardized_conv2d/kernel"
HEAD_KERNEL = "resnet/head/conv2d/kernel"
HEAD_BIAS = "resnet/head/conv2d/bias"
_UNIT_RE = re.compile(r"^resnet/block(\d+)/unit(\d+)/")
_BLOCK_RE = re.compile(r"^stages\.(\d+)\.blocks\.(\d+)\.(.+)$")
_LETTER = {"1": "a", "2": "b", "3": "c"}


def is_big_transfer_keys(keys: Any) -> bool:
    """True for the key names of a big_transfer `.npz` (its root conv)."""
    return ROOT_KEY in set(keys)


def is_big_transfer_file(path: str | Path) -> bool:
    """Peek at an `.npz`'s names (no arrays are read) to tell a BiT file from an official ViT one."""
    try:
        with np.load(path, allow_pickle=False) as f:
            return is_big_transfer_keys(f.files)
    except Exception:  # unreadable here: let the official reader produce its one-line error
        return False


def npz_key(key: str) -> str:
    """vitlab (timm-style) parameter name -> big_transfer array name."""
    if key == "stem.conv.weight":
        return ROOT_KEY
    if key in ("norm.weight", "norm.bias"):
        return "resnet/group_norm/" + ("gamma" if key.endswith("weight") else "beta")
    if key == "head.weight":
        return HEAD_KERNEL
    if key == "head.bias":
        return HEAD_BIAS
    m = _BLOCK_RE.match(key)
    if m:
        unit = f"resnet/block{int(m.group(1)) + 1}/unit{int(m.group(2)) + 1:02d}/"
        rest = m.group(3)
        if rest == "downsample.conv.weight":
            return unit + "a/proj/standardized_conv2d/kernel"
        if mm := re.fullmatch(r"conv([123])\.weight", rest):
            return unit + f"{_LETTER[mm.group(1)]}/standardized_conv2d/kernel"
        if mm := re.fullmatch(r"norm([123])\.(weight|bias)", rest):
            return unit + f"{_LETTER[mm.group(1)]}/group_norm/" + ("gamma" if mm.group(2) == "weight" else "beta")
    raise VitlabError(f"no big_transfer name for the parameter {key!r}; is this a BiT ResNet (kind 'bit')?")


def infer_config(arrays: dict[str, np.ndarray], name: str = "big_transfer", **overrides: Any) -> ViTConfig:
    """The BiTResNet config the arrays describe: stem from the root conv, layers from the unit names."""
    root = arrays[ROOT_KEY]
    if root.ndim != 4 or root.shape[0] != root.shape[1] or root.shape[0] not in (7, 3):
        raise VitlabError(f"big_transfer root conv {ROOT_KEY} has shape {root.shape}; expected (7, 7, Cin, width) "
                          "or (3, 3, Cin, width)")
    k, _, in_chans, width = root.shape
    counts: dict[int, int] = {}
    for key in arrays:
        if m := _UNIT_RE.match(key):
            s, u = int(m.group(1)), int(m.group(2))
            counts[s] = max(counts.get(s, 0), u)
    if not counts or sorted(counts) != list(range(1, len(counts) + 1)):
        raise VitlabError(f"big_transfer checkpoint has blocks {sorted(counts)}; expected resnet/block1..blockN")
    # Published widths are 64 x the width factor; any other width is a narrow net of our own export.
    base, factor = (64, width // 64) if width % 64 == 0 else (width, 1)
    num_classes = arrays[HEAD_KERNEL].shape[-1] if HEAD_KERNEL in arrays else 0
    # BiT-HyperRule evaluates ImageNet-sized data at 480 px (ILSVRC2012 fine-tuned files); the
    # upstream models were pre-trained at 224 px.
    image_size = 480 if "ilsvrc2012" in name.lower() else 224
    resnet = ResNetConfig(layers=tuple(counts[s] for s in sorted(counts)), width_factor=factor, base_width=base,
                          stem="bit" if k == 7 else "small", kind="bit")
    config = dict(name=name, arch="resnet", resnet=resnet, in_chans=int(in_chans), num_classes=int(num_classes),
                  image_size=image_size, patch_size=1)
    config.update(overrides)
    return ViTConfig(**config)


def _first(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" ... ({len(items)} in all)" if len(items) > n else "")


def _expected_shapes(config: ViTConfig) -> dict[str, tuple[int, ...]]:
    from vitlab.models.bit import BiTResNet

    with torch.device("meta"):  # shapes only: no memory, no init time even for R152x4
        model = BiTResNet(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def to_state_dict(arrays: dict[str, np.ndarray], config: ViTConfig, source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """big_transfer arrays -> vitlab state dict; one VitlabError for missing, extra or mis-shaped arrays."""
    shapes = _expected_shapes(config)
    names = {npz_key(k): k for k in shapes}
    missing = [n for n in names if n not in arrays]
    extra = [n for n in arrays if n not in names]
    problems = []
    if missing:
        problems.append(f"missing arrays {_first(missing)}")
    if extra:
        problems.append(f"unexpected arrays {_first(extra)}")
    sd, mismatched = {}, []
    for name, key in names.items():
        if name not in arrays:
            continue
        a = np.asarray(arrays[name])
        want = shapes[key]
        if len(want) == 4:  # HWIO -> OIHW
            t = a.transpose(3, 2, 0, 1) if a.ndim == 4 else a
        elif key == "head.weight":  # a 1x1 conv (1, 1, C, K) -> Linear (K, C)
            t = a.reshape(a.shape[-2], a.shape[-1]).T if a.ndim == 4 and a.shape[:2] == (1, 1) else a
        elif a.ndim > 1 and a.size == int(np.prod(want)):  # GroupNorm stored as (1, 1, 1, C)
            t = a.reshape(want)
        else:
            t = a
        if tuple(t.shape) != want:
            mismatched.append(f"{name} (expected {_npz_shape(key, want)}, found {tuple(a.shape)})")
            continue
        sd[key] = torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32))
    if mismatched:
        problems.append(f"shape mismatch {_first(mismatched)}")
    if problems:
        raise VitlabError(f"{source} is not a complete {_describe(config)} big_transfer checkpoint: " + "; ".join(problems))
    return sd


def _npz_shape(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) == 4:
        return (shape[2], shape[3], shape[1], shape[0])
    if key == "head.weight":
        return (1, 1, shape[1], shape[0])
    return shape


def _describe(config: ViTConfig) -> str:
    r = config.resnet
    return f"BiT layers={list(r.layers)} width={r.width}"


def bit_preprocess(config: ViTConfig) -> dict:
    """BiT's evaluation transform: a square resize (warp, no crop) to the model size, values to [-1, 1]."""
    c = config.in_chans
    return {"image_size": list(config.image_size), "mean": [0.5] * c, "std": [0.5] * c, "resize": None,
            "crop_fraction": 1.0, "interpolation": "bilinear", "channels": c}


def read_arrays(arrays: dict[str, np.ndarray], source: str = "checkpoint",
                **overrides: Any) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, state dict, meta) of already-read big_transfer arrays."""
    if not is_big_transfer_keys(arrays):
        raise VitlabError(f"{source} is not a big_transfer BiT checkpoint (no {ROOT_KEY!r})")
    name = Path(source).name
    name = name[:-4] if name.endswith(".npz") else name
    config = infer_config(arrays, name=name or "big_transfer", **overrides)
    sd = to_state_dict(arrays, config, source)
    zero_head = "head.weight" in sd and not torch.any(sd["head.weight"]).item()
    meta = {"format": "big_transfer", "class_names": None, "preprocess": bit_preprocess(config), "zero_head": zero_head}
    return config, sd, meta


def read_big_transfer(path: str | Path, **overrides: Any) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, state dict, meta) of a big_transfer `.npz`, read with pickling disabled."""
    from vitlab.weights.official import read_npz

    return read_arrays(read_npz(path), str(path), **overrides)


def to_big_transfer_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """The exact inverse of the reader: vitlab BiTResNet -> big_transfer arrays (HWIO kernels)."""
    cfg = model.config
    if cfg.arch != "resnet" or cfg.resnet is None or cfg.resnet.kind != "bit":
        raise VitlabError("only BiT ResNets (kind 'bit') can be written as a big_transfer .npz")
    out = {}
    for key, t in model.state_dict().items():
        a = t.detach().cpu().float().numpy()
        if a.ndim == 4:
            a = a.transpose(2, 3, 1, 0)  # OIHW -> HWIO
        elif key == "head.weight":
            a = a.T[None, None]  # Linear (K, C) -> 1x1 conv (1, 1, C, K)
        out[npz_key(key)] = np.ascontiguousarray(a)
    return out


def write_big_transfer(model: nn.Module, path: str | Path) -> Path:
    """Write `model` as a big_transfer `.npz` that bit_pytorch's `load_from` and timm's loader read."""
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **to_big_transfer_arrays(model))
    return path
