"""A run's state: its progress (step, epoch, history, timings), the checkpoint dictionary built from it, and
the model / optimizer / RNG state in and out of a checkpoint (FSDP's sharded state gathered in full)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from vitlab.train import distributed as D
from vitlab.train.checkpoint import rng_state, set_rng_state


@dataclass
class Progress:
    """Where a run is and what it has done: the part of a checkpoint that is not tensors.

    `train_time_s`, `train_images`, `wall_time_s` and `cpu_time_s` of earlier segments (before a resume) are
    kept apart from this segment's `train_time` / `train_images`, as the checkpoint and summary.json add them up."""

    global_step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    # images of this epoch's order done before its step 0 at the current batch size, beyond step_in_epoch x batch:
    # nonzero only after a resume that changed the batch size in the middle of the epoch (TrainingRun.restore)
    epoch_offset: int = 0
    # the run's steps minus what its --epochs come to at the current batch size from step 0: nonzero after a resume
    # that changed the batch size (TrainingRun.plan_after_batch_change), kept so that later resumes plan alike
    step_shift: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    best_val: float | None = None
    epoch_sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # loss x n, correct, n (this process)
    train_time_prev: float = 0.0
    images_prev: int = 0
    wall_prev: float = 0.0
    cpu_prev: float = 0.0
    train_time: float = 0.0
    train_images: int = 0
    last_saved_step: int = -1

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Progress:
        p = cls(global_step=state["global_step"], epoch=state["epoch"], step_in_epoch=state["step_in_epoch"],
                history=list(state.get("history", [])), best_val=state.get("best_val"),
                train_time_prev=state.get("train_time_s", 0.0), images_prev=state.get("train_images", 0),
                wall_prev=state.get("wall_time_s", 0.0),  # the earlier segments' wall time
                cpu_prev=state.get("cpu_time_s", 0.0))  # and their processes' CPU time
        if "epoch_sums" in state:
            p.epoch_sums = list(state["epoch_sums"])
        p.epoch_offset = int(state.get("epoch_offset", 0))
        p.step_shift = int(state.get("step_shift", 0))
        return p

    def to_state(self) -> dict[str, Any]:
        """The checkpoint's progress entries (the wall time is added by the caller, who knows the clock)."""
        return {"global_step": self.global_step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "history": self.history, "best_val": self.best_val, "epoch_sums": list(self.epoch_sums),
                "train_time_s": self.total_train_time, "train_images": self.total_images,
                **({"epoch_offset": self.epoch_offset} if self.epoch_offset else {}),
                **({"step_shift": self.step_shift} if self.step_shift else {})}

    def add_step(self, loss: float, correct: float, seen: float, seconds: float) -> None:
        """Count one optimizer step (the all-reduced sums of every process)."""
        self.global_step += 1
        self.step_in_epoch += 1
        self.epoch_sums[0] += loss
        self.epoch_sums[1] += correct
        self.epoch_sums[2] += seen
        self.train_time += seconds
        self.train_images += int(seen)

    def images_done_in_epoch(self, batch_size: int) -> int:
        """How many images of this epoch's order the run has trained on (`batch_size`: the global batch)."""
        return self.epoch_offset + self.step_in_epoch * batch_size

    def go_on_at_batch(self, done: int, batch_size: int, steps_per_epoch: int, steps_left: int) -> None:
        """Go on in this epoch at another batch size, `done` images of its order trained on, `steps_left` steps of
        `batch_size` left in it: the epoch's step count is re-expressed so that the loop runs those steps and the
        loader starts at image `done` (`images_done_in_epoch`)."""
        self.step_in_epoch = max(0, steps_per_epoch - steps_left)
        self.epoch_offset = done - self.step_in_epoch * batch_size

    def epoch_means(self) -> tuple[float | None, float | None]:
        loss, correct, n = self.epoch_sums
        return (loss / max(n, 1), correct / max(n, 1)) if n else (None, None)

    def next_epoch(self) -> None:
        self.epoch += 1
        self.step_in_epoch = 0
        self.epoch_offset = 0
        self.epoch_sums = [0.0, 0.0, 0.0]

    def improves(self, metric: float | None) -> bool:
        """A new best validation metric: remembered, and True."""
        better = metric is not None and (self.best_val is None or metric > self.best_val)
        if better:
            self.best_val = metric
        return better

    @property
    def total_train_time(self) -> float:
        return self.train_time_prev + self.train_time

    @property
    def total_images(self) -> int:
        return self.images_prev + self.train_images


def gathered_rng_states(info: D.DistInfo) -> list[Any]:
    """Every process's RNG state, in rank order (a collective under torchrun)."""
    rngs = [rng_state()]
    if info.enabled:
        import torch.distributed as dist

        all_rngs: list[Any] = [None] * info.world_size
        dist.all_gather_object(all_rngs, rngs[0])
        rngs = all_rngs
    return rngs


def rng_of_rank(rngs: Any, rank: int) -> Any:
    """This process's RNG state from a checkpoint's list (rank 0's when the run had fewer processes)."""
    if isinstance(rngs, list):
        return rngs[rank] if rank < len(rngs) else rngs[0]
    return rngs


def restore_rng(rngs: Any, rank: int) -> None:
    set_rng_state(rng_of_rank(rngs, rank))


def _is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # older torch
        return False
    return isinstance(model, FSDPModule)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu().clone() for k, v in D.unwrap(model).state_dict().items()}


def full_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer.state_dict()


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (weight decay, betas, momentum, ...): all but its parameters and the learning
    rate, which the schedule sets."""
    return [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in optimizer.param_groups]


def restore_optimization(model: nn.Module, optimizer: torch.optim.Optimizer,
                         scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict[str, Any],
                         new_optimizer: bool = False) -> None:
    """A checkpoint's optimizer state and schedule position under the settings this run was built with. torch's
    load_state_dict puts back the settings the checkpoint was written with (each group's weight decay, betas,
    momentum; the schedule's base lr), so `--allow-change lr` (or weight_decay, betas, momentum) was recorded in
    config.yaml and never applied; unchanged settings come out bit for bit the same. `new_optimizer` (another
    --optimizer allowed): the old state does not carry over (Adam's moments are no SGD momentum) and it starts
    afresh."""
    settings, base_lrs = optimizer_settings(optimizer), list(scheduler.base_lrs)
    if not new_optimizer:
        load_optim_state(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    for group, kept in zip(optimizer.param_groups, settings, strict=True):
        group.update(kept)
    # the learning rate of the step the run goes on with, as LambdaLR.step sets it, from this run's lr and schedule
    lrs = [base * factor(scheduler.last_epoch) for factor, base in zip(scheduler.lr_lambdas, base_lrs, strict=True)]
    for group, base, lr in zip(optimizer.param_groups, base_lrs, lrs, strict=True):
        group["initial_lr"], group["lr"] = base, lr
    scheduler.base_lrs, scheduler._last_lr = base_lrs, lrs


def load_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
        return
    optimizer.load_state_dict(state)

