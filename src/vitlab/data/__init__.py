"""vitlab.data: image sources (folders, CSV, IDX, CIFAR, digits, bundled), batched transforms, loaders."""

from vitlab.data.images import open_image
from vitlab.data.preprocess import Preprocess

__all__ = ["Preprocess", "open_image"]
