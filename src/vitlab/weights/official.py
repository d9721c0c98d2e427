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
- i21k files with `pre_logits` and a zeroed 21843-way head;
- one parameter set per file: arrays the model does not use are refused, except what genuine checkpoints carry
  beside their parameters (optimizer state `opt/...`, big_vision's `chrono/...`, a two-tower file's other
  tower), which is never read (docs/weights.md, "what else a file may hold").
The whole model config is inferred from the array shapes, validated against the documented limits
and checked against every array's header before anything is decompressed (docs/weights.md, Limits).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitlab.errors import VitlabError
from vitlab.limits import check_size_pair
from vitlab.models.config import ResNetConfig, ViTConfig
from vitlab.models.resnet import resnet_channels, resnet_reduction
from vitlab.weights.io import NpzArchive
from vitlab.weights.limits import MAX_DEPTH
from vitlab.weights.native import default_preprocess

# Where a file keeps its parameter set: nowhere (the released files), under `opt/target/` (a Flax optimizer
# checkpoint: `opt/state/...` beside it), `params/` (a big_vision train state: `opt/...` optax state and
# `chrono/...` beside it) or `params/img/` (the image tower of a two-tower model such as SigLIP or LiT).
_PREFIXES = ("opt/target/", "params/img/", "params/")
_ROOTS = ("", *_PREFIXES)
# Arrays that genuine checkpoints carry next to the parameters and that are deliberately not read (the official
# loaders drop them too: big_vision `utils.load_params` keeps only `params` / `opt/target`): optimizer state
# and big_vision's training clock. They are never decompressed.
_TRAIN_STATE = ("opt/", "chrono/")
# Arrays of the parameter set that the model being built may leave out on purpose: the official fine-tuning
# code (`checkpoint.load_pretrained`) drops `pre_logits` and replaces `head` when the config asks for it.
_DROPPABLE = ("pre_logits/kernel", "pre_logits/bias", "head/kernel", "head/bias")
_GN_RE = re.compile(r"(^|/)gn(\d+|_root|_proj)/(scale|bias)$")
_STACKED = "Transformer/encoderblock/"

# name -> array (numpy, or a lazy `io.LazyArray` that is read only when converted)
Arrays = Mapping[str, Any]


def read_npz(path: str | Path) -> NpzArchive:
    """A flat `.npz` as a lazy mapping (pickling disabled): arrays are decompressed only when used,
    each after its declared size was checked against its header (`io.NpzArchive`)."""
    return NpzArchive(path)


def parameter_root(arrays: Arrays) -> str:
    """The prefix of the file's one parameter set ('' for none). A file holding two sets (say an unprefixed one
    and a `params/` one) is refused: which of them is the model cannot be told, and picking one would be a guess."""
    roots = [r for r in _ROOTS if r + "embedding/kernel" in arrays]
    if len(roots) > 1:
        # params/img/ nests inside params/: a params/img/ tower next to a params/ set is still two sets
        named = ", ".join(repr(r or "unprefixed") for r in roots)
        raise VitlabError(f"the checkpoint holds {len(roots)} ViT parameter sets ({named}: each has an "
                          "embedding/kernel), so which one is the model is ambiguous; save the one you mean alone")
    if roots:
        return roots[0]
    # no embedding/kernel anywhere: keep the old rule (the first prefix anything is nested under) for the message
    return next((p for p in _PREFIXES if any(k.startswith(p + "embedding/") for k in arrays)), "")


def strip_prefix(arrays: Arrays) -> dict[str, Any]:
    """The file's parameter set with its `opt/target/`, `params/` or `params/img/` prefix removed."""
    prefix = parameter_root(arrays)
    if not prefix:
        return dict(arrays.items())
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def _ignored(key: str, prefix: str) -> bool:
    """True for an array of a genuine checkpoint that is not part of the parameter set (see _TRAIN_STATE), and for
    the other towers of a two-tower file (`params/txt/...`, `params/t`, `params/b` next to `params/img/`)."""
    if key.startswith(_TRAIN_STATE) and not key.startswith("opt/target/"):
        return True
    if prefix == "params/img/" and key.startswith("params/") and not key.startswith(prefix):
        return True
    return False


