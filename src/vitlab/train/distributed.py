"""Process-group setup for `torchrun` (DDP: gloo on CPU, NCCL on CUDA; FSDP on request) and small
collective helpers; everything is a no-op in a single process."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from vitlab.errors import VitlabError


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    timeout_s: float = 600.0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> DistInfo:
    """Join the process group that torchrun describes in RANK / WORLD_SIZE / LOCAL_RANK (if any).

    `timeout_s`: how long a collective waits for the other processes; then it fails on every live process
    (gloo raises, NCCL's watchdog ends the process) instead of waiting for a stopped one forever."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if device.type == "cuda" else "gloo"
    # NCCL needs a GPU of its own for each process. A process that sees GPU LOCAL_RANK but names another one is
    # the same GPU named for all; one that does not see it has GPUs of its own (CUDA_VISIBLE_DEVICES per process,
    # as SLURM's --gpus-per-task sets), and the GPU it names is its own.
    if device.type == "cuda" and device.index != local_rank and local_rank < torch.cuda.device_count():
        raise VitlabError(f"--device {device} names one GPU for every torchrun process; leave --device auto (or "
                          "cuda): each process then takes GPU LOCAL_RANK")
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local_rank, backend, timeout_s)


# What gloo and NCCL say when a peer does not answer in time or went away (a RuntimeError or DistBackendError)
_PEER_FAILURES = ("timed out", "timeout", "connection closed by peer", "connection reset", "broken pipe",
                  "pair closure")


class PeerFailure(VitlabError):
    """A collective failed because another process stopped, hung or died. `abandoned` keeps the failed
    collective's objects alive: freeing them waits on the missing process (a hang at exit), so the command
    prints its one line and ends the process without freeing them (`vitlab train`, like NCCL's watchdog)."""

    def __init__(self, message: str, abandoned: BaseException):
        super().__init__(message)
        self.abandoned = abandoned


def is_peer_failure(exc: BaseException, info: DistInfo) -> bool:
    """Whether a collective failed because another process stopped, hung or died."""
    if not info.enabled or not isinstance(exc, RuntimeError):
        return False
    return any(word in str(exc).lower() for word in _PEER_FAILURES)


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: nn.Module, info: DistInfo, device: torch.device, fsdp: bool = False) -> nn.Module:
    """DistributedDataParallel (or FSDP, which shards parameters, gradients and optimizer state)."""
    if not info.enabled:
        return model
    if fsdp:
        # FSDP2 (fully_shard): each Transformer block is one shard unit, then the rest; works with
        # gloo on CPU as well as NCCL on GPUs. Parameters become DTensors sharded over the processes.
        # The mesh is named: fully_shard's default takes the machine's accelerator, so a CPU run on a GPU
        # machine failed ("invalid device ordinal" on local rank 1 of a 1-GPU machine).
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (info.world_size,))
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP / FSDP / torch.compile wrappers."""
    for attr in ("_orig_mod", "module", "_fsdp_wrapped_module"):
        while hasattr(model, attr) and isinstance(getattr(model, attr), nn.Module):
            model = getattr(model, attr)
    return model


def all_reduce_sum(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    """Sum a few numbers over all processes (metrics reduced over ranks)."""
    if not info.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def gather_tensor(t: torch.Tensor, info: DistInfo) -> list[torch.Tensor]:
    """All processes' copies of a tensor with the same shape on every rank."""
    if not info.enabled:
        return [t]
    out = [torch.empty_like(t) for _ in range(info.world_size)]
    dist.all_gather(out, t)
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def broadcast_object(obj, info: DistInfo):
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
