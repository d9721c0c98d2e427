"""vitlab: the Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., ICLR 2021)."""

from importlib.metadata import PackageNotFoundError, version

from vitlab.errors import VitlabError
from vitlab.models import ResNetConfig, VisionTransformer, ViTConfig, create_model, get_config, model_names

try:
    __version__ = version("vitlab")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"


def load(path, num_classes=None, image_size=None, **kwargs):
    """Load weights of any supported format into a ready model (see `vitlab.weights.load`)."""
    from vitlab.weights import load as _load

    return _load(path, num_classes=num_classes, image_size=image_size, **kwargs)


__all__ = [
    "ResNetConfig", "ViTConfig", "VisionTransformer", "VitlabError", "__version__",
    "create_model", "get_config", "load", "model_names",
]
