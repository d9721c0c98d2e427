"""Hugging Face transformers ViT: folders in (4.x and 5.x key layouts, `ViTModel` and
`ViTForImageClassification`, with or without the `vit.` prefix) and out (loadable by
`transformers.ViTForImageClassification.from_pretrained`). Also `ResNetForImageClassification`
(model_type "resnet", e.g. microsoft/resnet-50) in and out, mapped by name onto torchvision's keys.

Numerics come from the folder's config.json: LayerNorm eps (HF default 1e-12), GELU (`gelu` is the
exact erf form), qkv bias. `ViTModel`'s tanh pooler on the class token is our representation layer.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.models.config import ViTConfig
from vitlab.weights.io import folder_config
from vitlab.weights.limits import MAX_SHARDS

_GELUS = {"gelu": "exact", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh",
          "gelu_python_tanh": "tanh"}
# PIL filter codes (what `resample` holds) -> vitlab interpolation, each the same filter (nearest, box, hamming and
# lanczos run through Pillow itself, `data.pillow_resize`). Any other code is refused: it is no filter PIL or
# transformers knows.
_PIL_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
# what the exports write (else 2: bilinear); torch's area is closest to PIL's box, which averages other windows
_RESAMPLE_CODE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "area": 4, "hamming": 5}
HF_RESCALE = 1 / 255  # ViTImageProcessor's default rescale_factor: pixel values 0..255 -> 0..1, vitlab's own scale

# HF key (after dropping `vit.`, 4.x and 5.x names) -> vitlab key, per encoder layer.
_LAYER_KEYS = {
    "layernorm_before": "norm1",
    "layernorm_after": "norm2",
    "attention.output.dense": "attn.proj",  # 4.x
    "attention.o_proj": "attn.proj",  # 5.x
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_QKV_4 = ("attention.attention.query", "attention.attention.key", "attention.attention.value")
_QKV_5 = ("attention.q_proj", "attention.k_proj", "attention.v_proj")


# ------------------------------------------------------------------------------------------ reading
def _read_json(path: Path) -> dict:
    """A JSON object from a small file (size-bounded: io.read_json)."""
    from vitlab.weights.io import read_json

    data = read_json(path, path.name)
    if not isinstance(data, dict):
        raise VitlabError(f"{path} must hold a JSON object, got {type(data).__name__}; is it the right file?")
    return data


def is_hf_folder(folder: Path) -> bool:
    data = folder_config(folder)
    return data is not None and (data.get("model_type") in ("vit", "deit", "resnet") or "hidden_size" in data)


def is_hf_state_dict(sd: dict[str, torch.Tensor]) -> bool:
    return any(k.endswith("embeddings.patch_embeddings.projection.weight") for k in sd) or is_hf_resnet_state_dict(sd)


def is_hf_resnet_state_dict(sd: dict[str, torch.Tensor]) -> bool:
    """`ResNetForImageClassification` (`resnet.` prefix) or `ResNetModel` (none) keys."""
    return any(k.endswith("embedder.embedder.convolution.weight") for k in sd)


_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _shard_names(index: Path) -> tuple[list[str], set[str]]:
    """(shard file names, tensor names) of a sharded checkpoint's index, each shard a plain file name
    of this folder (no paths: an index must not point elsewhere on the disk)."""
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise VitlabError(f"{index} has no 'weight_map' of tensor names to shard files; is the download complete?")
    names = sorted({str(v) for v in weight_map.values()})
    if len(names) > MAX_SHARDS:
        raise VitlabError(f"{index} names {len(names)} shard files, above {MAX_SHARDS} (docs/weights.md, Limits)")
    for name in names:
        if Path(name).name != name or name in (".", "..") or not name.endswith((".safetensors", ".bin")):
            raise VitlabError(f"{index} names the shard {name!r}; a shard is a .safetensors or .bin file in the same "
                              "folder: fix the index")
        if not (index.parent / name).is_file():
            raise VitlabError(f"{index} names the shard {name} but it is not in {index.parent}; is the download complete?")
    return names, set(weight_map)


def _weights_files(folder: Path) -> tuple[list[Path], set[str]]:
    """(weight files, tensor names the index promises; empty for a single file), chosen in the order of
    transformers' `from_pretrained` (model.safetensors, its shard index, pytorch_model.bin, its shard index): a Hub
    folder holding two of them (old .bin shards beside a later model.safetensors) loads the weights transformers
    loads."""
    from vitlab.weights.io import is_regular_file

    for name in ("model.safetensors", _INDEXES[0], "pytorch_model.bin", _INDEXES[1]):
        if not is_regular_file(folder / name):
            continue
        if name in _INDEXES:
            names, tensors = _shard_names(folder / name)
            return [folder / n for n in names], tensors
        return [folder / name], set()
    raise VitlabError(f"{folder} has a Hugging Face config.json but no model.safetensors or pytorch_model.bin")


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from vitlab.weights.io import read_tensors

    files, promised = _weights_files(folder)
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(read_tensors(f))
    absent = sorted(promised - set(sd))
    if absent:
        raise VitlabError(f"{folder}: the shard index names tensors no shard holds ({', '.join(absent[:3])}"
                          f"{' ...' if len(absent) > 3 else ''}); is the download complete?")
    return sd


def _preprocess(pp: dict, config: ViTConfig, source: Path) -> dict:
    """preprocessor_config.json -> vitlab preprocessing, refused in one line when malformed or
    inconsistent with the model (limits.validate_preprocess)."""
    from vitlab.weights.limits import validate_preprocess

    try:
        # HF ResNets ship a ConvNext processor (resize to N / crop_pct, crop N); ViTs a ViTImageProcessor
        pre = preprocess_from_convnext(pp, config) if _is_convnext_processor(pp) else preprocess_from_hf(pp, config)
    except (TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError) as exc:
        raise VitlabError(f"cannot read {source} ({type(exc).__name__}: {exc}); fix the file or delete it "
                          "to use the default preprocessing") from exc
    except VitlabError as exc:  # a value vitlab cannot reproduce (resample, rescale_factor): name the file
        raise VitlabError(f"{source}: {exc}") from exc
    return validate_preprocess(pre, config, str(source))


def read_hf_folder(folder: str | Path, **overrides: Any) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, vitlab state dict, meta) of a Hugging Face ViT folder."""
    folder = Path(folder)
    hf_cfg = _read_json(folder / "config.json")
    sd = _read_weights(folder)
    try:
        config, state, meta = read_hf_state_dict(sd, hf_cfg, **overrides)
    except VitlabError as exc:
        if str(folder) in str(exc):
            raise
        raise VitlabError(f"{folder}: {exc}") from exc
    pre = folder / "preprocessor_config.json"
    if pre.is_file():
        meta["preprocess"] = _preprocess(_read_json(pre), config, pre)
    return config, state, meta