def unexpected_arrays(arrays: Arrays, want: Mapping[str, Any]) -> list[str]:
    """The file's arrays (names as stored) that neither the model `want` describes nor the deliberate exceptions
    cover: the official `.npz` counterpart of a state dict's unexpected keys. Names only; nothing is read."""
    prefix = parameter_root(arrays)
    out = []
    for key in arrays:
        if not key.startswith(prefix):
            if not _ignored(key, prefix):
                out.append(key)
            continue
        name = key[len(prefix):]
        if name.startswith(_STACKED):  # scan-stacked: one array stands for every layer's
            name = "Transformer/encoderblock_0/" + name[len(_STACKED):]
        if name not in want and name not in _DROPPABLE and not _ignored(key, prefix):
            out.append(key)
    return sorted(out)


def _stacked_depth(a: dict[str, Any], stacked: list[str]) -> int:
    """The layer count of scan-stacked blocks: the same leading axis on every array, within MAX_DEPTH
    (checked before splitting: a (30000000, 0) array would otherwise become 30 million views)."""
    lengths = {k: (a[k].shape[0] if a[k].ndim else 0) for k in stacked}
    longest = max(lengths, key=lengths.__getitem__)
    if len(set(lengths.values())) != 1 or not 1 <= lengths[longest] <= MAX_DEPTH:
        raise VitlabError(f"scan-stacked blocks must share one layer axis of 1 to {MAX_DEPTH} layers (docs/weights.md, "
                          f"Limits), found {sorted(set(lengths.values()))[:4]} (e.g. {longest}: "
                          f"{tuple(a[longest].shape)}); the file is damaged or not a ViT checkpoint")
    return lengths[longest]


def normalize(arrays: Arrays) -> dict[str, Any]:
    """Prefix removed, GroupNorm (1,1,1,C) squeezed to (C,), scan-stacked blocks split per layer.

    Only shapes are looked at: lazy arrays stay unread."""
    a = strip_prefix(arrays)
    for k in list(a):
        if _GN_RE.search(k) and a[k].ndim > 1:
            a[k] = a[k].reshape(-1)
    stacked = [k for k in a if k.startswith(_STACKED)]
    if stacked:
        depth = _stacked_depth(a, stacked)
        for k in stacked:
            arr = a.pop(k)
            rest = k[len(_STACKED):]
            for i in range(depth):
                a[f"Transformer/encoderblock_{i}/{rest}"] = arr[i]
    return a


def is_official_npz(arrays: Arrays) -> bool:
    return "embedding/kernel" in strip_prefix(arrays)


def is_big_vision(a: Arrays) -> bool:
    """big_vision layout: top-level posemb (or none at all) or a MAP head."""
    return "Transformer/posembed_input/pos_embedding" not in a


def block_names(arrays: Arrays) -> tuple[str, str, str]:
    """(attention, second LayerNorm, MLP) module names: released pre-Linen or current Linen."""
    if any("/MultiHeadDotProductAttention_1/" in k and k.startswith("Transformer/") for k in arrays):
        return "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3"
    return "MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0"


def _posemb_key(a: Arrays) -> str | None:
    for key in ("Transformer/posembed_input/pos_embedding", "pos_embedding"):
        if key in a:
            return key
    return None


def _shape(a: Arrays, key: str, ndim: int) -> tuple[int, ...]:
    """The shape of `a[key]` (header only for lazy arrays), refused unless it has `ndim` axes."""
    shape = tuple(int(n) for n in a[key].shape)
    if len(shape) != ndim:
        raise VitlabError(f"official checkpoint array {key!r} has shape {shape}; expected {ndim} axes")
    return shape


def _width_factor(width: int) -> int | float:
    """The official root width is int(64 * width_factor) (models_vit.py): width / 64 gives it back
    exactly (a division by a power of two), fractional for narrow stems such as 32 (factor 0.5)."""
    return width // 64 if width % 64 == 0 else width / 64


def _resnet_config(a: Arrays) -> ResNetConfig | None:
    if "conv_root/kernel" not in a:
        return None
    kh, kw, _, width = _shape(a, "conv_root/kernel", 4)
    if (kh, kw) not in ((7, 7), (3, 3)):
        raise VitlabError(f"hybrid root convolution conv_root/kernel is {kh}x{kw}; expected 7x7 (or 3x3 for the small stem)")
    counts: dict[int, int] = {}
    for k in a:
        if m := re.match(r"block(\d+)/unit(\d+)/", k):
            s, u = int(m.group(1)), int(m.group(2))
            counts[s] = max(counts.get(s, 0), u)
    if sorted(counts) != list(range(1, len(counts) + 1)):
        raise VitlabError(f"hybrid checkpoint has ResNet stages {sorted(counts)[:5]}; expected block1..blockN")
    return ResNetConfig(layers=tuple(counts[s] for s in sorted(counts)), width_factor=_width_factor(width),
                        stem="bit" if kh == 7 else "small")


