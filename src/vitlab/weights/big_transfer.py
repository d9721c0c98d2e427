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
from vitlab.weights.native import default_preprocess

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
    root = tuple(arrays[ROOT_KEY].shape)  # header only: nothing is read to infer the config
    if len(root) != 4 or root[0] != root[1] or root[0] not in (7, 3):
        raise VitlabError(f"big_transfer root conv {ROOT_KEY} has shape {root}; expected (7, 7, Cin, width) "
                          "or (3, 3, Cin, width)")
    k, _, in_chans, width = root
    counts: dict[int, int] = {}
    for key in arrays:
        if m := _UNIT_RE.match(key):
            s, u = int(m.group(1)), int(m.group(2))
            counts[s] = max(counts.get(s, 0), u)
    if not counts or sorted(counts) != list(range(1, len(counts) + 1)):
        raise VitlabError(f"big_transfer checkpoint has blocks {sorted(counts)[:5]}; expected resnet/block1..blockN")
    # Published widths are 64 x the width factor; any other width is a narrow net of our own export.
    base, factor = (64, width // 64) if width % 64 == 0 else (width, 1)
    head = tuple(arrays[HEAD_KERNEL].shape) if HEAD_KERNEL in arrays else ()
    num_classes = head[-1] if head else 0  # a head of another shape is reported by to_state_dict
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


def _npz_fits(shape: tuple[int, ...], key: str, want: tuple[int, ...]) -> bool:
    """Whether an array of `shape` converts to the parameter `key` of shape `want` (header only)."""
    if len(want) == 4:  # HWIO kernels
        return shape == _npz_shape(key, want)
    if key == "head.weight":  # a 1x1 conv (1, 1, C, K), or already a Linear (K, C)
        return shape in (_npz_shape(key, want), want)
    if len(shape) > 1:  # GroupNorm stored as (1, 1, 1, C)
        return int(np.prod(shape)) == int(np.prod(want))
    return shape == want


def _convert(a: np.ndarray, key: str, want: tuple[int, ...]) -> torch.Tensor:
    """A checked array -> the PyTorch layout of `key`."""
    if len(want) == 4:  # HWIO -> OIHW
        a = a.transpose(3, 2, 0, 1)
    elif key == "head.weight" and a.ndim == 4:  # a 1x1 conv (1, 1, C, K) -> Linear (K, C)
        a = a.reshape(a.shape[-2], a.shape[-1]).T
    else:
        a = a.reshape(want)
    # a transposed kernel stays a strided view: the load's own contiguous copy (torch's, multi-threaded) transposes
    # it, instead of numpy first (the big_transfer rows of docs/results/load_time.txt)
    return torch.from_numpy(a).float()


def to_state_dict(arrays: Any, config: ViTConfig, source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """big_transfer arrays -> vitlab state dict; one VitlabError for missing, extra, mis-shaped or
    non-float arrays, found from the headers before any array is read (arrays may be lazy)."""
    shapes = _expected_shapes(config)
    names = {npz_key(k): k for k in shapes}
    missing = [n for n in names if n not in arrays]
    extra = [n for n in arrays if n not in names]
    problems = []
    if missing:
        problems.append(f"missing arrays {_first(missing)}")
    if extra:
        problems.append(f"unexpected arrays {_first(extra)}")
    present = [n for n in names if n in arrays]
    mismatched = [f"{n} (expected {_npz_shape(names[n], shapes[names[n]])}, found {tuple(arrays[n].shape)})"
                  for n in present if not _npz_fits(tuple(arrays[n].shape), names[n], shapes[names[n]])]
    if mismatched:
        problems.append(f"shape mismatch {_first(mismatched)}")
    not_float = [f"{n} ({np.dtype(arrays[n].dtype)})" for n in present if np.dtype(arrays[n].dtype).kind != "f"]
    if not_float:
        problems.append(f"not floating point {_first(not_float)}")
    if problems:
        raise VitlabError(f"{source} is not a complete {_describe(config)} big_transfer checkpoint: " + "; ".join(problems))
    return {names[n]: _convert(np.asarray(arrays[n]), names[n], shapes[names[n]]) for n in present}


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
    """BiT's evaluation transform: a square resize (warp, no crop) to the model size, values to [-1, 1], with
    TensorFlow's `tf.image.resize` (no anti-aliasing; big_transfer's input_pipeline_tf2_or_jax.py)."""
    return default_preprocess(config, antialias=False)


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
    """(config, state dict, meta) of a big_transfer `.npz`, read lazily with pickling disabled: the
    config is bounded, every array checked against it before decompression, nothing unused read."""
    from vitlab.weights.io import NpzArchive

    with NpzArchive(path) as archive:
        return read_arrays(archive, str(path), **overrides)


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
