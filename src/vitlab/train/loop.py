"""`train(cfg, model=None, data=None) -> TrainResult`: the one training loop behind `vitlab train`,
`vitlab finetune`, `vitlab demo` and `vitlab compare` - on a CPU, a GPU or many processes (torchrun)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.errors import VitlabError
from vitlab.runtime import auto_threads, resolve_device  # one policy for every command (runtime.py)
from vitlab.train import distributed as D
from vitlab.train.checkpoint import (
    CheckpointManager,
    all_finite,
    find_resume_checkpoint,
    last_finite_checkpoint,
    load_resume_state,
    rng_state,
    set_rng_state,
)
from vitlab.train.config import TrainConfig, load_yaml, recorded_values, validate
from vitlab.train.optim import build_optimizer, build_scheduler, decay_mask
from vitlab.train.precision import autocast_context, cpu_bf16_supported, resolve_precision, set_stem_precision
from vitlab.train.run_dir import RunDir, RunLock, new_run_dir, refuse_if_in_use


@dataclass
class TrainResult:
    """What a finished run hands back (also written to the run folder)."""

    model: nn.Module
    run_dir: Path
    history: list[dict[str, Any]] = field(default_factory=list)
    test_metrics: dict[str, Any] | None = None
    wall_time_s: float = 0.0
    images_per_s: float = 0.0
    config: TrainConfig | None = None
    best_val_acc: float | None = None


# ----------------------------------------------------------------------------------------- setup
def tune_cpu_allocator() -> bool:
    """Keep freed training buffers in glibc's heap instead of returning them to the OS after each step.

    By default glibc serves blocks >= 128 KiB with mmap and unmaps them on free, so every step page-faults
    its activations in again: measured on the 2-core dev machine, 274k page faults and 0.70 s system time
    per 40 steps, vs 3k and 0.01 s with the thresholds raised (+36% images per CPU-second, docs/training.md).
    Linux/glibc only; VITLAB_NO_MALLOPT=1 turns it off.
    """
    if os.environ.get("VITLAB_NO_MALLOPT") or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def set_deterministic(enabled: bool) -> None:
    """Same seed -> bit-identical run: deterministic kernels only (and cuBLAS's fixed workspace)."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def step_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """Augmentation seed of one micro-batch: a pure function of the position, so a resumed run
    draws the same crops, flips and mixes as the uninterrupted one."""
    return (seed * 1_000_003 + step * 9_973 + micro * 131 + rank * 17 + 7) % (2**62)


def load_splits(cfg: TrainConfig, progress: bool):
    from vitlab.data import load_data

    return load_data(cfg.data, classes=cfg.classes, per_class=cfg.per_class, val_fraction=cfg.val_fraction,
                     seed=cfg.seed, progress=progress)


SMALL_VIT = dict(dim=64, depth=6, heads=4, mlp_dim=128, patch_size=4)


def build_model_for(cfg: TrainConfig, data) -> tuple[nn.Module, Any]:
    """Fine-tuning: the checkpoint with a new zero head (and resampled position embeddings);
    from scratch: a registry model sized for the data. Returns (model, preprocess or None)."""
    num_classes = data.num_classes
    if cfg.weights:
        from vitlab.weights import load_with_meta

        model, meta = load_with_meta(cfg.weights, num_classes=num_classes, image_size=cfg.image_size)
        return model, meta.get("preprocess")
    from vitlab.models.registry import create_model

    size = cfg.image_size or data.train.image_size[0]
    args = dict(cfg.model_args)
    if cfg.model == "custom" and not args:  # small-data.md 2.3's small ViT instead of a ViT-B-sized "custom"
        args = dict(SMALL_VIT)
        cfg.model_args = dict(SMALL_VIT)  # the saved config.yaml names the model that was built
    if cfg.drop_path is not None:
        args["drop_path"] = cfg.drop_path
    if cfg.dropout is not None:
        args["dropout"] = cfg.dropout
    args.setdefault("in_chans", data.channels)
    model = create_model(cfg.model, num_classes=num_classes, image_size=size, seed=cfg.seed, **args)
    return model, None


def prepare_given_model(model: nn.Module, num_classes: int, cfg: TrainConfig) -> nn.Module:
    """A model handed in by the caller: give it a zero head when its classes do not match."""
    config = getattr(model, "config", None)
    if config is not None and config.num_classes != num_classes and hasattr(model, "reset_classifier"):
        model.reset_classifier(num_classes)
    return model


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def set_train_mode(model: nn.Module, batchnorm: str = "train") -> None:
    """`model.train()`, then BatchNorm layers back to eval for batchnorm="frozen": their running
    statistics stay the checkpoint's while their affine weight and bias still receive gradients."""
    model.train()
    if batchnorm == "frozen":
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()


def convert_sync_batchnorm(model: nn.Module, batchnorm: str, info: D.DistInfo, device: torch.device) -> nn.Module:
    """batchnorm="sync": SyncBatchNorm before the DDP wrap, as torchvision's --sync-bn. It needs several
    CUDA processes (SyncBatchNorm rejects CPU tensors); elsewhere plain BN runs and one line says so."""
    if batchnorm != "sync" or not has_batchnorm(model):
        return model
    if info.enabled and info.world_size > 1 and device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if info.is_main:
        print("vitlab train: batchnorm=sync needs several CUDA processes (torchrun on GPUs); running plain "
              "BatchNorm (statistics of each process's micro-batch)", file=sys.stderr)
    return model


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()


# ----------------------------------------------------------------------------------- evaluation
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


# ---------------------------------------------------------------------------------- state I/O
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


def load_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
        return
    optimizer.load_state_dict(state)


# ---------------------------------------------------------------------------------------- train
def train(cfg: TrainConfig, model: nn.Module | None = None, data=None,
          allow_change: tuple[str, ...] | list[str] = (), force_unlock: bool = False) -> TrainResult:
    """Train (from scratch, pre-train or fine-tune, by `cfg.recipe`) and evaluate; writes a run folder.

    `model`: train this module instead of building one (its head is replaced when the classes differ);
    `data`: a `vitlab.data.DataSplits` instead of loading `cfg.data`;
    `allow_change`: on resume, settings (any TrainConfig field, or world_size) that may differ from the
    run's record; any other difference that changes the run is refused;
    `force_unlock`: take over the run folder's lock even when another machine holds it.
    """
    validate(cfg)
    t_start = time.perf_counter()
    allow_change = tuple(allow_change)
    changes = check_resume(cfg, allow_change) if cfg.resume else {}
    cfg.threads = resolve_threads(cfg)
    torch.set_num_threads(cfg.threads)
    set_deterministic(cfg.deterministic)
    device = resolve_device(cfg.device)
    if device.type == "cpu":
        tune_cpu_allocator()
    info = D.init_distributed(device, cfg.dist_timeout)
    stop, lock = StopSignals(), RunLock()
    try:
        # every process computes with rank 0's thread count, which the run records
        cfg.threads = int(D.broadcast_object(cfg.threads, info))
        torch.set_num_threads(cfg.threads)
        return _train(cfg, model, data, device, info, t_start, allow_change, changes, stop, lock, force_unlock)
    except RuntimeError as exc:
        if D.is_peer_failure(exc, info):  # one line on every live process instead of gloo's trace
            raise D.PeerFailure(peer_failure_message(cfg, info), abandoned=exc) from None
        raise
    finally:
        stop.restore()
        lock.release()
        D.shutdown(info)


def peer_failure_message(cfg: TrainConfig, info: D.DistInfo) -> str:
    run = run_folder_of(cfg.resume) if cfg.resume else Path(cfg.out_dir) / (cfg.name or "RUN")
    return (f"process {info.rank} of {info.world_size}: another process did not join a collective within the "
            f"--dist-timeout of {info.timeout_s:g} s (it stopped, hung or died); check that process's log, raise "
            f"--dist-timeout if a step or an evaluation really takes that long, then resume with: "
            f"torchrun ... {resume_command(cfg, run)}")


def lock_run_folder(lock: RunLock, run: RunDir, info: D.DistInfo, force: bool) -> None:
    """Rank 0 takes the run folder's lock; a refusal stops every process (none may wait for it in a collective)."""
    problem = None
    if info.is_main:
        try:
            lock.acquire(run.path, force)
        except VitlabError as exc:
            problem = str(exc)
    problem = D.broadcast_object(problem, info)
    if problem:
        raise VitlabError(problem)


# ------------------------------------------------------------------- what a resume continues
# Decided once when a run starts, recorded in config.yaml and each checkpoint, restored by --resume:
# a resumed process that picked them afresh (e.g. fewer threads under load) computes differently.
NUMERIC_SETTINGS = ("threads", "precision", "deterministic", "world_size")
# Settings that do not change what is trained (where it is written, how often it is logged or checked, how
# long a collective may wait): they may differ on resume. Every other field must match the record.
NEUTRAL_SETTINGS = ("out_dir", "name", "resume", "quiet", "log_every", "ckpt_every", "keep_last", "eval_every",
                    "eval_batch_size", "save_model", "device", "grad_checkpointing", "compile", "dist_timeout")
# Filled in by the run when not given, then recorded: a resume that leaves them unset continues with the
# record (a study rebuilding its settings from scratch passes them unset).
FILLED_BY_THE_RUN: dict[str, Any] = {"image_size": None, "model_args": {}}


def resolve_threads(cfg: TrainConfig) -> int:
    """The thread count as a number (never None), so that config.yaml records what ran."""
    return int(cfg.threads or auto_threads() or torch.get_num_threads())


def run_folder_of(resume: str | Path) -> Path:
    """`--resume` names a run folder or one of its checkpoint files."""
    p = Path(resume)
    return p.parent.parent if p.is_file() and p.parent.name == "checkpoints" else p


def recorded_config(resume: str | Path) -> dict[str, Any]:
    """The run's config.yaml as written when it started ({} when there is none to read)."""
    path = run_folder_of(resume) / "config.yaml"
    try:
        return load_yaml(path) if path.is_file() else {}
    except VitlabError:
        return {}


def check_resume(cfg: TrainConfig, allow_change: tuple[str, ...]) -> dict[str, tuple[Any, Any]]:
    """Compare the resumed command with the run's config.yaml; returns the allowed changes {name: (recorded,
    now)}, refuses the others in one line."""
    recorded = recorded_values(recorded_config(cfg.resume))
    changes = restore_numerics(cfg, allow_change, recorded)
    changes.update(check_run_settings(cfg, allow_change, recorded))
    return changes


def restore_numerics(cfg: TrainConfig, allow_change: tuple[str, ...],
                     recorded: dict[str, Any] | None = None) -> dict[str, tuple[Any, Any]]:
    """On resume, set threads, precision and deterministic mode to the run's recorded values. A value that
    was not given (threads null, precision auto) takes the record; a different explicit one is refused
    unless allowed. Returns the allowed changes, {name: (recorded, now)}."""
    if recorded is None:
        recorded = recorded_values(recorded_config(cfg.resume))
    changes = {}
    for name, unset in (("threads", None), ("precision", "auto"), ("deterministic", None)):
        before, now = recorded.get(name), getattr(cfg, name)
        if before is None or before == "auto" or now == before:
            continue  # nothing recorded (a run from before the record), or the same value
        if now == unset:
            setattr(cfg, name, before)
            continue
        refuse_change(name, before, now, allow_change)
        changes[name] = (before, now)
    return changes


def refuse_change(name: str, before: Any, now: Any, allow_change: tuple[str, ...]) -> None:
    if name not in allow_change:
        raise VitlabError(f"this run was recorded with {name} {before} but the resume asks for {now}, which changes "
                          f"its numerics; drop that setting to resume exactly, or add --allow-change {name}")


def check_run_settings(cfg: TrainConfig, allow_change: tuple[str, ...],
                       recorded: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Model, data and split, batch, seed, optimizer, schedule, augmentation...: every setting that shapes the
    run must match the record (else config.yaml would describe another run). Differences not allowed are
    refused in one line naming each with both values; returns the allowed ones."""
    differences = {}
    for name, before in recorded.items():
        if name in NEUTRAL_SETTINGS or name in NUMERIC_SETTINGS:
            continue
        if name in ("mean", "std") and cfg.weights:
            continue  # fine-tuning takes them from the weights' preprocessing on every start
        now = getattr(cfg, name)
        if name in FILLED_BY_THE_RUN and now == FILLED_BY_THE_RUN[name]:
            setattr(cfg, name, before)
            continue
        if comparable(name, before) != comparable(name, now):
            differences[name] = (before, now)
    refused = [name for name in differences if name not in allow_change]
    if refused:
        changed = " and ".join(describe_change(name, *differences[name]) for name in refused)
        raise VitlabError(f"cannot resume {run_folder_of(cfg.resume)}: this command changes the run's {changed}; "
                          f"drop those settings to continue the run as recorded, or add --allow-change "
                          f"{','.join(refused)} (config.yaml then records the change)")
    return differences


def comparable(name: str, value: Any) -> Any:
    """A value in one form for comparison: tuples as lists, a class list written "a,b" as ["a", "b"]."""
    if isinstance(value, tuple | list):
        return [comparable(name, v) for v in value]
    if name == "classes" and isinstance(value, str):
        return [part.strip() for part in value.split(",")]
    if name == "classes" and value is not None:
        return str(value)
    return value


def describe_change(name: str, before: Any, now: Any) -> str:
    """`batch_size 16 -> 32`; for model_args only the keys that differ: `model_args.dim 32 -> 48`."""
    if isinstance(before, dict) and isinstance(now, dict):
        keys = sorted(k for k in set(before) | set(now) if before.get(k, "unset") != now.get(k, "unset"))
        return ", ".join(f"{name}.{k} {before.get(k, 'unset')} -> {now.get(k, 'unset')}" for k in keys)
    return f"{name} {before} -> {now}"


def load_model_state(model: nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """The checkpoint's weights into the model this command built; one line (not torch's list of every
    mismatched tensor) when they do not fit, e.g. a checkpoint file resumed under another model."""
    try:
        model.load_state_dict(weights)
    except RuntimeError:
        raise VitlabError(f"checkpoint {path} does not fit the model this command builds (another model or "
                          f"model_args than the run's); resume with the run's model settings") from None


def check_world_size(state: dict[str, Any], world: int, allow_change: tuple[str, ...],
                     changes: dict[str, tuple[Any, Any]]) -> None:
    """A checkpoint from N processes resumed on M: refused unless allowed (then recorded as a change)."""
    before = state.get("world_size")
    if before is not None and before != world:
        refuse_change("world_size", before, world, allow_change)
        changes["world_size"] = (before, world)


def print_numerics(cfg: TrainConfig, precision: str, world: int) -> None:
    print(f"vitlab: numerics (recorded; --resume restores them): threads {cfg.threads}, precision {precision}, "
          f"deterministic {'on' if cfg.deterministic else 'off'}, {world} process{'es' if world > 1 else ''}",
          flush=True)


def record_changes(run: RunDir, cfg: TrainConfig, changes: dict[str, tuple[Any, Any]], step: int) -> None:
    """Allowed changes on resume: config.yaml gets the new values, metrics.jsonl a record of when."""
    if not changes:
        return
    run.save_config(dataclasses.replace(cfg, resume=None))
    run.log({"type": "change", "step": step, "changed": {k: list(v) for k, v in changes.items()}})
    if run.enabled:
        text = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items())
        print(f"vitlab: resuming with changed settings ({text}), recorded in config.yaml and metrics.jsonl; the run "
              "will not match an uninterrupted one", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ interrupts
class StopSignals:
    """SIGINT / SIGTERM while training: the first one asks the loop to finish its step, write a checkpoint
    and stop; a second one quits at once (KeyboardInterrupt wherever the program is)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def listen(self) -> None:
        if threading.current_thread() is threading.main_thread():  # Python only lets the main thread catch them
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            self.restore()  # a third signal acts as if vitlab were not there
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        # os.write, not print: a handler may run in the middle of another print to the same stream
        os.write(2, f"\nvitlab: {self.received} received: finishing this step and writing a checkpoint "
                    "(Ctrl-C again quits at once)\n".encode())


def resume_command(cfg: TrainConfig, run_path: Path) -> str:
    command = "finetune" if cfg.weights else "train"
    return f"vitlab {command} --resume {shlex.quote(str(run_path))}"


def stop_interrupted(cfg: TrainConfig, run: RunDir, ckpts: CheckpointManager, signal_name: str, step: int,
                     bar: Any) -> None:
    """After the interrupted step's checkpoint: say where it is and how to go on, then stop (exit code 130)."""
    if bar is not None:
        bar.close()
    if run.enabled:
        print(f"vitlab: stopped by {signal_name} after step {step}; checkpoint {ckpts.latest()}; "
              f"resume with: {resume_command(cfg, run.path)}", file=sys.stderr, flush=True)
    raise KeyboardInterrupt


# ---------------------------------------------------------------------------------- divergence
def local_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This process's shard of FSDP's DTensors, the tensors themselves otherwise."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def params_finite(model: nn.Module, info: D.DistInfo, device: torch.device, sharded: bool) -> bool:
    """All weights finite; sharded (FSDP) weights are checked by their owners and the verdict agreed."""
    ok = all_finite(local_tensors([p for p in model.parameters() if p.is_floating_point()]))
    if sharded and info.enabled:
        ok = D.all_reduce_sum([float(not ok)], info, device)[0] == 0
    return ok


def stop_diverged(what: str, value: Any, step: int, epoch: int, ckpts: CheckpointManager, main: bool, bar: Any) -> None:
    """Non-finite loss, gradients or weights: stop before anything is checkpointed, naming the last
    checkpoint whose weights are all finite."""
    if bar is not None:
        bar.close()
    good = last_finite_checkpoint(ckpts.folder) if main else None
    where = f"the last good checkpoint is {good}" if good else "no checkpoint with finite weights was written"
    raise VitlabError(f"{what} became {value} at step {step} (epoch {epoch}); run stopped before writing a checkpoint, "
                      f"{where}; lower --lr, keep --grad-clip 1 or use --precision fp32")


def _train(cfg: TrainConfig, model: nn.Module | None, data, device: torch.device, info: D.DistInfo,
           t_start: float, allow_change: tuple[str, ...] = (), changes: dict | None = None,
           stop: StopSignals | None = None, lock: RunLock | None = None, force_unlock: bool = False) -> TrainResult:
    from vitlab.data.transforms import TransformConfig, build_eval_transform, build_train_transform, mix_batch

    main = info.is_main
    show = main and not cfg.quiet
    changes = dict(changes or {})
    if cfg.resume:
        if info.world_size == 1:  # under torchrun rank 0's lock (below) is the check: ranks would race here
            refuse_if_in_use(run_folder_of(cfg.resume), force_unlock)
        find_resume_checkpoint(cfg.resume)  # fail before loading anything
    seed_everything(cfg.seed)

    # ---- data and model
    if data is None:
        data = load_splits(cfg, progress=show)
    if data.train is None or len(data.train) == 0:
        raise VitlabError("the data has no training images")
    class_names = list(data.class_names)
    num_classes = len(class_names)
    preprocess = None
    if model is None:
        model, preprocess = build_model_for(cfg, data)
    else:
        model = prepare_given_model(model, num_classes, cfg)
    mcfg = getattr(model, "config", None)
    if cfg.head_bias_init is not None and isinstance(getattr(model, "head", None), nn.Linear):
        with torch.no_grad():
            model.head.bias.fill_(float(cfg.head_bias_init))
    if cfg.weights and cfg.zero_head and isinstance(getattr(model, "head", None), nn.Linear):
        with torch.no_grad():  # paper B.1.1: the new head starts at zero (also when the classes match)
            model.head.weight.zero_()
            model.head.bias.zero_()
    image_size = tuple(mcfg.image_size) if mcfg is not None else (cfg.image_size or data.train.image_size[0],) * 2
    in_chans = mcfg.in_chans if mcfg is not None else data.channels
    mean, std = cfg.mean, cfg.std
    if preprocess is not None:  # fine-tuning keeps the normalisation the weights were trained with
        mean, std = tuple(preprocess.mean), tuple(preprocess.std)
        cfg.mean, cfg.std = list(mean), list(std)
    if cfg.image_size is None:
        cfg.image_size = int(image_size[0])
    overrides = dict(mean=mean, std=std, inception_crop=cfg.inception_crop, crop_scale=tuple(cfg.crop_scale),
                     random_erasing=cfg.random_erasing, random_shift=cfg.random_shift, mixup=cfg.mixup, cutmix=cfg.cutmix,
                     randaugment=tuple(cfg.randaugment) if cfg.randaugment else None)
    if cfg.hflip is not None:
        overrides["hflip"] = cfg.hflip
    tcfg = TransformConfig.for_source(cfg.data, image_size, in_chans, **overrides)
    train_tf = build_train_transform(tcfg).to(device)
    eval_tf = build_eval_transform(tcfg).to(device)

    # ---- batch arithmetic: global batch = micro x processes x accumulation
    world = info.world_size
    micro = cfg.micro_batch or max(1, cfg.batch_size // world)
    accum = max(1, cfg.batch_size // (micro * world))
    if micro * world * accum != cfg.batch_size:
        raise VitlabError(f"batch_size {cfg.batch_size} is not micro_batch {micro} x {world} processes x an integer "
                          f"number of accumulation steps; pick a batch_size divisible by {micro * world}")
    from vitlab.data import make_loader

    def train_loader(epoch: int, skip: int):
        return make_loader(data.train, micro, shuffle=True, seed=cfg.seed, epoch=epoch, skip_batches=skip,
                           drop_last=True, rank=info.rank, world_size=world, num_workers=None)

    batches_per_epoch = train_loader(0, 0).total_batches
    steps_per_epoch = batches_per_epoch // accum
    if steps_per_epoch == 0:
        raise VitlabError(f"batch_size {cfg.batch_size} is larger than the training set ({len(data.train)} images); "
                          "lower --batch-size")
    total_steps = cfg.steps if cfg.steps > 0 else max(1, math.ceil(cfg.epochs * steps_per_epoch))
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_epochs * steps_per_epoch)
    warmup = min(int(warmup), total_steps)

    # ---- precision, memory, wrappers, optimiser
    # "auto" on a CPU is a timing: rank 0 decides for all, so that every process computes alike
    precision = D.broadcast_object(resolve_precision(cfg.precision, device, model) if main else None, info)
    if precision in ("bf16", "bf16-stem") and device.type == "cpu" and not cpu_bf16_supported():
        if main:
            print("vitlab train: this CPU has no bf16 support; using fp32", file=sys.stderr)
        precision = "fp32"
    set_stem_precision(model, precision)
    cfg.precision = precision  # config.yaml records what ran: `--config` and `--resume` compute the same way
    model.to(device)
    if cfg.grad_checkpointing:
        if not hasattr(model, "set_grad_checkpointing"):
            raise VitlabError(f"{type(model).__name__} has no activation checkpointing; drop --grad-checkpointing")
        model.set_grad_checkpointing(True)
    mask = decay_mask(model)
    raw_model = model

    # ---- run folder and resume
    if cfg.resume:
        run_path = run_folder_of(cfg.resume)
    else:
        run_path = D.broadcast_object(str(new_run_dir(cfg)) if main else None, info)
    run = RunDir(run_path, enabled=main)
    lock_run_folder(lock or RunLock(), run, info, force_unlock)  # before anything in the folder is touched
    run.remove_leftovers()
    ckpts = CheckpointManager(run.path / "checkpoints", cfg.keep_last)
    state, state_path = load_resume_state(cfg.resume) if cfg.resume else (None, None)
    if state is not None:
        check_world_size(state, info.world_size, allow_change, changes)
        load_model_state(raw_model, state["model"], state_path)

    raw_model = convert_sync_batchnorm(raw_model, cfg.batchnorm, info, device)
    wrapped = D.wrap_model(raw_model, info, device, fsdp=cfg.fsdp)
    named = {_plain_name(n): p for n, p in wrapped.named_parameters() if p.requires_grad}
    groups = [{"params": [p for n, p in named.items() if mask.get(n, False)], "weight_decay": cfg.weight_decay},
              {"params": [p for n, p in named.items() if not mask.get(n, False)], "weight_decay": 0.0}]
    optimizer = build_optimizer([g for g in groups if g["params"]], cfg.optimizer, cfg.lr, cfg.weight_decay,
                                tuple(cfg.betas), cfg.momentum)
    scheduler = build_scheduler(optimizer, total_steps, warmup, cfg.decay, cfg.lr, cfg.lr_end)
    scaler = torch.amp.GradScaler(device.type, enabled=(precision == "fp16"))
    forward_model = torch.compile(wrapped) if cfg.compile else wrapped
    eval_model = wrapped if cfg.fsdp and info.enabled else raw_model

    global_step, epoch, step_in_epoch = 0, 0, 0
    history: list[dict[str, Any]] = []
    best_val = None
    train_time_prev, images_prev, wall_prev = 0.0, 0, 0.0
    if state is not None:
        load_optim_state(wrapped, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        global_step, epoch, step_in_epoch = state["global_step"], state["epoch"], state["step_in_epoch"]
        history = list(state.get("history", []))
        best_val = state.get("best_val")
        train_time_prev, images_prev = state.get("train_time_s", 0.0), state.get("train_images", 0)
        wall_prev = state.get("wall_time_s", 0.0)  # the earlier segments' wall time: summary.json adds them up
        rngs = state["rng"]
        set_rng_state(rngs[info.rank] if isinstance(rngs, list) and info.rank < len(rngs) else rngs[0] if isinstance(rngs, list) else rngs)
        run.truncate_metrics(global_step)
        record_changes(run, cfg, changes, global_step)
    else:
        run.save_config(cfg)
        if main:
            from vitlab.data import write_skipped

            write_skipped(data, run.path)
        # per-process RNG streams for dropout / stochastic depth (data order and augmentation are seeded apart)
        torch.manual_seed(cfg.seed + 1000 * info.rank)

    n_params = sum(p.numel() for p in raw_model.parameters())
    if main:
        print_numerics(cfg, precision, world)
        print(f"vitlab: {data.summary()}")
        print(f"vitlab: model {getattr(mcfg, 'name', type(raw_model).__name__)} ({n_params:,} parameters), "
              f"image {image_size[0]}x{image_size[1]}, {precision} on {device}"
              f"{f' x {world} processes' if world > 1 else ''}; batch {cfg.batch_size} = {micro} x {world} x {accum} "
              f"accumulation; {total_steps} steps ({steps_per_epoch}/epoch), warm-up {warmup}")
        print(f"vitlab: run folder {run.path}" + (f" (resuming from step {global_step})" if state is not None else ""),
              flush=True)

    def make_state() -> dict[str, Any]:
        rngs = [rng_state()]
        if info.enabled:
            import torch.distributed as dist

            all_rngs: list[Any] = [None] * world
            dist.all_gather_object(all_rngs, rngs[0])
            rngs = all_rngs
        return {"model": full_model_state(wrapped), "optimizer": full_optim_state(wrapped, optimizer),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler.is_enabled() else {},
                "rng": rngs, "global_step": global_step, "epoch": epoch, "step_in_epoch": step_in_epoch,
                "history": history, "best_val": best_val, "epoch_sums": list(epoch_sums), "train_time_s": train_time_prev + train_time,
                "train_images": images_prev + train_images, "config": cfg.to_dict(), "world_size": world,
                "wall_time_s": wall_prev + time.perf_counter() - t_start}

    last_saved_step = -1

    def save_checkpoint(best_metric: float | None = None) -> None:
        nonlocal last_saved_step
        last_saved_step = global_step
        st = make_state()
        if main:
            ckpts.save(st, global_step)
            if best_metric is not None:
                ckpts.save_best(st, best_metric)
        D.barrier(info)

    # ---- the loop
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=global_step, unit="step", dynamic_ncols=True, file=sys.stderr)
    train_time, train_images = 0.0, 0
    step_delay = float(os.environ.get("VITLAB_TEST_STEP_SLEEP", "0"))  # tests: leave time to kill a run
    use_mix = tcfg.mixing
    last_log_t, last_log_images = time.perf_counter(), 0
    epoch_sums = [0.0, 0.0, 0.0]  # loss x n, correct, n of this epoch (this process)
    if state is not None and "epoch_sums" in state:
        epoch_sums = list(state["epoch_sums"])
    set_train_mode(forward_model, cfg.batchnorm)
    stop = stop or StopSignals()
    stop.listen()  # from here on a first Ctrl-C / SIGTERM ends the run at the next step boundary, checkpointed
    while global_step < total_steps:
        loader = iter(train_loader(epoch, step_in_epoch * accum))
        while step_in_epoch < steps_per_epoch and global_step < total_steps:
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            correct = torch.zeros((), device=device)
            seen = 0
            for m in range(accum):
                x, y = next(loader)
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                xt = train_tf(x, seed=step_seed(cfg.seed, global_step, m, info.rank))
                sync = m == accum - 1
                ctx = forward_model.no_sync() if (info.enabled and not sync and hasattr(forward_model, "no_sync")) \
                    else contextlib.nullcontext()
                with ctx:
                    with autocast_context(precision, device):
                        if use_mix:
                            xt, targets = mix_batch(xt, y, num_classes, mixup_alpha=tcfg.mixup,
                                                    cutmix_alpha=tcfg.cutmix, prob=tcfg.mix_prob,
                                                    switch_prob=tcfg.mix_switch_prob,
                                                    label_smoothing=cfg.label_smoothing,
                                                    seed=step_seed(cfg.seed + 1, global_step, m, info.rank))
                        logits = forward_model(xt)
                    logits = logits.float()
                    if use_mix:
                        loss = soft_cross_entropy(logits, targets)
                    else:
                        loss = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
                    scaler.scale(loss / accum).backward()
                loss_sum += loss.detach() * len(y)
                correct += (logits.detach().argmax(1) == y).sum()
                seen += len(y)
            # the stop request rides on the metrics' reduction, so every process stops after the same step
            loss_val, correct_val, seen_all, stop_votes = D.all_reduce_sum(
                [float(loss_sum), float(correct), float(seen), float(stop.received is not None)], info, device)
            step_loss = loss_val / max(seen_all, 1)
            if not math.isfinite(step_loss):
                stop_diverged("loss", step_loss, global_step, epoch, ckpts, main, bar)
            if cfg.grad_clip:
                scaler.unscale_(optimizer)
                grad_norm = float(_clip_grad_norm(wrapped, cfg.grad_clip))
                if not math.isfinite(grad_norm) and not scaler.is_enabled():  # fp16 skips such steps by design
                    stop_diverged("the gradient norm", grad_norm, global_step, epoch, ckpts, main, bar)
            else:
                grad_norm = None
            lr_now = optimizer.param_groups[0]["lr"]
            scaler.step(optimizer)
            scaler.update()
            if not params_finite(wrapped, info, device, sharded=_is_fsdp(wrapped)):  # a finite loss, a wild update
                stop_diverged("the weights", "non-finite", global_step, epoch, ckpts, main, bar)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            step_in_epoch += 1
            epoch_sums[0] += loss_val
            epoch_sums[1] += correct_val
            epoch_sums[2] += seen_all
            dt = time.perf_counter() - t0
            train_time += dt
            train_images += int(seen_all)
            if step_delay:
                time.sleep(step_delay)
            if global_step % max(1, cfg.log_every) == 0 or global_step == total_steps:
                now = time.perf_counter()
                ips = (train_images - last_log_images) / max(now - last_log_t, 1e-9)
                last_log_t, last_log_images = now, train_images
                run.log({"type": "step", "step": global_step, "epoch": epoch,
                         "epoch_float": epoch + step_in_epoch / steps_per_epoch, "loss": step_loss, "lr": lr_now,
                         "grad_norm": grad_norm, "images_per_s": ips})
                if bar is not None:
                    bar.set_postfix(epoch=epoch + 1, loss=f"{step_loss:.4f}", lr=f"{lr_now:.2e}", img_s=f"{ips:.0f}")
            if bar is not None:
                bar.update(1)
            mid_epoch = step_in_epoch < steps_per_epoch and global_step < total_steps
            if cfg.ckpt_every and global_step % cfg.ckpt_every == 0 and mid_epoch:
                save_checkpoint()
            if mid_epoch and (stop_votes > 0 if info.enabled else stop.received):
                if last_saved_step != global_step:
                    save_checkpoint()
                stop_interrupted(cfg, run, ckpts, stop.received or "a signal on another process", global_step, bar)

        # ---- end of epoch (or of the step budget): evaluate, log, checkpoint
        record = {"type": "epoch", "epoch": epoch + 1, "step": global_step,
                  "train_loss": epoch_sums[0] / max(epoch_sums[2], 1) if epoch_sums[2] else None,
                  "train_acc": epoch_sums[1] / max(epoch_sums[2], 1) if epoch_sums[2] else None,
                  "lr": optimizer.param_groups[0]["lr"], "time_s": wall_prev + time.perf_counter() - t_start}
        is_last = global_step >= total_steps
        metric = None
        if data.val is not None and ((epoch + 1) % max(1, cfg.eval_every) == 0 or is_last):
            logits, labels = predict_split(eval_model, data.val, eval_tf, device, precision, cfg.eval_batch_size, info)
            set_train_mode(forward_model, cfg.batchnorm)  # predict_split restored train() on every layer
            vm = split_metrics(logits, labels, class_names)
            record.update(val_loss=vm["loss"], val_acc=vm["accuracy"], val_macro_f1=vm["macro_f1"])
            metric = vm["accuracy"]
        history.append({k: v for k, v in record.items() if k != "type"})
        run.log(record)
        if show and bar is not None:
            bar.write(_epoch_line(record, num_epochs))
        elif main and cfg.quiet:
            print(_epoch_line(record, num_epochs), flush=True)
        better = metric is not None and (best_val is None or metric > best_val)
        if better:
            best_val = metric
        epoch += 1
        step_in_epoch = 0
        epoch_sums = [0.0, 0.0, 0.0]
        save_checkpoint(best_metric=metric if better else None)
        if D.all_reduce_sum([float(stop.received is not None)], info, device)[0] > 0:  # came during the evaluation
            stop_interrupted(cfg, run, ckpts, stop.received or "a signal on another process", global_step, bar)
    stop.restore()  # the final evaluation: Ctrl-C stops at once again
    if bar is not None:
        bar.close()

    # ---- final evaluation and the run folder's summary
    result = TrainResult(model=raw_model, run_dir=run.path, history=history, config=cfg, best_val_acc=best_val)
    split = data.test if data.test is not None else data.val
    split_name = "test" if data.test is not None else "val"
    total_train_time = train_time_prev + train_time
    total_images = images_prev + train_images
    result.images_per_s = total_images / max(total_train_time, 1e-9)
    if split is not None:
        logits, labels = predict_split(eval_model, split, eval_tf, device, precision, cfg.eval_batch_size, info)
        result.test_metrics = split_metrics(logits, labels, class_names)
    result.wall_time_s = wall_prev + time.perf_counter() - t_start
    _gather_stream_failures(data, info)  # a collective: every rank
    fsdp_state = full_model_state(wrapped) if _is_fsdp(wrapped) else None  # a collective: every rank
    if main:
        from vitlab.data import write_skipped

        line = write_skipped(data, run.path)  # again: training files that failed to decode while streaming
        if data.all_skipped():
            print(f"vitlab: {line}", flush=True)
        _write_outputs(run, cfg, result, raw_model, wrapped, class_names, tcfg, split_name, n_params, precision,
                       device, world, total_steps, fsdp_state)
    D.barrier(info)
    set_stem_precision(raw_model, "fp32")  # the returned model computes in fp32 again
    return result


def _gather_stream_failures(data, info: D.DistInfo) -> None:
    """Streamed training files that failed on other ranks, added to this rank's list (a collective)."""
    failures = getattr(data.train, "failures", None)
    if not info.enabled or failures is None:
        return
    import torch.distributed as dist

    parts: list[Any] = [None] * info.world_size
    dist.all_gather_object(parts, list(failures))
    known = {p for p, _ in failures}
    for part in parts:
        for path, reason in part:
            if path not in known:
                known.add(path)
                failures.append((path, reason))


def _plain_name(name: str) -> str:
    """Parameter name without the DDP / FSDP / compile wrapper prefixes."""
    for prefix in ("_orig_mod.", "module.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def _clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global-norm clipping; with FSDP the gradients are sharded DTensors and the norm is global too."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _epoch_line(r: dict[str, Any], num_epochs: int) -> str:
    parts = [f"epoch {r['epoch']}/{num_epochs}"]
    if r.get("train_loss") is not None:
        parts.append(f"train loss {r['train_loss']:.4f} acc {r['train_acc']:.4f}")
    if r.get("val_acc") is not None:
        parts.append(f"val loss {r['val_loss']:.4f} acc {r['val_acc']:.4f} macro-F1 {r['val_macro_f1']:.4f}")
    parts.append(f"{r['time_s']:.0f}s")
    return " | ".join(parts)


def _write_outputs(run: RunDir, cfg: TrainConfig, result: TrainResult, raw_model: nn.Module, wrapped: nn.Module,
                   class_names: list[str], tcfg, split_name: str, n_params: int, precision: str,
                   device: torch.device, world: int, total_steps: int, fsdp_state: dict | None = None) -> None:
    from vitlab.train.plots import plot_curves

    plot_curves(run.path)
    tm = result.test_metrics
    if tm is not None:
        from vitlab.evaluate.plots import plot_confusion_matrix

        plot_confusion_matrix(tm["confusion_matrix"], class_names, run.path / "confusion_matrix.png",
                              title=f"{split_name} confusion matrix (accuracy {tm['accuracy']:.4f})")
    if cfg.save_model:
        from vitlab.weights import save_native

        model = raw_model
        if fsdp_state is not None:  # the sharded model -> a plain CPU copy with the gathered weights
            from vitlab.models.registry import build_model

            model = build_model(raw_model.config)
            model.load_state_dict(fsdp_state)
            result.model = model
        save_native(model.cpu() if model is not raw_model else _cpu_copy(model), run.path / "model",
                    class_names=class_names, preprocess=tcfg.preprocess())
    summary = {
        "run_dir": str(run.path), "recipe": cfg.recipe, "data": cfg.data,
        "model": getattr(getattr(raw_model, "config", None), "name", type(raw_model).__name__),
        "parameters": n_params, "precision": precision, "device": str(device), "processes": world,
        "steps": total_steps, "epochs": len(result.history),
        "eval_split": split_name,
        "test_accuracy": tm["accuracy"] if tm else None,
        "test_accuracy_ci95": tm["accuracy_ci95"] if tm else None,
        "test_macro_f1": tm["macro_f1"] if tm else None,
        "best_val_acc": result.best_val_acc,
        "wall_time_s": result.wall_time_s, "train_images_per_s": result.images_per_s,
        # CPU seconds of this process (all threads): on a shared machine wall time depends on the neighbours
        "process_cpu_time_s": time.process_time(), "torch_threads": torch.get_num_threads(),
        "history": result.history, "test_metrics": tm,
    }
    run.write_json("summary.json", summary)


def _cpu_copy(model: nn.Module) -> nn.Module:
    """save_native needs CPU tensors; copy only when the model lives elsewhere."""
    first = next(model.parameters(), None)
    if first is None or first.device.type == "cpu":
        return model
    import copy

    return copy.deepcopy(model).cpu()
