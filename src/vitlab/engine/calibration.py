"""Calibration images for static int8: the user's own images, preprocessed exactly as for inference."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from vitlab.errors import VitlabError

CALIBRATION_IMAGES = 256  # ranges settle long before this; ORT's own examples calibrate on a few hundred


def _batches(tensors: list[torch.Tensor], batch: int = 32) -> list[np.ndarray]:
    return [torch.stack(tensors[i:i + batch]).numpy() for i in range(0, len(tensors), batch)]


def calibration_from_files(files: Sequence[str | Path], preprocess, limit: int = CALIBRATION_IMAGES) -> list[np.ndarray]:
    """Up to `limit` image files (evenly spread over the list), decoded and preprocessed (read ahead in threads, as
    `vitlab predict` reads); unreadable ones skipped."""
    from vitlab.data.images import open_image
    from vitlab.predict import prefetched

    files = list(files)
    step = max(1, len(files) // limit)
    tensors, unread = [], []
    for _, tensor in prefetched(files[::step][:limit], lambda path: preprocess(open_image(path)), ahead=32):
        try:
            tensors.append(tensor.result())
        except VitlabError as exc:
            unread.append(exc)
    if unread and not tensors:  # else the command said it had no calibration images, as if none were given
        raise VitlabError(f"none of the {len(unread)} calibration images could be read ({unread[0]})")
    return _batches(tensors)


def calibration_from_dataset(dataset, preprocess, limit: int = CALIBRATION_IMAGES, seed: int = 0) -> list[np.ndarray]:
    """A seeded sample of `limit` rows of a vitlab data set (uint8 images), preprocessed for the model."""
    rows = np.random.default_rng(seed).permutation(len(dataset))[:limit]
    tensors = [preprocess.batch(dataset[int(i)][0].unsqueeze(0))[0] for i in rows]
    return _batches(tensors)


def calibration_from_source(source: str, preprocess, limit: int = CALIBRATION_IMAGES) -> list[np.ndarray]:
    """`--calibration DATA`: a folder or list of image files, or any `--data` source (its training split)."""
    p = Path(source)
    # a folder holding images itself is a folder of images (subfolders included: no labels are needed); a folder
    # of class folders, or of data files (an IDX folder such as /usr/share/datasets/fashion-mnist), is a --data
    # source. Hidden entries decide nothing: a `.thumbnails/` folder made a folder of images a "data set"
    from vitlab.data.images import is_image_file

    if p.is_file() and is_image_file(p):  # one image: read as such, not refused as a data set
        return calibration_from_files([p], preprocess, limit)
    if p.is_dir() and any(not c.name.startswith(".") and is_image_file(c) and c.is_file() for c in p.iterdir()):
        from vitlab.predict import collect_images

        return calibration_from_files(collect_images([p])[0], preprocess, limit)
    from vitlab.data import load_data

    splits = load_data(source, progress=False, report=False, **preprocess.storage())
    return calibration_from_dataset(splits.train, preprocess, limit)
