"""vitlab's own training checkpoints as weights: `RUN/checkpoints/best.pt` (the best validation score) and
`step-N.pt` load like a model folder, in `vitlab.load` and every command.

A checkpoint holds the model's weights next to the optimizer, the RNG states and the training config, and (from
vitlab 0.2.0 on) the record the run's `model/config.json` holds: the model config, class names and preprocessing.
An older checkpoint borrows that record from its run's `model/` folder, which has the same architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vitlab.errors import VitlabError

META_KEY = "model_meta"  # what save_native writes to config.json, kept in the checkpoint under this key


def is_run_checkpoint(obj: Any) -> bool:
    """A vitlab training checkpoint: weights, optimizer state and the training config in one dict."""
    return (isinstance(obj, dict) and isinstance(obj.get("model"), dict) and isinstance(obj.get("config"), dict)
            and "optimizer" in obj)


def read_run_checkpoint(obj: dict, path: Path) -> tuple[Any, dict[str, torch.Tensor], dict]:
    """(model config, state dict, meta with class_names and preprocess) of a loaded training checkpoint."""
    from vitlab.weights.io import read_json, unwrap_state_dict
    from vitlab.weights.native import CONFIG_FILE, is_native, parse_meta

    state = unwrap_state_dict(obj["model"], str(path))
    if obj.get(META_KEY) is not None:
        config, meta = parse_meta(obj[META_KEY], path)
    else:
        folder = path.parent.parent / "model"
        if path.parent.name != "checkpoints" or not is_native(folder):
            raise VitlabError(f"{path} is a vitlab training checkpoint written before checkpoints kept their model's "
                              "config, and its run has no model/ folder beside checkpoints/ to take it from; load "
                              "the run's model/ folder, or finish the run with `vitlab train --resume` first")
        config, meta = parse_meta(read_json(folder / CONFIG_FILE, "vitlab config.json"), folder / CONFIG_FILE)
    return config, state, {**meta, "format": "checkpoint"}
