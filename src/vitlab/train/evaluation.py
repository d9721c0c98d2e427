"""Evaluation during and after training: a whole split's logits, gathered over processes, and its metrics."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.train import distributed as D
from vitlab.train.precision import autocast_context


@torch.no_grad()
def predict_split(model: nn.Module, dataset, eval_tf, device: torch.device, precision: str, batch_size: int,
                  info: D.DistInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (N, K) and labels (N,) of a whole split, sharded over processes and gathered back."""
    from vitlab.data import make_loader

    was_training = model.training
    model.eval()
    loader = make_loader(dataset, batch_size, shuffle=False, rank=info.rank, world_size=info.world_size)
    logits, labels = [], []
    for x, y in loader:
        with autocast_context(precision, device):
            out = model(eval_tf(x.to(device, non_blocking=True)))
        logits.append(out.float())
        labels.append(y.to(device))
    logits_t = torch.cat(logits) if logits else torch.empty(0, device=device)
    labels_t = torch.cat(labels) if labels else torch.empty(0, dtype=torch.long, device=device)
    if info.enabled:
        # rank r holds padded positions r, r + W, ...: interleave back, drop the wrap-around padding.
        parts = D.gather_tensor(logits_t.contiguous(), info)
        lparts = D.gather_tensor(labels_t.contiguous(), info)
        logits_t = torch.stack(parts, dim=1).reshape(-1, logits_t.shape[-1])[: len(dataset)]
        labels_t = torch.stack(lparts, dim=1).reshape(-1)[: len(dataset)]
    model.train(was_training)
    return logits_t.cpu(), labels_t.cpu()


def split_metrics(logits: torch.Tensor, labels: torch.Tensor, class_names: list[str]) -> dict[str, Any]:
    from vitlab.evaluate.metrics import classification_metrics

    m = classification_metrics(labels, logits.argmax(1), len(class_names), class_names=class_names, logits=logits)
    m["loss"] = float(F.cross_entropy(logits, labels)) if len(labels) else float("nan")
    return m

