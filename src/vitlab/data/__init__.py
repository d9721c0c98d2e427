"""vitlab.data: image sources (folders, CSV, IDX, CIFAR, digits, bundled, WebDataset tar shards, Hugging Face
datasets), batched transforms, loaders.

    splits = load_data("fashion-mnist", classes="Sandal,Sneaker,Ankle boot", per_class=100, seed=0)
    loader = make_loader(splits.train, 256, shuffle=True, seed=0, epoch=0)
    train_tf = build_train_transform(TransformConfig(image_size=28, channels=1))
    for images, labels in loader:          # uint8 (B, C, H, W), int64 (B,)
        x = train_tf(images.to(device))    # float (B, C, 28, 28) in [-1, 1]
"""

from vitlab.data.dataset import DataSplits, FileImageDataset, ImageDataset, skipped_summary, write_skipped
from vitlab.data.images import BadImageError, open_image
from vitlab.data.load import NAMED_SOURCES, load_data, read_source
from vitlab.data.preprocess import Preprocess
from vitlab.data.splits import parse_classes

__all__ = [
    "NAMED_SOURCES", "BadImageError", "DataSplits", "FileImageDataset", "ImageDataset", "Preprocess",
    "load_data", "make_loader", "open_image", "parse_classes", "read_source", "skipped_summary", "write_skipped",
]


def __getattr__(name):  # lazy: loader and transforms pull in kornia / DataLoader only when used
    if name == "make_loader":
        from vitlab.data.loader import make_loader

        return make_loader
    if name in ("TransformConfig", "build_train_transform", "build_eval_transform", "mix_batch"):
        from vitlab.data import transforms

        return getattr(transforms, name)
    raise AttributeError(f"module 'vitlab.data' has no attribute {name!r}")