def _infer(a: dict[str, Any], overrides: dict[str, Any], size_hint: Any = None) -> ViTConfig:
    """The config the normalised arrays `a` describe (shapes only), with `overrides` applied."""
    kh, kw, cin, dim = _shape(a, "embedding/kernel", 4)
    if kh != kw:
        raise VitlabError(f"non-square patches {kh}x{kw} are not supported")
    resnet = _resnet_config(a)
    if resnet is not None:
        cin = _shape(a, "conv_root/kernel", 4)[2]
    blocks = [int(m.group(1)) for k in a if (m := re.match(r"Transformer/encoderblock_(\d+)/", k))]
    if not blocks:
        raise VitlabError("official checkpoint has no Transformer/encoderblock_N arrays")
    attn, _, mlp = block_names(a)
    heads = _shape(a, f"Transformer/encoderblock_0/{attn}/query/kernel", 3)[1]
    mlp_dim = _shape(a, f"Transformer/encoderblock_0/{mlp}/Dense_0/kernel", 2)[1]
    token = "cls" in a
    classifier = "token" if token else ("map" if "MAPHead_0/probe" in a else "gap")
    key = _posemb_key(a)
    config = dict(
        name="official-npz", patch_size=kh, in_chans=cin, dim=dim, depth=1 + max(blocks), heads=heads,
        mlp_dim=mlp_dim, classifier=classifier, resnet=resnet,
        representation_size=_shape(a, "pre_logits/kernel", 2)[1] if "pre_logits/kernel" in a else None,
        num_classes=_shape(a, "head/kernel", 2)[1] if "head/kernel" in a else 0,
        posemb="learn" if key else "sincos2d",
    )
    if key:
        stride = kh * (resnet_reduction(resnet) if resnet else 1)
        config["image_size"] = _file_image_size(_shape(a, key, 3)[1], _class_slots(key, token), stride,
                                                overrides.get("image_size"), size_hint)
    else:
        config["image_size"] = 224  # big_vision's default; pass image_size= for another grid
    config.update(overrides)
    return ViTConfig(**config)  # validated: typed and bounded (limits.py)


def _class_slots(key: str, token: bool) -> tuple[int, ...]:
    """How many class slots the stored table may hold, the likelier first. The official ViT code adds its
    `Transformer/posembed_input` table after the class token is prepended (models_vit.py), so a token model's table
    always has one and a gap model's none: guessing from whether a count is square misread a token model with a
    2x4 grid (9 slots) as a 3x3 grid without one. big_vision's top-level table belongs to the patches (none), but a
    table with a class slot there was accepted before and still is."""
    if not token:
        return (0,)
    return (1,) if key == "Transformer/posembed_input/pos_embedding" else (1, 0)


