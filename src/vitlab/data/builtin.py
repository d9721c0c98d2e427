"""Data sets that need no files from the user: scikit-learn's 8x8 digits and the bundled Fashion-MNIST subset."""

from __future__ import annotations

from importlib import resources

import numpy as np
import torch

from vitlab.data.dataset import DataSplits, ImageDataset
from vitlab.errors import VitlabError

BUNDLED_FILE = "fashion_mnist_subset.npz"


def load_digits_dataset() -> DataSplits:
    """scikit-learn's 1,797 digits (8x8, values 0-16) as uint8 0-255 (x * 255 / 16); splits are made later."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = np.rint(d.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)[:, None]
    names = [str(int(t)) for t in d.target_names]
    ds = ImageDataset(torch.from_numpy(images), torch.from_numpy(d.target.astype(np.int64)), names, "digits")
    return DataSplits(ds, None, None, names, [], "digits", 1)


def load_bundled() -> DataSplits:
    """The small Fashion-MNIST subset shipped inside the package (train + test), for the offline demo."""
    ref = resources.files("vitlab.data").joinpath("bundled", BUNDLED_FILE)
    try:
        with ref.open("rb") as fh, np.load(fh, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise VitlabError(f"the bundled data file {BUNDLED_FILE} is missing from the installed package; "
                          "reinstall vitlab") from None
    names = [str(n) for n in arrays["class_names"]]
    parts = {}
    for split in ("train", "test"):
        x = torch.from_numpy(np.ascontiguousarray(arrays[f"x_{split}"], dtype=np.uint8)).unsqueeze(1)
        y = torch.from_numpy(arrays[f"y_{split}"].astype(np.int64))
        parts[split] = ImageDataset(x, y, names, f"bundled/{split}")
    return DataSplits(parts["train"], None, parts["test"], names, [], "bundled", 1)
