"""The native vitlab format: a folder with `config.json` (model config, class names, preprocessing)
and `model.safetensors` (the state dict under vitlab/timm key names)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.models.config import ResNetConfig, ViTConfig
from vitlab.weights.io import folder_config

FORMAT = "vitlab"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def _preprocess_dict(preprocess: Any) -> dict | None:
    if preprocess is None:
        return None
    if isinstance(preprocess, dict):
        return dict(preprocess)
    if hasattr(preprocess, "to_dict"):
        return preprocess.to_dict()
    raise VitlabError(f"preprocess must be a Preprocess or a dict, got {type(preprocess).__name__}")


def default_preprocess(config: ViTConfig, antialias: bool = True) -> dict:
    """The official evaluation preprocessing: plain resize to the model's size, values to [-1, 1]; the official
    checkpoints' own records shrink without anti-aliasing (`antialias=False`: TensorFlow's `tf.image.resize`)."""
    c = config.in_chans
    return {
        "image_size": list(config.image_size), "mean": [0.5] * c, "std": [0.5] * c,
        "resize": None, "crop_fraction": 1.0, "interpolation": "bilinear", "channels": c, "antialias": antialias,
    }


def save_native(model: nn.Module, folder: str | Path, class_names: list[str] | None = None, preprocess: Any = None) -> Path:
    """Write `folder/config.json` + `folder/model.safetensors`; `load(folder)` gives the same model back."""
    from vitlab.models.features import FeatureExtractor
    from vitlab.weights import model_record
    from vitlab.weights.io import save_safetensors

    model = unwrapped(model)
    if isinstance(model, FeatureExtractor):
        # a features_only extractor: its model is cut (blocks, final norm, head), which no config describes
        raise VitlabError("a features_only extractor is not saved itself: save the whole model, then rebuild the "
                          "extractor with vitlab.load(FOLDER, features_only=True, out_indices=...); or save "
                          "extractor.state_dict() with safetensors")
    class_names, preprocess = model_record(model, class_names, preprocess)  # what vitlab.load read, by default
    config = getattr(model, "config", None)
    if not isinstance(config, (ViTConfig, ResNetConfig)):
        raise VitlabError(f"{type(model).__name__} is not a vitlab model (no vitlab config to write); save a model "
                          "from vitlab.create_model or vitlab.load, or convert a peer's with `vitlab convert`")
    check_savable(model)
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise VitlabError(f"{folder} is a file; vitlab's format is a folder (config.json + model.safetensors)")
    if class_names is not None:
        class_names = [str(c) for c in class_names]
        if config.num_classes and len(class_names) != config.num_classes:
            raise VitlabError(
                f"{len(class_names)} class names given for a model with {config.num_classes} outputs"
            )
    folder.mkdir(parents=True, exist_ok=True)
    meta = native_meta(config, class_names, preprocess)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    save_safetensors(state, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel or torch.compile wrapper (the one that holds the config)."""
    for wrapper in ("module", "_orig_mod"):
        model = getattr(model, wrapper, model)
    return model


def check_savable(model: nn.Module) -> None:
    """Refuse, before anything is written, a model whose tensors are not those its config builds: a saved folder
    holds the config and the tensors, and `vitlab.load` rebuilds the model from the config, so a module put in by
    hand (a stack of layers, or a Linear without bias, as the head) was written and failed only at load."""
    from vitlab.weights.limits import model_shapes, shape_problems

    if not hasattr(getattr(model, "config", None), "to_dict"):  # not a vitlab model: the caller says so
        return
    expected = model_shapes(model.config)
    found = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    head = getattr(model, "_head_name", "head")
    described = _hand_put_head(model, expected, found)
    if described is not None:
        raise VitlabError(_head_refusal(described, head, expected.get(f"{head}.weight")))
    problems = shape_problems(expected, found)
    if problems:
        raise VitlabError(f"{type(model).__name__}'s weights are not those its config builds ({'; '.join(problems)}), "
                          "so vitlab.load could not rebuild it; vitlab saves only the modules its config describes: "
                          "undo the change, or save model.state_dict() with safetensors yourself")


def hand_put_head(model: nn.Module) -> str | None:
    """'model.head is Sequential(Dropout, Linear)' where the head's tensors are not those the config builds (a head
    put in by hand), else None."""
    from vitlab.weights.limits import model_shapes

    return _hand_put_head(model, model_shapes(model.config), {k: tuple(v.shape) for k, v in model.state_dict().items()})


