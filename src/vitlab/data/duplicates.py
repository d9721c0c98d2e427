"""Images that appear in the training split and again in a validation or test split.

A copy of a training image in the test split (the same photo saved twice in a scraped folder, a file copied into
two class folders' splits) is scored as if unseen: the test accuracy then counts images the model learnt. Paths
cannot show it (the copies are different files), so in-memory splits are compared by their decoded pixels, at the
size they are stored: exact copies, and copies that differ only in ways the decoding and resizing remove.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import torch


def _pixel_rows(dataset) -> np.ndarray | None:
    """(N, bytes) uint8 rows of an in-memory split's images; None for a streamed one (not decoded here)."""
    if not getattr(dataset, "in_memory", False):
        return None
    images = getattr(dataset, "images", None)
    if not isinstance(images, torch.Tensor) or len(images) == 0:
        return None
    return np.ascontiguousarray(images.numpy()).reshape(len(images), -1)


def _digests(rows: np.ndarray) -> list[bytes]:
    # one short hash per image, so that memory stays one digest an image (an equality join of the rows themselves
    # would sort copies of every image); equal digests are then compared byte for byte
    return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in rows]


def copies_of_training_images(train, other) -> list[tuple[int, int]]:
    """(row in `other`, row in `train`) for each image of `other` whose pixels equal a training image's."""
    train_rows, other_rows = _pixel_rows(train), _pixel_rows(other)
    if train_rows is None or other_rows is None or train_rows.shape[1] != other_rows.shape[1]:
        return []
    seen: dict[bytes, int] = {}
    for i, digest in enumerate(_digests(train_rows)):
        seen.setdefault(digest, i)
    pairs = []
    for j, digest in enumerate(_digests(other_rows)):
        i = seen.get(digest)
        if i is not None and np.array_equal(train_rows[i], other_rows[j]):
            pairs.append((j, i))
    return pairs


def _name(dataset, row: int) -> str:
    paths = getattr(dataset, "paths", None)
    return str(paths[row]) if paths is not None else f"image {row}"


def copy_notes(train, splits: Iterable[tuple[str, object]]) -> list[str]:
    """One note for each split that holds copies of training images (none when nothing is copied)."""
    notes = []
    for split, dataset in splits:
        if dataset is None:
            continue
        pairs = copies_of_training_images(train, dataset)
        if pairs:
            j, i = pairs[0]
            notes.append(f"{len(pairs)} of the {split} split's {len(dataset)} images have the same pixels as a "
                         f"training image (first: {_name(dataset, j)} = {_name(train, i)}): its scores count "
                         "images the model trained on; remove the copies from one side for an unseen test")
    return notes
