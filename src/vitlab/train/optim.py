"""Optimisers with the paper's weight-decay mask, and the official warm-up + linear/cosine schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from vitlab.errors import VitlabError


def decay_mask(model: nn.Module) -> dict[str, bool]:
    """name -> True for parameters that get weight decay: weight matrices / conv kernels only.

    As big_vision's `wd_mults=[(".*/kernel$", 1.0)]`: not biases, norms, class token, position
    embeddings (nor anything listed by `model.no_weight_decay()`).
    """
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        out[name] = p.ndim >= 2 and name not in skip and not name.endswith(("cls_token", "pos_embed", "dist_token"))
    return out


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed weight matrices and the rest (decay 0)."""
    mask = decay_mask(model)
    params = dict(model.named_parameters())
    decay = [params[n] for n, d in mask.items() if d]
    no_decay = [params[n] for n, d in mask.items() if not d]
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"}]
    groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module | list[dict], name: str, lr: float, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.999), momentum: float = 0.9) -> torch.optim.Optimizer:
    """adamw: decoupled decay x lr (= the paper's Adam + decoupled wd, see reference 4.1); adam: the
    same without decay; sgd: heavy-ball momentum (the official fine-tuning optimiser), decay coupled.
    `model` may also be prepared parameter groups (each with its own weight_decay)."""
    groups = param_groups(model, weight_decay) if isinstance(model, nn.Module) else [dict(g) for g in model]
    fused = _can_fuse(groups)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=1e-8, fused=fused)
    if name == "adam":
        for g in groups:
            g["weight_decay"] = 0.0
        return torch.optim.Adam(groups, lr=lr, betas=tuple(betas), eps=1e-8, fused=fused)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=False)
    raise VitlabError(f"unknown optimizer {name!r}; choose adamw, adam or sgd")


def _can_fuse(groups: list[dict]) -> bool | None:
    """Adam's fused kernel for plain CPU/CUDA float parameters: one pass over all tensors instead of a
    Python loop (optimizer step of the Fashion-MNIST model 3.3 -> 0.6 ms, benchmarks/train_parts.py). Sharded (FSDP
    DTensor) parameters keep torch's default implementation."""
    params = [p for g in groups for p in g["params"]]
    ok = all(type(p) in (torch.Tensor, nn.Parameter) and p.device.type in ("cpu", "cuda") and p.is_floating_point()
             for p in params)
    return True if ok and params else None


def lr_factor(step: int, total_steps: int, warmup_steps: int, decay: str = "cosine",
              base_lr: float = 1.0, lr_end: float = 0.0) -> float:
    """The official schedule (vit_jax/utils.py) as a multiplier of base_lr at `step` (0-based).

    progress = clip((step - warmup) / (total - warmup), 0, 1);
    linear: end + (base - end)(1 - progress); cosine: base * 0.5 (1 + cos(pi progress));
    then times min(1, step / warmup).
    """
    denom = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / denom))
    if decay == "linear":
        lr = lr_end + (base_lr - lr_end) * (1.0 - progress)
    elif decay == "cosine":
        lr = base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay == "constant":
        lr = base_lr
    else:
        raise VitlabError(f"unknown decay {decay!r}; choose cosine, linear or constant")
    if warmup_steps > 0:
        lr *= min(1.0, step / warmup_steps)
    return lr / base_lr


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, decay: str,
                    base_lr: float, lr_end: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `lr_factor`; stepped once per optimizer step, so its state resumes exactly."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, warmup_steps, decay, base_lr, lr_end))