def _hand_put_head(model: nn.Module, expected: dict, found: dict) -> str | None:
    """`hand_put_head` from the shapes the config builds and those the model holds."""
    from vitlab.weights.limits import shape_problems

    head = getattr(model, "_head_name", "head")
    in_head = f"{head}."
    problems = shape_problems({k: v for k, v in expected.items() if k.startswith(in_head)},
                              {k: v for k, v in found.items() if k.startswith(in_head)})
    return f"model.{head} is {_describe(getattr(model, head, None))}" if problems else None


def _head_refusal(described: str, head: str, weight_shape: tuple[int, ...] | None) -> str:
    """The line that says which head vitlab's format stores and how to get there."""
    if weight_shape is None:  # a model without classes: no head
        stored, reset = "nn.Identity() (the model has num_classes=0)", "model.reset_classifier(0)"
    else:
        classes, width = weight_shape[0], weight_shape[-1]
        stored = f"one nn.Linear({width}, {classes}) with a bias"
        reset = f"model.{head} = nn.Linear({width}, {classes}) (or model.reset_classifier({classes}))"
    return (f"{described}, but a saved vitlab model's {head} is {stored}, "
            f"which vitlab.load rebuilds from the config; set {reset} before saving, or save model.state_dict() "
            "with safetensors and rebuild this head yourself after loading")


def _describe(module: Any) -> str:
    """`Linear(32, 5, bias=False)`, `Sequential(Linear, ReLU, Linear)`: a module in a few words."""
    if isinstance(module, nn.Linear):
        return f"Linear({module.in_features}, {module.out_features}{'' if module.bias is not None else ', bias=False'})"
    children = [type(c).__name__ for c in module.children()] if isinstance(module, nn.Module) else []
    return f"{type(module).__name__}({', '.join(children)})" if children else type(module).__name__


def native_meta(config: ViTConfig | ResNetConfig, class_names: list[str] | None, preprocess: Any = None) -> dict:
    """The record config.json holds (training checkpoints keep the same one under "model_meta")."""
    return {
        "format": FORMAT,
        "model": config.to_dict(),
        "class_names": class_names,
        "preprocess": _preprocess_dict(preprocess) or default_preprocess(config),
    }


def is_native(folder: Path) -> bool:
    data = folder_config(folder) if folder.is_dir() else None
    return data is not None and data.get("format") == FORMAT


def _class_names(names: Any, config: ViTConfig, source: Path) -> list[str] | None:
    """None, or one string per output of the model."""
    if names is None:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise VitlabError(f"{source}: class_names must be a list of strings or null; fix or remove it")
    if config.num_classes and len(names) != config.num_classes:
        raise VitlabError(f"{source} lists {len(names)} class names for a model with {config.num_classes} outputs; "
                          "fix class_names (or set it to null)")
    return names


def read_native(folder: str | Path) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(model config, state dict, meta with class_names and preprocess dict) of a native folder.

    Bounded before allocating: config.json is size-limited, the model config typed and within the
    documented limits, the stored preprocessing consistent with the model, and the tensors in the
    safetensors header exactly those the config implies, all before a tensor is read."""
    from vitlab.weights.io import read_json, read_tensors, safetensors_shapes
    from vitlab.weights.limits import check_shapes_fit, model_shapes

    folder = Path(folder)
    cfg_path = folder / CONFIG_FILE
    config, meta = parse_meta(read_json(cfg_path, "vitlab config.json"), cfg_path)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        if weights.exists():  # a folder or a FIFO of that name: say so, rather than that it is missing
            raise VitlabError(f"{weights} is not a regular file (a folder, a FIFO or a device); {folder} needs its "
                              f"weights in a {WEIGHTS_FILE} file")
        raise VitlabError(f"{folder} has a config.json but no {WEIGHTS_FILE}")
    check_shapes_fit(model_shapes(config), safetensors_shapes(weights), str(weights))
    state = read_tensors(weights)
    return config, state, meta


def parse_meta(meta: Any, source: Path) -> tuple[ViTConfig, dict]:
    """(model config, meta with class_names and preprocess dict) of what `save_native` writes to config.json
    (training checkpoints hold the same record)."""
    from vitlab.weights.limits import validate_preprocess

    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise VitlabError(f"{source} has no 'model' section; was it written by vitlab?")
    try:
        config = ViTConfig.from_dict(meta["model"])
    except VitlabError as exc:
        raise VitlabError(f"{source}: {exc}") from exc
    class_names = _class_names(meta.get("class_names"), config, source)
    preprocess = validate_preprocess(meta.get("preprocess"), config, str(source))
    return config, {"class_names": class_names, "preprocess": preprocess}
