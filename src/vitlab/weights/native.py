"""The native vitlab format: a folder with `config.json` (model config, class names, preprocessing)
and `model.safetensors` (the state dict under vitlab/timm key names)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.models.config import ViTConfig
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


def default_preprocess(config: ViTConfig) -> dict:
    """The official evaluation preprocessing: plain resize to the model's size, values to [-1, 1]."""
    c = config.in_chans
    return {
        "image_size": list(config.image_size), "mean": [0.5] * c, "std": [0.5] * c,
        "resize": None, "crop_fraction": 1.0, "interpolation": "bilinear", "channels": c,
    }


def save_native(model: nn.Module, folder: str | Path, class_names: list[str] | None = None, preprocess: Any = None) -> Path:
    """Write `folder/config.json` + `folder/model.safetensors`; `load(folder)` gives the same model back."""
    from safetensors.torch import save_file

    for wrapper in ("module", "_orig_mod"):  # DistributedDataParallel, torch.compile
        model = getattr(model, wrapper, model)
    config: ViTConfig = model.config
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if class_names is not None:
        class_names = [str(c) for c in class_names]
        if config.num_classes and len(class_names) != config.num_classes:
            raise VitlabError(
                f"{len(class_names)} class names given for a model with {config.num_classes} outputs"
            )
    meta = {
        "format": FORMAT,
        "model": config.to_dict(),
        "class_names": class_names,
        "preprocess": _preprocess_dict(preprocess) or default_preprocess(config),
    }
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def is_native(folder: Path) -> bool:
    data = folder_config(folder) if folder.is_dir() else None
    return data is not None and data.get("format") == FORMAT


def read_native(folder: str | Path) -> tuple[ViTConfig, dict[str, torch.Tensor], dict]:
    """(model config, state dict, meta with class_names and preprocess dict) of a native folder."""
    from vitlab.weights.io import read_tensors

    folder = Path(folder)
    try:
        meta = json.loads((folder / CONFIG_FILE).read_text())
    except ValueError as exc:
        raise VitlabError(f"{folder / CONFIG_FILE} is not valid JSON ({exc})") from exc
    if "model" not in meta:
        raise VitlabError(f"{folder / CONFIG_FILE} has no 'model' section; was it written by vitlab?")
    config = ViTConfig.from_dict(meta["model"])
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise VitlabError(f"{folder} has a config.json but no {WEIGHTS_FILE}")
    state = read_tensors(weights)
    return config, state, {"class_names": meta.get("class_names"), "preprocess": meta.get("preprocess")}
