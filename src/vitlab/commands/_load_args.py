"""Flags that say how to read a weights file when the file cannot tell (convert, predict, evaluate):
`--heads`, `--model-args` (heads=4,classifier=token,gelu=tanh,image_size=HxW) and the sizes they take."""

from __future__ import annotations

import argparse
from typing import Any

from vitlab.commands._argtypes import positive_int

# What every command that takes weights accepts (one rule: vitlab.weights.resolve_model).
WEIGHTS_HELP = ("weights: a file (.npz, .safetensors, .pth/.bin), a model folder (vitlab, Hugging Face, timm), a run "
                "folder (its RUN/model), a pretrained name (`vitlab models --pretrained`, e.g. "
                "vit-b/16.augreg-in21k-ft-in1k-224), hf:ORG/NAME or an official file name (ViT-B_16)")


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """`--heads` and `--model-args`, the overrides `vitlab.load(path, **overrides)` takes."""
    p.add_argument("--heads", type=positive_int, default=None,
                   help="attention heads, for timm/torchvision files of a non-standard width")
    p.add_argument("--model-args", default=None,
                   help="config fields the file cannot tell, e.g. heads=4,classifier=token,gelu=tanh "
                        "(image_size=HxW: the size a non-square file was made for)")


def model_folder_name(spec: str) -> str:
    """A model argument as part of a default output folder's name (eval-<this>-test, inspect-<this>): its last
    path part, with what a folder name should not hold (/, parentheses, commas) as dashes."""
    import re
    from pathlib import Path

    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(spec).name or spec)
    # 'custom(dim=32,patch_size=7)' gave 'custom-dim-32-patch_size-7-', and eval-...-7--test after it
    return re.sub(r"-{2,}", "-", name).strip("-") or "model"


def weights_folder_name(spec: str) -> str:
    """`model_folder_name` of a model argument, a weights file without its suffix: eval-ViT-B_16-test and
    inspect-ViT-B_16, not ...ViT-B_16.npz... (evaluate kept the suffix where inspect dropped it)."""
    from pathlib import Path

    path = Path(spec).expanduser()
    return model_folder_name(path.stem if path.is_file() else spec)


def parse_image_size(text: str) -> int | tuple[int, int]:
    """'384' -> 384; '384x512', '384,512' or [384, 512] -> (384, 512)."""
    if isinstance(text, int):
        return text
    if isinstance(text, (list, tuple)) and len(text) == 2:
        return (int(text[0]), int(text[1]))
    parts = str(text).lower().strip("[]() ").replace(",", "x").split("x")
    try:
        sizes = [int(part) for part in parts]
    except ValueError:
        sizes = []
    if len(sizes) == 1 and sizes[0] > 0:
        return sizes[0]
    if len(sizes) == 2 and min(sizes) > 0:
        return (sizes[0], sizes[1])
    raise argparse.ArgumentTypeError(f"image size {text!r} is not S or HxW (e.g. 224 or 224x320)")


def load_overrides(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """(config overrides, image size to load at) from --heads, --model-args and --image-size."""
    from vitlab.errors import VitlabError
    from vitlab.values import parse_kv
    from vitlab.weights.timm import check_override_fields

    overrides = parse_kv(args.model_args) if getattr(args, "model_args", None) else {}
    if getattr(args, "heads", None):
        overrides["heads"] = args.heads
    image_size = getattr(args, "image_size", None)
    if "image_size" in overrides:  # the file's own size: the same as --image-size for loading
        try:
            file_size = parse_image_size(overrides.pop("image_size"))
        except argparse.ArgumentTypeError as exc:
            raise VitlabError(f"--model-args {exc}") from None
        if image_size is not None and parse_image_size(image_size) != file_size:
            raise VitlabError("--model-args image_size (the file's size) and --image-size (a new size) differ; "
                              "convert at the file's size first, then resample with --image-size")
        image_size = file_size
    check_override_fields({k: v for k, v in overrides.items() if k != "ws_eps"})  # ws_eps: BiT ResNets' own
    return overrides, image_size