def _file_image_size(n: int, slots: tuple[int, ...], stride: int, image_size: Any, size_hint: Any) -> Any:
    """The image size the stored position table of `n` rows was made for.

    The official code supports any (also non-square) image size and keeps no record of it, and its fine-tuning
    loader uses a table as it is whenever the new model's table has the same shape (`checkpoint.load_pretrained`
    resamples only on a shape change, and then only square grids). So: an `image_size` override must fit the table;
    the size the caller will run at (`size_hint`, `load(..., image_size=)`) is taken as the file's own when its grid
    has exactly the table's patch slots (a 3x12 grid's 36 slots are read as 3x12, as the official code does, not
    resampled from 6x6); else the grid must be square, and other sizes are resampled later."""
    for size, must_fit in ((image_size, True), (size_hint, False)):
        if size is None:
            continue
        h, w = check_size_pair("image_size", size)  # typed and bounded, one line when not
        grid = (h // stride) * (w // stride) if h % stride == 0 and w % stride == 0 else None
        if grid is not None and any(n - s == grid for s in slots):
            return size
        if must_fit:
            raise VitlabError(f"image_size {size} does not fit the checkpoint's position embedding ({n - slots[0]} "
                              f"patch slots, total stride {stride}); pass the size the file was made for")
    for s in slots:
        side = int(round(max(n - s, 0) ** 0.5))
        if side > 0 and side * side == n - s:
            return side * stride
    if n - slots[0] <= 0:
        raise VitlabError(f"position embedding with {n} rows has no patch slots; the file is damaged")
    raise VitlabError(f"position embedding with {n - slots[0]} patch slots is not a square grid: the checkpoint was "
                      f"made for a non-square image; pass that size as image_size=(H, W) with (H/{stride})*(W/{stride})"
                      f" = {n - slots[0]}")


def infer_config(arrays: Arrays, size_hint: Any = None, **overrides) -> ViTConfig:
    """Read the model config off the checkpoint's shapes (no array is read); `size_hint`: see `_file_image_size`."""
    return _infer(normalize(arrays), overrides, size_hint)


# ------------------------------------------------------------------------------ expected shapes
def _hybrid_units(resnet: ResNetConfig) -> Iterator[tuple[str, str, int, int, bool]]:
    """(npz prefix, vitlab prefix, input channels, inner width, has projection) of every unit,
    following the official ResNetStage rule: stage s is `width * 2**s` wide, 4x that out."""
    chans = resnet.width
    for s, n in enumerate(resnet.layers):
        f = resnet.width * 2**s
        for u in range(n):
            stride = 2 if (s > 0 and u == 0) else 1
            yield f"block{s + 1}/unit{u + 1}/", f"patch_embed.backbone.stages.{s}.blocks.{u}.", chans, f, \
                chans != 4 * f or stride != 1
            chans = 4 * f


def _hybrid_shapes(resnet: ResNetConfig, in_chans: int) -> dict[str, tuple[int, ...]]:
    k, w = (7 if resnet.stem == "bit" else 3), resnet.width
    want = {"conv_root/kernel": (k, k, in_chans, w), "gn_root/scale": (w,), "gn_root/bias": (w,)}
    for src, _, cin, f, proj in _hybrid_units(resnet):
        for r, (kernel, c_in, c_out) in enumerate(((1, cin, f), (3, f, f), (1, f, 4 * f)), start=1):
            want[f"{src}conv{r}/kernel"] = (kernel, kernel, c_in, c_out)
            want[f"{src}gn{r}/scale"] = want[f"{src}gn{r}/bias"] = (c_out,)
        if proj:
            want[f"{src}conv_proj/kernel"] = (1, 1, cin, 4 * f)
            want[f"{src}gn_proj/scale"] = want[f"{src}gn_proj/bias"] = (4 * f,)
    return want


def _attention_shapes(p: str, d: int, h: int) -> dict[str, tuple[int, ...]]:
    want = {f"{p}{n}/kernel": (d, h, d // h) for n in ("query", "key", "value")}
    want.update({f"{p}{n}/bias": (h, d // h) for n in ("query", "key", "value")})
    want.update({f"{p}out/kernel": (h, d // h, d), f"{p}out/bias": (d,)})
    return want


def _dense_shapes(p: str, d: int, m: int) -> dict[str, tuple[int, ...]]:
    return {f"{p}Dense_0/kernel": (d, m), f"{p}Dense_0/bias": (m,), f"{p}Dense_1/kernel": (m, d), f"{p}Dense_1/bias": (d,)}


def _norm_shapes(p: str, d: int) -> dict[str, tuple[int, ...]]:
    return {f"{p}/scale": (d,), f"{p}/bias": (d,)}


def expected_shapes(config: ViTConfig, a: Arrays) -> dict[str, tuple[int, ...]]:
    """name -> shape of every (normalised) array the model `config` is built from: the parameter
    count the config implies, checked against the file before anything is read."""
    d, h, m, p = config.dim, config.heads, config.mlp_dim, config.patch_size
    attn, ln2, mlp = block_names(a)
    chans = resnet_channels(config.resnet) if config.resnet is not None else config.in_chans
    want = {"embedding/kernel": (p, p, chans, d), "embedding/bias": (d,), **_norm_shapes("Transformer/encoder_norm", d)}
    if config.resnet is not None:
        want.update(_hybrid_shapes(config.resnet, config.in_chans))
    key = _posemb_key(a)
    if key and config.posemb == "learn":
        gh, gw = config.grid_size
        slots = {gh * gw + config.num_prefix_tokens, gh * gw}  # big_vision stores no class slot
        stored = tuple(a[key].shape)
        want[key] = (1, stored[1] if len(stored) == 3 and stored[1] in slots else gh * gw + config.num_prefix_tokens, d)
    if config.classifier == "token":
        want["cls"] = (1, 1, d)
    for i in range(config.depth):
        q = f"Transformer/encoderblock_{i}/"
        want.update({**_norm_shapes(q + "LayerNorm_0", d), **_norm_shapes(q + ln2, d)})
        want.update({**_attention_shapes(f"{q}{attn}/", d, h), **_dense_shapes(f"{q}{mlp}/", d, m)})
    if config.classifier == "map":
        want.update({"MAPHead_0/probe": (1, 1, d), **_norm_shapes("MAPHead_0/LayerNorm_0", d)})
        want.update({**_attention_shapes("MAPHead_0/MultiHeadDotProductAttention_0/", d, h),
                     **_dense_shapes("MAPHead_0/MlpBlock_0/", d, m)})
    if config.representation_size:
        want.update({"pre_logits/kernel": (d, config.representation_size), "pre_logits/bias": (config.representation_size,)})
    if config.num_classes and "head/kernel" in a:
        want.update({"head/kernel": (config.representation_size or d, config.num_classes), "head/bias": (config.num_classes,)})
    return want


def check_arrays(a: Arrays, want: dict[str, tuple[int, ...]]) -> None:
    """Every array the model needs is in the file with exactly its shape and a float dtype (headers only)."""
    missing = [k for k in want if k not in a]
    if missing:
        more = f" ... ({len(missing)} in all)" if len(missing) > 3 else ""
        raise VitlabError(f"the checkpoint lacks the arrays {', '.join(missing[:3])}{more} an official ViT checkpoint "
                          "of this shape has; is it complete?")
    wrong = [f"{k} (expected {want[k]}, found {tuple(a[k].shape)})" for k in want if tuple(a[k].shape) != want[k]]
    if wrong:
        more = f" ... ({len(wrong)} in all)" if len(wrong) > 3 else ""
        raise VitlabError(f"the checkpoint's arrays do not fit the model its shapes describe: shape mismatch "
                          f"{', '.join(wrong[:3])}{more}")
    not_float = [f"{k} ({np.dtype(a[k].dtype)})" for k in want if np.dtype(a[k].dtype).kind != "f"]
    if not_float:
        raise VitlabError(f"the checkpoint's arrays {', '.join(not_float[:3])} are not floating point; weights are "
                          "floats: re-export the checkpoint with float arrays")


# ------------------------------------------------------------------------------ conversion
def _np(x: Any) -> np.ndarray:
    return np.asarray(x)  # reads a lazy array (after its size check)


def _t(x: Any) -> torch.Tensor:
    # a transposed kernel stays a strided view: the load puts a contiguous copy in the model anyway
    # (load_state_dict_strict), and torch's transposing copy is multi-threaded where numpy's was not (the .npz
    # rows of docs/results/load_time.txt)
    return torch.from_numpy(_np(x)).float()


def _conv(x: Any) -> torch.Tensor:
    """flax conv kernel (kH, kW, Cin, Cout) -> PyTorch (Cout, Cin, kH, kW)."""
    return _t(_np(x).transpose(3, 2, 0, 1))


def _attention(a: Arrays, p: str, dim: int) -> dict[str, torch.Tensor]:
    """q/k/v/out DenseGenerals under prefix `p` -> PyTorch (out, in) matrices."""
    def w(n):
        return _t(_np(a[f"{p}{n}/kernel"]).reshape(dim, -1).T)

    def b(n):
        return _t(_np(a[f"{p}{n}/bias"]).reshape(-1))

    return {"q.w": w("query"), "k.w": w("key"), "v.w": w("value"), "q.b": b("query"), "k.b": b("key"), "v.b": b("value"),
            "o.w": _t(_np(a[f"{p}out/kernel"]).reshape(-1, dim).T), "o.b": _t(a[f"{p}out/bias"])}


def _hybrid_state_dict(a: Arrays, resnet: ResNetConfig) -> dict[str, torch.Tensor]:
    pre = "patch_embed.backbone."
    sd = {pre + "stem.conv.weight": _conv(a["conv_root/kernel"]),
          pre + "stem.norm.weight": _t(a["gn_root/scale"]), pre + "stem.norm.bias": _t(a["gn_root/bias"])}
    for src, dst, _, _, proj in _hybrid_units(resnet):
        for r in (1, 2, 3):
            sd[f"{dst}conv{r}.weight"] = _conv(a[f"{src}conv{r}/kernel"])
            sd[f"{dst}norm{r}.weight"] = _t(a[f"{src}gn{r}/scale"])
            sd[f"{dst}norm{r}.bias"] = _t(a[f"{src}gn{r}/bias"])
        if proj:
            sd[f"{dst}downsample.conv.weight"] = _conv(a[f"{src}conv_proj/kernel"])
            sd[f"{dst}downsample.norm.weight"] = _t(a[f"{src}gn_proj/scale"])
            sd[f"{dst}downsample.norm.bias"] = _t(a[f"{src}gn_proj/bias"])
    return sd


def _state_dict(a: dict[str, Any], config: ViTConfig) -> dict[str, torch.Tensor]:
    """Normalised arrays -> vitlab (timm) names and PyTorch layouts; reads exactly the arrays it maps."""
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
    key = _posemb_key(a)
    if key:
        pe = _t(a[key])
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
            sd[f"{q}mlp.{name}.weight"] = _t(_np(a[f"{p}{mlp}/Dense_{j}/kernel"]).T)
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
            sd[f"attn_pool.mlp.{name}.weight"] = _t(_np(a[f"{p}MlpBlock_0/Dense_{j}/kernel"]).T)
            sd[f"attn_pool.mlp.{name}.bias"] = _t(a[f"{p}MlpBlock_0/Dense_{j}/bias"])
    if config.representation_size:
        sd["pre_logits.fc.weight"] = _t(_np(a["pre_logits/kernel"]).T)
        sd["pre_logits.fc.bias"] = _t(a["pre_logits/bias"])
    if config.num_classes and "head/kernel" in a:
        sd["head.weight"] = _t(_np(a["head/kernel"]).T)
        sd["head.bias"] = _t(a["head/bias"])
    return sd


def to_state_dict(arrays: Arrays, config: ViTConfig) -> dict[str, torch.Tensor]:
    """Map official arrays to vitlab (timm) names and PyTorch layouts."""
    return _state_dict(normalize(arrays), config)


def _read_official_arrays(a: dict[str, Any], overrides: dict[str, Any], raw: Arrays | None = None,
                          size_hint: Any = None) -> tuple[ViTConfig, dict[str, torch.Tensor]]:
    """Config from the shapes, checked against every needed array's header (and, given the file's `raw` arrays,
    refused when it holds arrays the model does not use), then only those arrays read."""
    config = _infer(a, overrides, size_hint)
    want = expected_shapes(config, a)
    check_arrays(a, want)
    extra = unexpected_arrays(raw, want) if raw is not None else []
    if extra:
        more = f" ... ({len(extra)} in all)" if len(extra) > 3 else ""
        raise VitlabError(f"the checkpoint holds arrays the model its shapes describe does not use: "
                          f"{', '.join(extra[:3])}{more}; this is not a plain official ViT checkpoint (another "
                          "model, or arrays added to it): remove those arrays, or drop the override that leaves "
                          "them unused")
    return config, _state_dict(a, config)


def read_official(path: str | Path, size_hint: Any = None, **overrides) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, state dict, meta) of an official ViT / hybrid / big_vision `.npz`; `size_hint`: the image size the
    caller will run at, the file's own where its grid has the table's slots (`_file_image_size`).

    Bounded before allocating: the config is typed and within the documented limits, every array
    it needs is checked (shape, dtype, declared size) before it is decompressed, and arrays the
    model does not use are never decompressed."""
    from vitlab.weights import big_transfer

    with read_npz(path) as archive:
        if big_transfer.is_big_transfer_keys(archive):  # a released BiT ResNet, not a ViT
            return big_transfer.read_arrays(archive, str(path), **overrides)
        try:
            if not is_official_npz(archive):
                raise VitlabError(f"{path} is an .npz but not an official ViT checkpoint (no 'embedding/kernel')")
            a = normalize(archive)
            config, sd = _read_official_arrays(a, overrides, archive, size_hint)
        except KeyError as exc:
            raise VitlabError(f"{path} lacks the array {exc.args[0]!r} an official ViT checkpoint has; "
                              "is it complete?") from exc
        except VitlabError as exc:
            if str(path) in str(exc):
                raise
            raise VitlabError(f"{path}: {exc}") from exc
        big_vision = is_big_vision(a)
    zero_head = "head.weight" in sd and not torch.any(sd["head.weight"]).item()
    pre = default_preprocess(config, antialias=False)  # the official evaluation's tf.image.resize (input_pipeline.py)
    meta = {"format": "big_vision" if big_vision else "official", "class_names": None,
            "preprocess": pre, "zero_head": zero_head}
    return config, sd, meta
