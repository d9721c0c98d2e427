"""vitlab: the Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., ICLR 2021)."""

from importlib.metadata import PackageNotFoundError, version

from vitlab.errors import VitlabError

try:
    __version__ = version("vitlab")
except PackageNotFoundError:  # running from a source tree without installation
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


def load(path, num_classes=None, image_size=None, **kwargs):
    """Load weights of any supported format into a ready model (see `vitlab.weights.load`)."""
    from vitlab.weights import load as _load

    return _load(path, num_classes=num_classes, image_size=image_size, **kwargs)


def save(model, folder, class_names=None, preprocess=None):
    """Write `model` to `folder` in vitlab's format (config.json + model.safetensors); `vitlab.load(folder)` gives
    it back to the bit. A bare `torch.save(model.state_dict())` loses the config (see `vitlab.weights.save_native`)."""
    from vitlab.weights import save_native

    return save_native(model, folder, class_names=class_names, preprocess=preprocess)


__all__ = [
    "ResNetConfig", "ViTConfig", "VisionTransformer", "VitlabError", "__version__",
    "create_model", "get_config", "load", "model_names", "save",
]
