"""Weights in and out: one `load(...)` that detects the format and returns a ready model."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.models.registry import build_model


def load_state_dict_strict(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Load with one clear error naming the first missing/unexpected keys and shape mismatches."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    mismatched = [
        f"{k} (model {tuple(expected[k].shape)}, file {tuple(state_dict[k].shape)})"
        for k in expected if k in state_dict and expected[k].shape != state_dict[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {missing[:3]}{' ...' if len(missing) > 3 else ''} ({len(missing)} in all)")
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''} ({len(unexpected)} in all)")
    if mismatched:
        problems.append(f"shape mismatch {mismatched[:3]}{' ...' if len(mismatched) > 3 else ''}")
    if problems:
        raise VitlabError(f"{source} does not fit the model: " + "; ".join(problems))
    model.load_state_dict(state_dict, strict=True)


def load(
    path: str | Path,
    num_classes: int | None = None,
    image_size: int | tuple[int, int] | None = None,
    keep_representation: bool = False,
) -> nn.Module:
    """Load a checkpoint into a ready model, inferring the model config from the file.

    `num_classes` different from the file's drops the head (and the representation layer unless
    `keep_representation`) and adds a zero-initialised head (paper B.1.1); `image_size` resamples
    the position embeddings to the new grid (paper 3.2).
    """
    from vitlab.weights import official

    p = Path(path)
    if not p.exists():
        raise VitlabError(f"no such file or folder: {p}")
    if p.suffix == ".npz":
        arrays = official.read_npz(p)
        if not official.is_official_npz(arrays):
            raise VitlabError(f"{p} is an .npz but not an official ViT checkpoint (no 'embedding/kernel')")
        config = official.infer_config(arrays)
        sd = official.to_state_dict(arrays, config)
    else:
        raise VitlabError(f"unknown checkpoint format: {p}")
    model = build_model(config)
    load_state_dict_strict(model, sd, str(p))
    return adapt(model, num_classes, image_size, keep_representation)


def adapt(
    model: nn.Module,
    num_classes: int | None = None,
    image_size: int | tuple[int, int] | None = None,
    keep_representation: bool = False,
) -> nn.Module:
    """Fine-tuning surgery: new zero-initialised head for `num_classes`, position embeddings for `image_size`."""
    cfg = model.config
    if num_classes is not None and (num_classes != cfg.num_classes or (cfg.representation_size and not keep_representation)):
        model.reset_classifier(num_classes, keep_representation=keep_representation)
    if image_size is not None:
        if hasattr(model, "set_image_size"):
            model.set_image_size(image_size)
        else:
            model.config = model.config.replace(image_size=image_size)
    return model.eval()
