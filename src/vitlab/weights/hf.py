"""Hugging Face transformers ViT folders (in and out)."""

from __future__ import annotations

import json
from pathlib import Path


def is_hf_folder(folder: Path) -> bool:
    cfg = folder / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except ValueError:
        return False
    return data.get("model_type") == "vit" or "hidden_size" in data


def is_hf_state_dict(sd) -> bool:
    return any("patch_embeddings.projection.weight" in k for k in sd)