def _strip_prefix(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        if k.startswith("vit."):
            k = k[4:]
        out[k] = v
    return out


def read_hf_state_dict(
    sd: dict[str, torch.Tensor], hf_cfg: dict | None, **overrides: Any
) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """Map a HF ViT state dict (either layout) to vitlab; `hf_cfg` (config.json) gives the numerics.

    Without a config.json the shapes give the architecture and HF's defaults the numerics.
    """
    if (hf_cfg or {}).get("model_type") == "resnet" or is_hf_resnet_state_dict(sd):
        return read_hf_resnet_state_dict(sd, hf_cfg, **overrides)
    sd = _strip_prefix(sd)
    hf_cfg = dict(hf_cfg or {})
    if hf_cfg.get("model_type") not in (None, "vit"):
        raise VitlabError(f"Hugging Face model_type {hf_cfg.get('model_type')!r} is not supported; only 'vit'")
    w = sd.get("embeddings.patch_embeddings.projection.weight")
    if w is None:
        raise VitlabError("not a Hugging Face ViT state dict: no 'embeddings.patch_embeddings.projection.weight'")
    try:
        return _read_hf_vit(sd, hf_cfg, overrides)
    except KeyError as exc:
        raise VitlabError(f"Hugging Face ViT checkpoint lacks the tensor {exc.args[0]!r}; is it complete?") from exc


def _tensor_shape(sd: dict[str, torch.Tensor], key: str, ndim: int) -> tuple[int, ...]:
    shape = tuple(sd[key].shape)
    if len(shape) != ndim:
        raise VitlabError(f"Hugging Face tensor {key!r} has shape {shape}; expected {ndim} axes")
    return shape


def _check_declared(hf_cfg: dict, found: dict[str, int]) -> None:
    """config.json's architecture fields must describe the weights that are there (a folder whose
    config and weights disagree is refused, whichever of the two is wrong)."""
    for field, value in found.items():
        declared = hf_cfg.get(field)
        if declared is not None and declared != value:
            raise VitlabError(f"config.json says {field}={declared!r} but the weights hold {value}; the folder is "
                              "inconsistent: fix config.json or re-download the folder")


# Config fields a Hugging Face ViT config cannot say, which vitlab's `--to hf` writes under HF_EXTRAS_KEY: a fixed
# sin-cos table (HF stores it as a parameter), how the table is resampled to another size (HF: bicubic), stochastic
# depth, the model's name. Without them the folder reloads as another model at other sizes or in fine-tuning.
HF_EXTRAS_KEY = "vitlab_config"
_HF_EXTRAS = ("posemb", "posemb_resample", "drop_path", "head_bias_init", "name")


def _hf_extras(hf_cfg: dict) -> dict[str, Any]:
    extras = hf_cfg.get(HF_EXTRAS_KEY) or {}
    if not isinstance(extras, dict):
        raise VitlabError(f"config.json's '{HF_EXTRAS_KEY}' is not a JSON object; re-export the folder")
    return {k: v for k, v in extras.items() if k in _HF_EXTRAS}


def _square_patch(declared: Any) -> Any:
    """config.json's patch_size as one side: transformers' ViTConfig takes an int or an (h, w) pair (a pair of equal
    sides is the same patch); anything else is left as it is, for `_check_declared` to compare with the weights."""
    if isinstance(declared, (list, tuple)) and len(declared) == 2 and declared[0] == declared[1]:
        return declared[0]
    return declared


def _read_hf_vit(sd: dict[str, torch.Tensor], hf_cfg: dict, overrides: dict[str, Any]
                 ) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    dim, in_chans, patch_h, patch_w = _tensor_shape(sd, "embeddings.patch_embeddings.projection.weight", 4)
    if patch_h != patch_w:
        raise VitlabError(f"this Hugging Face ViT cuts {patch_h}x{patch_w} patches; vitlab builds square patches "
                          "only (one patch_size), so it cannot load this model")
    patch = patch_h
    layer_ids = {int(m.group(2)) for k in sd if (m := re.match(r"(encoder\.layer|layers)\.(\d+)\.", k))}
    depth = max(layer_ids) + 1 if layer_ids else 0
    layer_root = "encoder.layer" if any(k.startswith("encoder.layer.") for k in sd) else "layers"
    mlp_dim = next((v.shape[0] for k, v in sd.items()
                    if re.match(rf"{re.escape(layer_root)}\.0\.(intermediate\.dense|mlp\.fc1)\.weight$", k)), None)
    if mlp_dim is None:
        raise VitlabError(f"Hugging Face ViT checkpoint has no {layer_root}.0 MLP weight; is it complete?")
    hf_cfg = {**hf_cfg, "patch_size": _square_patch(hf_cfg.get("patch_size"))}
    _check_declared(hf_cfg, {"hidden_size": dim, "num_hidden_layers": depth, "intermediate_size": mlp_dim,
                             "patch_size": patch, "num_channels": in_chans})
    act = hf_cfg.get("hidden_act", "gelu")
    if not isinstance(act, str) or act not in _GELUS:
        raise VitlabError(f"Hugging Face hidden_act {act!r} is not supported; use one of {sorted(_GELUS)}")
    pos = sd["embeddings.position_embeddings"]
    n_patch = _tensor_shape(sd, "embeddings.position_embeddings", 3)[1] - 1
    image_size = hf_cfg.get("image_size")
    if image_size is None:
        side = int(round(n_patch**0.5))
        image_size = side * patch
    heads = hf_cfg.get("num_attention_heads")
    if heads is None:
        from vitlab.weights.timm import guess_heads

        heads = guess_heads(dim)
    has_pooler = "pooler.dense.weight" in sd
    has_classifier = "classifier.weight" in sd
    if has_pooler and hf_cfg.get("pooler_act", "tanh") != "tanh":
        raise VitlabError(f"pooler_act {hf_cfg.get('pooler_act')!r} is not supported (only tanh)")
    if has_pooler and has_classifier:
        raise VitlabError("a Hugging Face state dict with both a pooler and a classifier is not a ViT model")
    num_classes = sd["classifier.weight"].shape[0] if has_classifier else 0
    config = dict(
        name="hf-vit", image_size=image_size, patch_size=patch, in_chans=in_chans, dim=dim, depth=depth,
        heads=heads, mlp_dim=mlp_dim, classifier="token", num_classes=num_classes,
        representation_size=sd["pooler.dense.weight"].shape[0] if has_pooler else None,
        # numbers go to ViTConfig as written: it checks their types and ranges (limits.py)
        layer_norm_eps=hf_cfg.get("layer_norm_eps", 1e-12), gelu=_GELUS[act],
        qkv_bias=bool(hf_cfg.get("qkv_bias", True)),
        dropout=hf_cfg.get("hidden_dropout_prob", 0.0),
        attention_dropout=hf_cfg.get("attention_probs_dropout_prob", 0.0),
        posemb_resample="bicubic",  # HF interpolate_pos_encoding: bicubic, align_corners=False
    )
    config.update(_hf_extras(hf_cfg))  # vitlab's own export: what HF's config cannot say
    config.update(overrides)
    try:
        config = ViTConfig(**config)
    except VitlabError as exc:
        raise VitlabError(f"the Hugging Face config.json and weights describe an invalid model: {exc}") from exc
    gh, gw = config.grid_size
    if gh * gw != n_patch:
        raise VitlabError(
            f"position embedding has {n_patch} patch slots but image_size {config.image_size} with patch "
            f"{patch} needs {gh * gw}; fix image_size in config.json"
        )

    out: dict[str, torch.Tensor] = {
        "cls_token": sd["embeddings.cls_token"],
        "pos_embed": pos,
        "patch_embed.proj.weight": sd["embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": sd["embeddings.patch_embeddings.projection.bias"],
        "norm.weight": sd["layernorm.weight"],
        "norm.bias": sd["layernorm.bias"],
    }
    used = set(out) | {"embeddings.cls_token", "embeddings.position_embeddings",
                       "embeddings.patch_embeddings.projection.weight", "embeddings.patch_embeddings.projection.bias",
                       "layernorm.weight", "layernorm.bias", "embeddings.mask_token"}
    for i in range(depth):
        p = f"{layer_root}.{i}."
        qkv = _QKV_4 if f"{p}{_QKV_4[0]}.weight" in sd else _QKV_5
        out[f"blocks.{i}.attn.qkv.weight"] = torch.cat([sd[f"{p}{n}.weight"] for n in qkv])
        used |= {f"{p}{n}.weight" for n in qkv}
        if config.qkv_bias:
            out[f"blocks.{i}.attn.qkv.bias"] = torch.cat([sd[f"{p}{n}.bias"] for n in qkv])
            used |= {f"{p}{n}.bias" for n in qkv}
        for src, dst in _LAYER_KEYS.items():
            for kind in ("weight", "bias"):
                if f"{p}{src}.{kind}" in sd:
                    out[f"blocks.{i}.{dst}.{kind}"] = sd[f"{p}{src}.{kind}"]
                    used.add(f"{p}{src}.{kind}")
    if has_pooler:
        out["pre_logits.fc.weight"], out["pre_logits.fc.bias"] = sd["pooler.dense.weight"], sd["pooler.dense.bias"]
        used |= {"pooler.dense.weight", "pooler.dense.bias"}
    if has_classifier:
        out["head.weight"], out["head.bias"] = sd["classifier.weight"], sd["classifier.bias"]
        used |= {"classifier.weight", "classifier.bias"}
    left = sorted(set(sd) - used)
    if left:
        raise VitlabError(f"Hugging Face checkpoint has keys vitlab cannot place: {', '.join(left[:3])}"
                          + (f" ... ({len(left)} in all)" if len(left) > 3 else ""))
    meta = {"format": "hf", "class_names": _class_names(hf_cfg, num_classes),
            "preprocess": hf_default_preprocess(config)}
    return config, out, meta


def _class_names(hf_cfg: dict, num_classes: int) -> list[str] | None:
    """Class names from `id2label`, read as transformers reads it (`PretrainedConfig`: `{int(key): name}`, so "01"
    is class 1); keys that are not integers, repeated indices, or indices other than exactly 0..N-1 for the N
    classifier outputs are refused (transformers itself fails to load such a folder). transformers' placeholder
    names (LABEL_0, LABEL_1, ...) mean "no names"."""
    id2label = hf_cfg.get("id2label")
    if not id2label or not num_classes:
        return None
    if not isinstance(id2label, dict):
        raise VitlabError(f"config.json id2label must be an object of class index -> name, got "
                          f"{type(id2label).__name__}; fix it (or delete it)")
    labels: dict[int, str] = {}
    for key, name in id2label.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            raise VitlabError(f"config.json id2label has the key {key!r}, not an integer (transformers reads the keys "
                              "with int()); use the class indices \"0\", \"1\", ... as keys") from None
        if index in labels:
            raise VitlabError(f"config.json id2label names class {index} twice (keys read as integers, as "
                              "transformers does); keep one key per class")
        labels[index] = str(name)
    if sorted(labels) != list(range(num_classes)):
        stray = sorted(set(labels) - set(range(num_classes)))[:3]
        absent = sorted(set(range(num_classes)) - set(labels))[:3]
        detail = "; ".join(x for x in (f"no name for {absent}" if absent else "",
                                        f"names for {stray} beyond it" if stray else "") if x)
        raise VitlabError(f"config.json id2label has {len(labels)} labels but the classifier has {num_classes} "
                          f"outputs ({detail}); it must name each class 0..{num_classes - 1} once: fix it (or delete it)")
    names = [labels[i] for i in range(num_classes)]
    if all(n == f"LABEL_{i}" for i, n in enumerate(names)):
        return None
    return names


def _interpolation(pp: dict) -> str:
    """vitlab's interpolation for the processor's PIL `resample` code (absent: transformers' bilinear default)."""
    code = pp.get("resample", 2)
    if isinstance(code, bool) or not isinstance(code, int) or code not in _PIL_RESAMPLE:
        raise VitlabError(f"resample {code!r} is no PIL filter (0 nearest, "
                          "1 lanczos, 2 bilinear, 3 bicubic, 4 box, 5 hamming); fix it to the one the model was "
                          "trained with")
    return _PIL_RESAMPLE[code]


def _fold_rescale(pp: dict, mean: list, std: list) -> tuple[list, list]:
    """mean and std on vitlab's [0, 1] pixel scale for the processor's `do_rescale` / `rescale_factor`.

    transformers computes (x * r - mean) / std on pixel values x in 0..255 (r = rescale_factor, 1 without
    do_rescale); vitlab computes (x / 255 - mean') / std'. The two are the same map for mean' = mean / (255 r),
    std' = std / (255 r), so any positive factor is reproduced, not ignored."""
    do_rescale = pp.get("do_rescale", True)
    if not isinstance(do_rescale, bool):
        raise VitlabError(f"do_rescale {do_rescale!r} must be true or false")
    factor = pp.get("rescale_factor", HF_RESCALE) if do_rescale else 1.0
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf"):
        raise VitlabError(f"rescale_factor {factor!r} must be a positive number "
                          "(1/255 maps pixel values to [0, 1])")
    scale = 255.0 * factor
    if abs(scale - 1.0) < 1e-9:  # the default 1/255: keep the stored statistics bit for bit
        return mean, std
    return [float(m) / scale for m in mean], [float(s) / scale for s in std]


def hf_default_preprocess(config: ViTConfig) -> dict:
    """ViTImageProcessor's defaults: plain resize to the model size, bilinear, mean = std = 0.5."""
    c = config.in_chans
    return {"image_size": list(config.image_size), "mean": [0.5] * c, "std": [0.5] * c, "resize": None,
            "crop_fraction": 1.0, "interpolation": "bilinear", "channels": c}


# transformers' class defaults for the keys a processor file leaves out (ViTImageProcessor's are the base case);
# the file's `image_processor_type` (or a legacy `feature_extractor_type`) names the class.
_PROCESSOR_DEFAULTS = {
    "DeiT": {"resample": 3, "do_center_crop": True, "size": {"height": 256, "width": 256},
             "crop_size": {"height": 224, "width": 224}},
    "Beit": {"resample": 3},
}
# Classes whose int `size` is the shortest edge (transformers' `default_to_square = False`); for ViT, DeiT and
# BEiT an int is a square.
_INT_SIZE_IS_SHORTEST_EDGE = ("CLIP", "ChineseCLIP", "Siglip", "Bit", "Levit", "MobileViT", "PoolFormer",
                              "VideoMAE", "Vilt")


def _processor_class(pp: dict) -> str:
    """'DeiT' for DeiTImageProcessor, DeiTImageProcessorFast or the legacy DeiTFeatureExtractor."""
    kind = str(pp.get("image_processor_type") or pp.get("feature_extractor_type") or "")
    for suffix in ("ImageProcessorFast", "ImageProcessorPil", "ImageProcessor", "FeatureExtractor"):
        if kind.endswith(suffix):
            return kind[: -len(suffix)]
    return kind


def _size_dict(size: Any, kind: str, key: str) -> dict:
    """transformers' size dict (`get_size_dict`) of a processor file's `size` or `crop_size`."""
    if isinstance(size, dict):
        return size
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return {"height": int(size[0]), "width": int(size[1])}
    if isinstance(size, bool) or not isinstance(size, (int, float)) or int(size) != size:
        raise VitlabError(f"{key} {size!r} is neither a whole number nor a size dict")
    if key == "size" and kind in _INT_SIZE_IS_SHORTEST_EDGE:
        return {"shortest_edge": int(size)}
    return {"height": int(size), "width": int(size)}


# transformers places every centre crop at (H - h) // 2, in both backends (PIL/numpy and torchvision), where
# torchvision's CenterCrop (timm, vitlab's training) rounds: `Preprocess.crop_offset`.
HF_CROP_OFFSET = "floor"


def _not_reproduced(what: str) -> VitlabError:
    return VitlabError(f"{what} is a preprocessing vitlab does not reproduce; delete the file to use the "
                       "model's plain resize, or write the preprocessing the model was trained with")


def preprocess_from_hf(pp: dict, config: ViTConfig) -> dict:
    """preprocessor_config.json (ViTImageProcessor and friends) -> vitlab preprocessing dict, as transformers'
    processor computes: `size` {"height", "width"} resizes the whole image (an int is that square, or the shortest
    edge for CLIP-like classes), {"shortest_edge"} keeps the aspect ratio; `do_center_crop` then cuts `crop_size`.
    A whole-image resize before a crop is crop_mode "squash" (DeiT's 256 x 256 -> 224), and every crop is placed
    at (H - h) // 2 (crop_offset "floor"), as transformers places it. What vitlab cannot reproduce (a crop without
    a resize, a non-square resize before a crop, longest_edge limits) is refused."""
    kind = _processor_class(pp)
    pp = {**_PROCESSOR_DEFAULTS.get(kind, {}), **{k: v for k, v in pp.items() if v is not None}}
    out = hf_default_preprocess(config)
    c = config.in_chans
    if pp.get("do_normalize", True):
        for key, src in (("mean", "image_mean"), ("std", "image_std")):
            if pp.get(src) is not None:
                v = pp[src]
                out[key] = list(v) if isinstance(v, (list, tuple)) else [float(v)] * c
    else:
        out["mean"], out["std"] = [0.0] * c, [1.0] * c
    out["mean"], out["std"] = _fold_rescale(pp, out["mean"], out["std"])
    out["interpolation"] = _interpolation(pp)
    size = _size_dict(pp["size"], kind, "size") if pp.get("do_resize", True) and pp.get("size") is not None else None
    if size is not None and not ({"height", "width"} == set(size) or {"shortest_edge"} == set(size)):
        raise _not_reproduced(f"size {size}")
    if pp.get("do_center_crop") and pp.get("crop_size") is not None:
        crop = _size_dict(pp["crop_size"], kind, "crop_size")
        side = crop.get("shortest_edge")
        out["image_size"] = [int(crop.get("height", side)), int(crop.get("width", side))]
        if pp.get("do_resize", True) is False:
            raise _not_reproduced("a centre crop without a resize (do_resize false)")
        if size is None:  # the class's own size, which vitlab does not know
            raise _not_reproduced(f"a centre crop after the {kind or 'processor'} class's default resize")
        if "shortest_edge" in size:
            out["resize"] = int(size["shortest_edge"])
        elif int(size["height"]) == int(size["width"]):
            out["resize"], out["crop_mode"] = int(size["height"]), "squash"
        else:
            raise _not_reproduced(f"a resize to {size['height']}x{size['width']} before a centre crop")
        out["crop_offset"] = HF_CROP_OFFSET
    elif size is not None:  # no crop: the resized image is the input (a shortest edge: a square photo's size)
        side = size.get("shortest_edge")
        out["image_size"] = [int(size.get("height", side)), int(size.get("width", side))]
    # do_resize false without a crop: transformers gives the model the image as it is, which the model takes only
    # at its own size; the plain resize to that size gives the same input there and works on any other size too.
    return out


# ------------------------------------------------------------------------------------------ writing
def to_hf_state_dict(model: nn.Module) -> tuple[dict, dict[str, torch.Tensor]]:
    """(HF config.json dict, 4.x-layout state dict) for a plain class-token ViT."""
    cfg: ViTConfig = model.config
    if cfg.arch == "resnet":  # standard ResNets went to to_hf_resnet_state_dict
        raise VitlabError(f"--to hf writes ViTs and standard (torchvision-layout) ResNets; this {cfg.resnet.kind} ResNet "
                          "is written with --to timm (timm's resnetv2 names) or --to native")
    if cfg.is_hybrid:
        raise VitlabError("--to hf writes only plain ViTs (a patch embedding; no CNN or conv stem: transformers 5 has "
                          "no ViT hybrid); use --to native or --to timm")
    if cfg.classifier != "token":
        raise VitlabError(f"Hugging Face ViT pools the class token only; a '{cfg.classifier}' model cannot be exported; "
                          "use --to native or --to timm")
    if cfg.representation_size and cfg.num_classes:
        raise VitlabError("ViTForImageClassification has no representation layer; fine-tune without it "
                          "(vitlab.load(..., num_classes=K)) before exporting")
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if cfg.posemb != "learn":  # fixed sin-cos table: HF stores it as a learned parameter
        sd["pos_embed"] = model.pos_embed.detach().cpu()
    d = cfg.dim
    out = {
        "vit.embeddings.cls_token": sd["cls_token"],
        "vit.embeddings.position_embeddings": sd["pos_embed"],
        "vit.embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
        "vit.embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
        "vit.layernorm.weight": sd["norm.weight"],
        "vit.layernorm.bias": sd["norm.bias"],
    }
    for i in range(cfg.depth):
        p, q = f"vit.encoder.layer.{i}.", f"blocks.{i}."
        for j, name in enumerate(("query", "key", "value")):
            out[f"{p}attention.attention.{name}.weight"] = sd[q + "attn.qkv.weight"][j * d:(j + 1) * d]
            if cfg.qkv_bias:
                out[f"{p}attention.attention.{name}.bias"] = sd[q + "attn.qkv.bias"][j * d:(j + 1) * d]
        for src, dst in (("norm1", "layernorm_before"), ("norm2", "layernorm_after"), ("attn.proj", "attention.output.dense"),
                         ("mlp.fc1", "intermediate.dense"), ("mlp.fc2", "output.dense")):
            out[f"{p}{dst}.weight"], out[f"{p}{dst}.bias"] = sd[f"{q}{src}.weight"], sd[f"{q}{src}.bias"]
    if cfg.num_classes:
        out["classifier.weight"], out["classifier.bias"] = sd["head.weight"], sd["head.bias"]
        arch = "ViTForImageClassification"
    else:  # a feature extractor: ViTModel, keys without the `vit.` prefix
        out = {k.removeprefix("vit."): v for k, v in out.items()}
        if cfg.representation_size:
            out["pooler.dense.weight"], out["pooler.dense.bias"] = sd["pre_logits.fc.weight"], sd["pre_logits.fc.bias"]
        arch = "ViTModel"
    hf_cfg = {
        "architectures": [arch], "model_type": "vit",
        "hidden_size": d, "num_hidden_layers": cfg.depth, "num_attention_heads": cfg.heads,
        "intermediate_size": cfg.mlp_dim, "hidden_act": "gelu" if cfg.gelu == "exact" else "gelu_pytorch_tanh",
        "hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": cfg.attention_dropout,
        "layer_norm_eps": cfg.layer_norm_eps, "image_size": _hf_image_size(cfg.image_size), "patch_size": cfg.patch_size,
        "num_channels": cfg.in_chans, "qkv_bias": cfg.qkv_bias, "encoder_stride": cfg.patch_size,
        "pooler_output_size": cfg.representation_size or d, "pooler_act": "tanh", "initializer_range": 0.02,
        # what HF's ViTConfig cannot say; transformers keeps unknown keys, vitlab reads them back (_HF_EXTRAS)
        HF_EXTRAS_KEY: {k: cfg.to_dict()[k] for k in _HF_EXTRAS},
    }
    return hf_cfg, {k: v.contiguous().clone() for k, v in out.items()}


def _hf_image_size(size: tuple[int, int]) -> int | list[int]:
    """config.json's image_size: one side for a square model (as every Hub ViT writes it), else [height, width],
    which transformers' ViTConfig takes (ViTPatchEmbeddings reads an iterable as (height, width))."""
    h, w = size
    return int(h) if h == w else [int(h), int(w)]


def save_hf(model: nn.Module, folder: str | Path, class_names: list[str] | None = None, preprocess: Any = None) -> Path:
    """Write config.json, model.safetensors and preprocessor_config.json in the Hugging Face layout."""
    from vitlab.weights.io import save_safetensors
    from vitlab.weights.native import check_savable

    check_savable(model)  # a head put in by hand (nn.Sequential) failed here on a bare KeyError 'head.weight'
    cfg = model.config
    resnet = cfg.arch == "resnet" and cfg.resnet is not None and cfg.resnet.kind == "standard"
    hf_cfg, sd = to_hf_resnet_state_dict(model) if resnet else to_hf_state_dict(model)
    n = model.config.num_classes
    if n:
        names = [str(c) for c in class_names] if class_names else [f"LABEL_{i}" for i in range(n)]
        if len(names) != n:
            raise VitlabError(f"{len(names)} class names for a model with {n} outputs")
        hf_cfg["id2label"] = {str(i): name for i, name in enumerate(names)}
        hf_cfg["label2id"] = {name: i for i, name in enumerate(names)}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    save_safetensors(sd, folder / "model.safetensors", metadata={"format": "pt"})
    pre = export_preprocess(cfg, preprocess)
    (folder / "preprocessor_config.json").write_text(json.dumps(hf_processor(cfg, pre), indent=2) + "\n")
    notes = export_notes(cfg, pre)
    readme = folder / "README.md"
    if notes:
        readme.write_text(f"# {cfg.name} {README_MARK}\n\n" + "\n\n".join(notes) + "\n")
    elif readme.is_file() and not readme.is_symlink() and _written_by_vitlab(readme):
        # an earlier export's notes (`convert --force` into the same folder) would describe another preprocessing
        readme.unlink()
    return folder


README_MARK = "(exported by vitlab)"  # the end of the first line of the README.md save_hf writes


def _written_by_vitlab(readme: Path) -> bool:
    """Whether README.md is an earlier export's notes (a model card of the user's own is left alone)."""
    with open(readme, encoding="utf-8", errors="replace") as fh:
        first = fh.readline(4096)
    return first.startswith("# ") and first.rstrip("\n").endswith(README_MARK)


def export_preprocess(config: Any, preprocess: Any) -> dict:
    """The preprocessing record `save_hf` writes: the one given, else the format's default (ViTImageProcessor's
    plain resize; torchvision's V1 evaluation for a ResNet)."""
    if hasattr(preprocess, "to_dict"):
        return preprocess.to_dict()
    if preprocess:
        return dict(preprocess)
    if config.arch == "resnet":
        from vitlab.weights.torchvision import resnet_v1_preprocess

        return resnet_v1_preprocess(config)
    return hf_default_preprocess(config)


def hf_processor(config: Any, pre: dict) -> dict:
    """preprocessor_config.json for `pre`, as a transformers processor class that computes it (4.x and 5.x):
    a plain resize is ViTImageProcessor; a squash + crop DeiTImageProcessor; a shorter-side resize + centre crop
    ConvNextImageProcessor for a ResNet where it is exact (a square crop below 384 px: the microsoft/resnet-*
    layout), else CLIPImageProcessor (the shortest edge to N, then the crop, at any size; `do_convert_rgb` off).
    A ResNet's record went through ConvNext always, which turned a plain resize into a crop, a squash into a
    shorter-side resize and lost a non-square size, a crop fraction, a resize of 384 px or more and (by float
    rounding of crop_pct) one pixel of some resizes, unsaid; a ViT's centre crop (every model vitlab trains
    records its centre square) was written as a plain resize, which squashes a wide photo the model saw cropped.
    Every one of these processors places its crop at (H - h) // 2: a crop_offset "floor" record is written exactly,
    a "round" one (torchvision's placement, vitlab's training) with a note (`crop_offset_note`)."""
    c = config.in_chans
    if config.arch == "resnet" and (proc := convnext_processor(pre)) is not None:
        return proc
    resample = _RESAMPLE_CODE.get(pre.get("interpolation", "bilinear"), 2)
    h, w = pre.get("image_size", config.image_size)
    proc = {"image_processor_type": "ViTImageProcessor", "do_resize": True, "resample": resample,
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": _per_channel(pre.get("mean", 0.5), c, "mean"),
            "image_std": _per_channel(pre.get("std", 0.5), c, "std"),
            "size": {"height": int(h), "width": int(w)}}
    resize = _effective_resize(pre)
    if resize is None:
        return proc
    crop = {"do_center_crop": True, "crop_size": {"height": int(h), "width": int(w)}}
    if pre.get("crop_mode") == "squash":  # the whole image to R x R, then the crop
        return {**proc, **crop, "image_processor_type": "DeiTImageProcessor", "size": {"height": resize, "width": resize}}
    return {**proc, **crop, "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": resize},
            "do_convert_rgb": False}  # CLIP's default would make a grey image RGB, which a 1-channel model refuses


def antialias_note(pre: dict) -> str | None:
    """What the export changes in a preprocessing that shrinks without anti-aliasing (the official checkpoints'
    TensorFlow resize): the Hugging Face processors always resize with anti-aliasing (PIL)."""
    if pre.get("antialias", True):
        return None
    h, w = pre.get("image_size", ("?", "?"))
    return (f"The preprocessing shrinks images to {h}x{w} without anti-aliasing (TensorFlow's tf.image.resize, "
            "the official evaluation); the Hugging Face processor's resize anti-aliases, so an image larger than "
            "that gives the model a slightly different input (vitlab reads the export back with anti-aliasing too). "
            "For the official evaluation's inputs, resize with tf.image.resize or torch's "
            "interpolate(antialias=False) before calling the processor.")


def crop_offset_note(pre: dict) -> str | None:
    """What the export changes in a centre crop placed as torchvision places it: transformers' processors floor."""
    from vitlab.data.preprocess import Preprocess

    if not Preprocess.from_dict(pre).crop_moves_under(HF_CROP_OFFSET):
        return None
    return ("The preprocessing places its centre crop at round((H - h) / 2) (torchvision's and timm's placement); "
            "the Hugging Face processor places it at (H - h) // 2, one pixel away where the margin H - h is 3, 7, "
            "11, ... (vitlab reads the export back with transformers' placement too).")


def export_notes(config: Any, pre: dict) -> list[str]:
    """What a user of an export must know (README.md, printed by `vitlab convert`): every resize and crop has its
    processor (`hf_processor`), the channel count, a non-square grid's interpolation, a resize without
    anti-aliasing and a rounded crop placement do not."""
    return [n for n in (channels_note(config), grid_note(config), antialias_note(pre), crop_offset_note(pre)) if n]


def grid_note(config: Any) -> str | None:
    """What a user of a non-square ViT export must know: transformers' `interpolate_pos_encoding` reshapes the
    position embeddings to a square grid (transformers 5.24, ViTEmbeddings), which fails on a non-square one."""
    if config.arch == "resnet" or config.image_size[0] == config.image_size[1]:
        return None
    (h, w), (gh, gw) = config.image_size, config.grid_size
    return (f"This model takes {h}x{w} images (a {gh}x{gw} grid of position embeddings). Call it at that size "
            "without `interpolate_pos_encoding`: transformers' interpolation assumes a square grid and fails here "
            f"(a reshape error). For other sizes, load the folder with vitlab.load(folder, image_size=(H, W)).")


def _per_channel(values: Any, channels: int, what: str) -> list[float]:
    """One normalisation value per input channel, as ViTImageProcessor checks (`image_mean` of length C)."""
    vals = [float(v) for v in (values if isinstance(values, (list, tuple)) else [values])]
    if len(set(vals)) == 1:  # one value for all channels (also a 3-value default on a 1-channel model)
        return vals[:1] * channels
    if len(vals) != channels:
        raise VitlabError(f"the preprocessing has {len(vals)} {what} values for a {channels}-channel model; "
                          "give one per channel (or one for all)")
    return vals


def channels_note(config: Any) -> str | None:
    """What a user of the export must know when the model does not take RGB: the Hugging Face processors do not
    convert colour images, so it must be given images with the model's channel count."""
    c = int(config.in_chans)
    if c == 3:
        return None
    if c == 1:
        return ("This model takes 1-channel (grayscale) images: call the image processor with grayscale input, "
                "e.g. `processor(Image.open(path).convert('L'), return_tensors='pt')`. An RGB image fails: in "
                "the processor with 'mean must have 3 elements' (image_mean/image_std have one value) where it "
                "resizes with PIL (transformers 4, or 5 without torchvision), in the model with 'Expected 1 but "
                "got 3' where it resizes with torchvision (transformers 5).")
    return (f"This model takes {c}-channel images: call the image processor with {c}-channel arrays (H, W, {c}); "
            "RGB images fail in the processor or the model (image_mean/image_std have one value per model "
            "channel).")


# ------------------------------------------------------------------ ResNetForImageClassification
# HF name (after the `resnet.` prefix) -> torchvision name. HF lists each block's `shortcut` before its
# `layer`, torchvision its `downsample` last: the mapping goes by name, never by position.
_HF_RESNET_KEY = re.compile(
    r"^encoder\.stages\.(\d+)\.layers\.(\d+)\.(?:layer\.(\d+)|(shortcut))\.(convolution|normalization)\.(\w+)$"
)
_BN_TENSORS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def _hf_to_torchvision_key(key: str) -> str | None:
    if key == "embedder.embedder.convolution.weight":
        return "conv1.weight"
    if key.startswith("embedder.embedder.normalization.") and key.rsplit(".", 1)[1] in _BN_TENSORS:
        return "bn1." + key.rsplit(".", 1)[1]
    if key in ("classifier.1.weight", "classifier.1.bias"):
        return "fc." + key.rsplit(".", 1)[1]
    m = _HF_RESNET_KEY.match(key)
    if not m:
        return None
    s, b, i, shortcut, part, tensor = m.groups()
    block = f"layer{int(s) + 1}.{b}."
    if part == "convolution":
        if tensor != "weight":
            return None
        return block + ("downsample.0.weight" if shortcut else f"conv{int(i) + 1}.weight")
    if tensor not in _BN_TENSORS:
        return None
    return block + ("downsample.1." if shortcut else f"bn{int(i) + 1}.") + tensor


def read_hf_resnet_state_dict(
    sd: dict[str, torch.Tensor], hf_cfg: dict | None, **overrides: Any
) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(config, vitlab state dict, meta) of a HF ResNet; the architecture comes from the shapes,
    config.json is checked for the options vitlab does not build (v1 stride, a strided first stage)."""
    from vitlab.weights.torchvision import fill_bn_counters, resnet_v1_preprocess, standard_resnet_config

    hf_cfg = dict(hf_cfg or {})
    if hf_cfg.get("downsample_in_bottleneck"):
        raise VitlabError("this Hugging Face ResNet has downsample_in_bottleneck=true (ResNet v1: stride on the first "
                          "1x1); vitlab builds v1.5 (stride on the 3x3) only")
    if hf_cfg.get("downsample_in_first_stage"):
        raise VitlabError("this Hugging Face ResNet has downsample_in_first_stage=true (a strided first stage); "
                          "vitlab builds torchvision's layout (first stage stride 1) only")
    if hf_cfg.get("hidden_act", "relu") != "relu":
        raise VitlabError(f"Hugging Face ResNet hidden_act {hf_cfg['hidden_act']!r} is not supported; only relu")
    out: dict[str, torch.Tensor] = {}
    left = []
    for k, v in sd.items():
        name = _hf_to_torchvision_key(k.removeprefix("resnet."))
        if name is None:
            left.append(k)
        else:
            out[name] = v
    if left:
        raise VitlabError(f"Hugging Face ResNet checkpoint has keys vitlab cannot place: {', '.join(left[:3])}"
                          + (f" ... ({len(left)} in all)" if len(left) > 3 else ""))
    extras = hf_cfg.get(HF_EXTRAS_KEY) if isinstance(hf_cfg.get(HF_EXTRAS_KEY), dict) else {}
    made_for = {k: extras[k] for k in ("image_size",) if k in extras}  # vitlab's own export
    config = standard_resnet_config(out, "Hugging Face ResNet", **{**made_for, **overrides})
    layer_type = hf_cfg.get("layer_type")
    if layer_type is not None and layer_type != config.resnet.block:
        raise VitlabError(f"config.json says layer_type {layer_type!r} but the weights hold {config.resnet.block} "
                          "blocks; the folder is inconsistent")
    config = config.replace(name=extras.get("name") if isinstance(extras.get("name"), str) else f"hf-{config.name}")
    meta = {"format": "hf", "class_names": _class_names(hf_cfg, config.num_classes),
            "preprocess": resnet_v1_preprocess(config)}
    return config, fill_bn_counters(out), meta


def _is_convnext_processor(pp: dict) -> bool:
    kind = str(pp.get("image_processor_type") or pp.get("feature_extractor_type") or "")
    return kind.startswith("ConvNext") or "crop_pct" in pp


def preprocess_from_convnext(pp: dict, config: ViTConfig) -> dict:
    """ConvNextImageProcessor (what microsoft/resnet-* ship): shortest edge N < 384 -> resize to
    int(N / crop_pct), centre crop N; N >= 384 -> warp to N x N. Class defaults (mean/std 0.5,
    crop_pct 224/256, N 384, bilinear) apply only where the file is silent."""
    c = config.in_chans
    size = pp.get("size", 384)
    edge = int(size.get("shortest_edge", 384)) if isinstance(size, dict) else int(size)
    crop_pct = float(pp.get("crop_pct") or 224 / 256)
    out = {"image_size": [edge, edge], "resize": int(edge / crop_pct) if edge < 384 else None,
           "crop_fraction": 1.0, "interpolation": _interpolation(pp), "channels": c}
    if out["resize"] is not None:  # ConvNext's crop is transformers' center_crop: floor
        out["crop_offset"] = HF_CROP_OFFSET
    if pp.get("do_normalize", True):
        mean, std = pp.get("image_mean", [0.5] * 3), pp.get("image_std", [0.5] * 3)
        out["mean"] = list(mean)[:c] if isinstance(mean, (list, tuple)) else [float(mean)] * c
        out["std"] = list(std)[:c] if isinstance(std, (list, tuple)) else [float(std)] * c
    else:
        out["mean"], out["std"] = [0.0] * c, [1.0] * c
    out["mean"], out["std"] = _fold_rescale(pp, out["mean"], out["std"])
    return out


def convnext_processor(pre: dict) -> dict | None:
    """vitlab preprocessing -> the ConvNextImageProcessor config HF ResNets use, or None where ConvNext would
    compute something else: it resizes the shortest edge to int(N / crop_pct) and crops N x N below N = 384 (at 384
    and above it warps to N x N), so only a square shorter-side resize + crop below 384 px is expressed."""
    h, w = pre.get("image_size", [224, 224])
    resize = _effective_resize(pre)
    if resize is None or pre.get("crop_mode", "center") != "center" or h != w or h >= 384:
        return None
    # int(h / (h / resize)) is resize - 1 for some pairs (34 / (34 / 50) = 49.99...); the next smaller float
    # crop_pct gives back resize exactly, as transformers and vitlab's reader compute it
    crop_pct = float(h) / float(resize)
    for _ in range(4):
        if int(h / crop_pct) == resize:
            break
        crop_pct = math.nextafter(crop_pct, 0.0)
    else:
        return None
    resample = _RESAMPLE_CODE.get(pre.get("interpolation", "bilinear"), 2)
    return {"image_processor_type": "ConvNextImageProcessor", "do_resize": True, "size": {"shortest_edge": int(h)},
            "crop_pct": crop_pct, "resample": resample, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": list(pre.get("mean", [0.485, 0.456, 0.406])),
            "image_std": list(pre.get("std", [0.229, 0.224, 0.225]))}


def _effective_resize(pre: dict) -> int | None:
    """The side a preprocessing record resizes to before its centre crop (`Preprocess.effective_resize`)."""
    from vitlab.data.preprocess import Preprocess

    return Preprocess.from_dict(pre).effective_resize


def to_hf_resnet_state_dict(model: nn.Module) -> tuple[dict, dict[str, torch.Tensor]]:
    """(HF config.json dict, state dict) of a StandardResNet for `ResNetForImageClassification` (or
    `ResNetModel` without a head)."""
    cfg: ViTConfig = model.config
    r = cfg.resnet
    if r.stem != "bit":
        raise VitlabError("Hugging Face ResNets always have the 7x7 stride-2 stem; a small-stem ResNet cannot be "
                          "exported to Hugging Face; use --to native or --to timm")
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    inverse: dict[str, str] = {}
    n_convs = 3 if r.block == "bottleneck" else 2
    for s, depth in enumerate(r.layers):
        for b in range(depth):
            src, dst = f"layer{s + 1}.{b}.", f"encoder.stages.{s}.layers.{b}."
            for i in range(n_convs):
                inverse[f"{src}conv{i + 1}.weight"] = f"{dst}layer.{i}.convolution.weight"
                for t in _BN_TENSORS:
                    inverse[f"{src}bn{i + 1}.{t}"] = f"{dst}layer.{i}.normalization.{t}"
            inverse[f"{src}downsample.0.weight"] = f"{dst}shortcut.convolution.weight"
            for t in _BN_TENSORS:
                inverse[f"{src}downsample.1.{t}"] = f"{dst}shortcut.normalization.{t}"
    inverse["conv1.weight"] = "embedder.embedder.convolution.weight"
    for t in _BN_TENSORS:
        inverse[f"bn1.{t}"] = f"embedder.embedder.normalization.{t}"
    head = bool(cfg.num_classes)
    prefix = "resnet." if head else ""
    out = {}
    for k, v in sd.items():
        if k in ("fc.weight", "fc.bias"):
            out["classifier.1." + k.split(".")[1]] = v
        else:
            out[prefix + inverse[k]] = v
    width = r.width
    hf_cfg = {
        "architectures": ["ResNetForImageClassification" if head else "ResNetModel"], "model_type": "resnet",
        "num_channels": cfg.in_chans, "embedding_size": width,
        "hidden_sizes": [width * 2**i * r.expansion for i in range(len(r.layers))], "depths": list(r.layers),
        "layer_type": r.block, "hidden_act": "relu", "downsample_in_first_stage": False,
        "downsample_in_bottleneck": False,
        # a ResNet takes any size: the one it was made for (export's default, preprocessing) is vitlab's to keep
        HF_EXTRAS_KEY: {"image_size": list(cfg.image_size), "name": cfg.name},
    }
    return hf_cfg, {k: v.contiguous().clone() for k, v in out.items()}
