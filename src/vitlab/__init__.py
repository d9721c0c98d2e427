"""vitlab: the Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., ICLR 2021).

    model = vitlab.create_model("vit-b/16", num_classes=10)    # timm's and Hugging Face's names work too
    vitlab.list_models("vit-b*")                               # the named models; pretrained=True: checkpoints
    vitlab.save(model, "my-vit"); vitlab.load("my-vit")        # any format in (docs/weights.md)
"""

import importlib.metadata as _metadata
import typing as _typing

from vitlab.errors import VitlabError

if _typing.TYPE_CHECKING:  # the annotations below are strings: `import vitlab` stays free of torch
    from pathlib import Path
    from typing import Any

    from torch import nn

try:
    __version__ = _metadata.version("vitlab")
except _metadata.PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

# Imported on first use (PEP 562), so that `import vitlab` and the `vitlab` command start without torch.
_FROM_MODELS = ("ResNetConfig", "ViTConfig", "VisionTransformer", "create_model", "get_config", "model_names")
# The documented subpackages, reachable as `vitlab.weights.load_with_meta(...)` after a plain `import vitlab`
# (imported on first attribute access, like the names above, not at `import vitlab`).
_SUBMODULES = ("data", "engine", "evaluate", "experiments", "export", "inspect", "models", "runtime", "train", "weights")


def __getattr__(name: str):
    if name in _FROM_MODELS:
        import vitlab.models

        value = getattr(vitlab.models, name)
        globals()[name] = value  # later look-ups skip this function
        return value
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"vitlab.{name}")  # the import also sets the attribute on vitlab
    raise AttributeError(f"module 'vitlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FROM_MODELS) | set(_SUBMODULES))


def load(
    path: "str | Path",
    num_classes: "int | None" = None,
    image_size: "int | tuple[int, int] | None" = None,
    keep_representation: bool = False,
    **overrides: "Any",
) -> "nn.Module":
    """Load weights of any supported format into a ready model in eval mode (like `from_pretrained`).

    `path`: a vitlab folder, a Hugging Face or timm folder or file, an official .npz, a torchvision .pth, a run
    folder or checkpoint, a published checkpoint name (`vitlab.list_models(pretrained=True)`) or `hf:ORG/NAME`.
    `num_classes` puts a new zero-initialised head on (dropping the representation layer unless
    `keep_representation`); `image_size` resamples the position embeddings; `overrides` set config fields the file
    cannot tell (`heads=4`, `classifier="token"`). See `vitlab.weights.load`; `vitlab.weights.load_with_meta` also
    gives the stored class names and preprocessing. `features_only=True` (with `out_indices`) gives a feature
    extractor, as in `create_model`.
    """
    from vitlab.models.features import FeatureExtractor, feature_options
    from vitlab.weights import load as _load

    features, overrides = feature_options(overrides)
    model = _load(path, num_classes=num_classes, image_size=image_size, keep_representation=keep_representation,
                  **overrides)
    return model if features is None else FeatureExtractor(model, **features)


def save(model: "nn.Module", folder: "str | Path", class_names: "list[str] | None" = None,
         preprocess: "Any" = None) -> "Path":
    """Write `model` to `folder` in vitlab's format (config.json + model.safetensors), like `save_pretrained`;
    `vitlab.load(folder)` gives it back to the bit, and every command takes the folder. Returns the folder.

    A bare `torch.save(model.state_dict())` loses the config (see `vitlab.weights.save_native`); `vitlab convert
    --to hf|timm` writes the peers' formats."""
    from vitlab.weights import save_native

    return save_native(model, folder, class_names=class_names, preprocess=preprocess)


def list_models(filter: "str | list[str]" = "", pretrained: bool = False) -> "list[str]":
    """The names `create_model` takes, like `timm.list_models("vit*")`: wildcard patterns (fnmatch,
    case-insensitive; a list matches any of them), in the order of the paper's tables; all without a filter.

    `pretrained=True` lists the published checkpoints instead (`"vit-b/16.augreg-in21k"`), which
    `create_model(name, pretrained=True)` and `vitlab.load(name)` take; `vitlab models [PATTERN]` shows the same.
    """
    if pretrained:
        from vitlab.weights.pretrained import PRETRAINED

        return _match_names(list(PRETRAINED), filter)
    from vitlab.models import model_names

    return _match_names(model_names(), filter)


def _match_names(names: "list[str]", patterns: "str | list[str] | None") -> "list[str]":
    """The names (in their order) that match one of the wildcard `patterns` (fnmatch, case-insensitive);
    all of them without patterns. What `vitlab models PATTERN` and `vitlab.list_models(PATTERN)` filter with."""
    if not patterns:
        return list(names)
    import fnmatch

    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    wanted = [p.strip().lower() for p in patterns]
    return [n for n in names if any(fnmatch.fnmatchcase(n.lower(), p) for p in wanted)]


__all__ = [
    "ResNetConfig", "ViTConfig", "VisionTransformer", "VitlabError", "__version__",
    "create_model", "get_config", "list_models", "load", "model_names", "save",
]
