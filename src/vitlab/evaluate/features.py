"""One inference pass over a data set: logits, frozen features and labels.

Features are the model's pre-logits: for a ViT `forward_head(forward_features(x), pre_logits=True)`
(the class token or pooled tokens, after the representation layer when there is one, as big_vision's
`pre_logits`), for a BiT ResNet the globally average-pooled final feature map. Both come from the
same forward pass as the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, Subset

from vitlab.runtime import resolve_device


@dataclass
class Outputs:
    """Per-example results of one pass, in data-set order (numpy arrays)."""

    labels: np.ndarray
    logits: np.ndarray | None = None
    features: np.ndarray | None = None


def _collate(batch: list) -> tuple[list[torch.Tensor], torch.Tensor]:
    return [b[0] for b in batch], torch.tensor([int(b[1]) for b in batch], dtype=torch.long)


def _to_input(images: list[torch.Tensor], preprocess, device: torch.device) -> torch.Tensor:
    """uint8 images (possibly of different sizes) -> one normalised float batch on `device`."""
    if all(im.shape == images[0].shape for im in images):
        return preprocess.batch(torch.stack(images).to(device))
    return torch.cat([preprocess.batch(im.unsqueeze(0).to(device)) for im in images])


def run_model(
    model: nn.Module,
    dataset: Dataset,
    preprocess,
    *,
    batch_size: int = 64,
    device: str | torch.device | None = None,
    indices: Sequence[int] | np.ndarray | None = None,
    want_logits: bool = True,
    want_features: bool = False,
    progress: bool = True,
    desc: str = "evaluating",
    engine=None,
) -> Outputs:
    """Run `model` over `dataset` (or the rows `indices`) with the evaluation `preprocess`.

    `preprocess` has `.batch(uint8 (B,C,H,W)) -> float (B,C,h,w)` (`vitlab.data.Preprocess`). `engine` (from
    `vitlab.engine.prepare_engine`) computes the logits when no features are asked for.
    """
    from vitlab.data import make_loader
    from vitlab.progress import progress_bar

    # Moved before inference_mode: parameters copied to a GPU inside it become inference tensors, and fine-tuning
    # the same model afterwards failed ("Inference tensors cannot be saved for backward"; `vitlab compare` on an
    # H200, tests/test_cuda.py). On the CPU `.to` returns the same tensors, which hid it.
    dev = resolve_device(device)
    engine_only = engine is not None and want_logits and not want_features  # logits only: the chosen engine runs them
    if not engine_only:  # (an engine's model may have been released: engine/release.py)
        model = model.to(dev).eval()
    data = dataset
    if indices is not None:
        rows = [int(i) for i in indices]
        data = dataset.subset(rows) if hasattr(dataset, "subset") else Subset(dataset, rows)
    if hasattr(data, "class_names"):
        loader = make_loader(data, batch_size, shuffle=False)
    else:  # any other map-style data set of (image, label), images possibly of different sizes
        loader = DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=0, collate_fn=_collate)
    labels, logits, feats = [], [], []
    with torch.inference_mode():
        for images, y in progress_bar(loader, desc=desc, unit="batch", enabled=progress):
            x = _to_input(images, preprocess, dev) if isinstance(images, list) else preprocess.batch(images.to(dev))
            labels.append(torch.as_tensor(y).long())
            if engine_only:
                logits.append(engine(x).float().cpu())
                continue
            tokens = model.forward_features(x)
            if want_features:
                feats.append(model.forward_head(tokens, pre_logits=True).float().cpu())
            if want_logits:
                logits.append(model.forward_head(tokens).float().cpu())
    return Outputs(
        labels=torch.cat(labels).numpy() if labels else np.zeros(0, np.int64),
        logits=torch.cat(logits).numpy() if logits else None,
        features=torch.cat(feats).numpy() if feats else None,
    )


def dataset_labels(dataset: Dataset) -> np.ndarray:
    """All labels without decoding images (uses `.labels` when the data set has it)."""
    labels = getattr(dataset, "labels", None)
    if labels is not None:
        return np.asarray(torch.as_tensor(labels).numpy(), np.int64)
    return np.asarray([int(dataset[i][1]) for i in range(len(dataset))], np.int64)
