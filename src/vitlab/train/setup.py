"""Setting a run up: the process (threads' allocator, seeds, deterministic kernels), the model and its
transforms, the batch arithmetic, the precision and the optimizer - each a function usable alone."""

from __future__ import annotations

import math
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.train import distributed as D
from vitlab.train.config import TrainConfig
from vitlab.train.optim import build_optimizer, build_scheduler
from vitlab.train.precision import cpu_bf16_supported, resolve_precision


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


@dataclass(frozen=True)
class ProcessSettings:
    """What a run sets for the whole process, which `vitlab.train` gives back when it returns or fails: torch's
    thread count and deterministic mode. A program (a notebook) that trained with `deterministic=True` kept
    deterministic-only kernels after the run, so its own later CUDA code could stop with "does not have a
    deterministic implementation", and it kept the run's thread count."""

    threads: int
    deterministic: bool
    deterministic_warn_only: bool
    cudnn_benchmark: bool
    cublas_workspace: str | None

    @classmethod
    def now(cls) -> ProcessSettings:
        return cls(torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
                   torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.benchmark,
                   os.environ.get("CUBLAS_WORKSPACE_CONFIG"))

    def restore(self) -> None:
        torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        if self.cublas_workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = self.cublas_workspace


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


def load_splits(cfg: TrainConfig, progress: bool, report: bool | None = None, checkpoint: tuple | None = None):
    """The run's data; `report` (default: `progress`) prints what the loader noticed (files in no class folder,
    a --per-class above a class's size, copies across splits): --quiet turns off the progress bars, not those.
    `checkpoint`: `finetune_checkpoint(cfg)`, already read."""
    from vitlab.data import load_data

    return load_data(cfg.data, classes=cfg.classes, per_class=cfg.per_class, val_fraction=cfg.val_fraction,
                     test_fraction=cfg.test_fraction, seed=cfg.seed if cfg.data_seed is None else cfg.data_seed,
                     progress=progress, report=report, model_side=training_side(cfg, checkpoint))


def absolute_weights(weights: str) -> str:
    """--weights as a run records it: a local file or folder by its absolute path, as `data` (an existing path is
    what every loader takes first, so the meaning is the same). Recorded relative, a resume from another folder read
    another file of that name, and trained on with that file's normalisation, or fell back to the checkpoint.
    Pretrained names, hf:ORG/NAME, URLs and paths that do not exist here are kept as given."""
    path = Path(weights).expanduser()
    if "://" in weights or not path.exists():
        return weights
    return str(path.resolve())


def finetune_checkpoint(cfg: TrainConfig) -> tuple | None:
    """`read_checkpoint` of --weights, read once for the run: the data takes its size (`training_side`), the model
    its weights (`build_model_for`); a ViT-H file is gigabytes. None without --weights; () where the file does not
    read, so that it is not tried again for the size (a weights name not cached offline waits on the network each
    time): the model load then says what is wrong, in its own words."""
    if not cfg.weights:
        return None
    from vitlab.weights import read_checkpoint

    try:
        return read_checkpoint(cfg.weights, size_hint=cfg.image_size)
    except (VitlabError, OSError):
        return ()


def training_side(cfg: TrainConfig, checkpoint: tuple | None = None) -> int | None:
    """The side the run's model reads (`load_data(model_side=...)`): --image-size, else a fine-tuning's checkpoint
    size (a 384-px checkpoint fine-tuned on photos stored at 256 trained on enlarged, blurred images); None for a
    from-scratch model sized to the data. `checkpoint`: `finetune_checkpoint(cfg)` where the caller has it."""
    if cfg.image_size:
        return int(cfg.image_size)
    from vitlab.data.load import is_builtin_source

    if not cfg.weights or is_builtin_source(cfg.data):  # built-in sets have a fixed size
        return None
    if checkpoint is None:
        checkpoint = finetune_checkpoint(cfg)
    return int(max(checkpoint[0].image_size)) if checkpoint else None


SMALL_VIT = dict(dim=64, depth=6, heads=4, mlp_dim=128, patch_size=4)


def build_model_for(cfg: TrainConfig, data,
                    checkpoint: tuple | None = None) -> tuple[nn.Module, Any, int | None, str | None]:
    """Fine-tuning: the checkpoint with a new zero head (and resampled position embeddings);
    from scratch: a registry model sized for the data. Returns (model, preprocess or None, the class count of the
    weights' head where it was replaced for the data's, else None, a note on a kept head's classes or None).
    `checkpoint`: `finetune_checkpoint(cfg)`, already read."""
    num_classes = data.num_classes
    if cfg.weights:
        from vitlab.weights import load_with_meta

        try:
            model, meta = load_with_meta(cfg.weights, num_classes=num_classes, image_size=cfg.image_size,
                                         checkpoint=checkpoint or None)
        except VitlabError:
            if not cfg.resume:
                raise
            # a resumed fine-tuning run whose starting weights are gone (deleted, or a download not cached here):
            # the checkpoint holds the whole model, config included, and its weights are restored anyway
            from vitlab.train.checkpoint import find_resume_checkpoint

            model, meta = load_with_meta(find_resume_checkpoint(cfg.resume), num_classes=num_classes,
                                         image_size=cfg.image_size)
        note = None if cfg.zero_head else kept_head_in_data_order(model, meta.get("class_names"), data.class_names)
        return with_regularisation(model, cfg), meta.get("preprocess"), meta.get("replaced_head_classes"), note
    from vitlab.models.registry import create_model

    args = dict(cfg.model_args)
    if cfg.model == "custom":
        # training's "custom" is small-data.md 2.3's small ViT, and --model-args change single values of it
        # (`depth=2`); the registry's own "custom" starts from ViT-B, which no small image set takes
        args = {**SMALL_VIT, **args}
        cfg.model_args = dict(args)  # the saved config.yaml names the model that was built
    size = _build_size(cfg, args.pop("image_size", None))
    if "num_classes" in args:  # a second value crashed create_model with a TypeError
        raise VitlabError("model_args num_classes: the data decides the classes (use --classes to choose them); "
                          "leave it out")
    if size is None:  # the data's side, or the next size the model's stride takes (vit-ti/16 on 28 px: 32)
        from vitlab.evaluate.loading import fit_size

        side = data.train.image_size[0]
        size = fit_size(cfg.model, {**args, "in_chans": args.get("in_chans", data.channels)}, side)
        if size != side and not cfg.quiet:
            print(f"vitlab: {cfg.model} built at {size} px: the data's {side} px is not a multiple of its stride "
                  "(--image-size chooses)", file=sys.stderr)
    if cfg.drop_path is not None:
        args["drop_path"] = cfg.drop_path
    if cfg.dropout is not None:
        args["dropout"] = cfg.dropout
    args.setdefault("in_chans", data.channels)
    model = create_model(cfg.model, num_classes=num_classes, image_size=size, seed=cfg.seed, **args)
    return model, None, None, None


def kept_head_in_data_order(model: nn.Module, head_classes, data_classes) -> str | None:
    """`zero_head false` keeps the weights' head; where it names the data's classes in another order its rows are
    put in the data's order (row i scored the data's class i, another class, without a word). A note says so, or
    says that the head's classes are not the data's; None where there is nothing to say."""
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear) or not head_classes or len(head_classes) != head.out_features:
        return None
    names, wanted = [str(c) for c in head_classes], [str(c) for c in data_classes]
    if names == wanted:
        return None
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    if sorted(names) != sorted(wanted) or len(set(names)) != len(names):
        return (f"head: kept (zero_head false), but its classes ({shown}) are not the data's "
                f"({', '.join(wanted[:4])}{', ...' if len(wanted) > 4 else ''}): its row i scores the data's class i")
    rows = torch.tensor([names.index(c) for c in wanted], device=head.weight.device)
    with torch.no_grad():
        head.weight.copy_(head.weight[rows])
        if head.bias is not None:
            head.bias.copy_(head.bias[rows])
    return f"head: kept (zero_head false), its rows put in the data's class order (the weights had {shown})"


def with_regularisation(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """The model with --dropout / --drop-path where they are given: a loaded checkpoint (or a given model) was
    built with the values it was pre-trained with, and the flags were recorded in config.yaml but never applied.
    Dropout layers hold no weights, so the model is rebuilt with the new values and its weights copied over."""
    config = getattr(model, "config", None)
    wanted = {k: v for k, v in (("dropout", cfg.dropout), ("drop_path", cfg.drop_path)) if v is not None}
    if config is None or getattr(config, "arch", None) != "vit" or not wanted:
        if wanted and config is not None and getattr(config, "arch", None) != "vit":
            raise VitlabError(f"--{'/--'.join(k.replace('_', '-') for k in wanted)} apply to ViTs; this model is a "
                              f"{config.arch}")
        return model
    if all(getattr(config, k) == v for k, v in wanted.items()):
        return model
    from vitlab.models.registry import build_unfilled
    from vitlab.weights import load_state_dict_strict
    from vitlab.weights.native import check_savable, hand_put_head

    try:
        check_savable(model)  # a module put in by hand (a head): the rebuild from the config would not hold it
    except VitlabError:
        flags = "/".join(f"--{k.replace('_', '-')}" for k in wanted)
        head = hand_put_head(model) or "a module was changed by hand"
        raise VitlabError(f"{flags} rebuild the model from its config, which cannot hold a module put in by hand "
                          f"({head}); give {' and '.join(f'{k}=' for k in wanted)} when building the model instead: "
                          f"vitlab.create_model(..., {', '.join(f'{k}={v}' for k, v in wanted.items())})") from None
    rebuilt = build_unfilled(config.replace(**wanted))  # its weights are the model's: no initialisation first
    load_state_dict_strict(rebuilt, model.state_dict(), "the model", assign=True)  # copies: the given model stays
    return rebuilt.to(next(model.parameters()).device)


def setting_notes(cfg: TrainConfig) -> list[str]:
    """Settings the run records but cannot honour as written, each said in one line at the start."""
    notes = []
    if cfg.optimizer == "adam" and cfg.weight_decay > 0:
        notes.append(f"--optimizer adam applies no weight decay (weight_decay {cfg.weight_decay:g} is not used); "
                     "adamw is Adam with the paper's decoupled decay")
    if cfg.weights and cfg.zero_head and cfg.head_bias_init is not None:
        notes.append(f"head_bias_init {cfg.head_bias_init:g} is not used: fine-tuning zeroes the head (paper B.1.1); "
                     "set zero_head false to keep it")
    if cfg.decay == "linear" and cfg.lr_end > cfg.lr:
        notes.append(f"lr_end {cfg.lr_end:g} is above lr {cfg.lr:g}: the linear decay rises to it (--lr-end sets it)")
    return notes


def _build_size(cfg: TrainConfig, from_args):
    """The size to build at: --image-size, or model_args' image_size (the same thing said in the model's spec);
    two different values are refused. None: the data's own size."""
    if from_args is None or cfg.image_size is None:
        return cfg.image_size or from_args

    def pair(size):
        return tuple(size) if isinstance(size, (list, tuple)) else (size, size)

    if pair(from_args) != pair(cfg.image_size):
        raise VitlabError(f"model_args image_size {from_args} and --image-size {cfg.image_size} differ; give one")
    return cfg.image_size


def describe_given_model(model: nn.Module) -> tuple[str, dict[str, Any]] | None:
    """(registry name, model_args) that build `model`'s architecture again: what config.yaml must record for a model
    handed to `train(cfg, model=...)`, so that `--config RUN/config.yaml` and `--resume RUN` build that model and
    not the name the config happened to carry. None for a model vitlab cannot name (not one of its own)."""
    from vitlab.errors import VitlabError
    from vitlab.models.registry import get_config

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict") or not isinstance(getattr(config, "name", None), str):
        return None
    try:
        base = get_config(config.name).to_dict()
    except VitlabError:
        return None
    if config.name == "custom":  # training builds "custom" from the small-data ViT, not the registry's ViT-B values
        base = get_config("custom", **SMALL_VIT).to_dict()
    set_by_the_run = ("name", "num_classes", "image_size")  # from the data and the run's settings
    args = {k: v for k, v in config.to_dict().items() if k not in set_by_the_run and base.get(k) != v}
    # the model's channels, always: a run builds the data's otherwise, and a 3-channel model trained on grey data
    # (converted on the fly) resumed as a 1-channel one that its checkpoint does not fit
    if isinstance(getattr(config, "in_chans", None), int):
        args["in_chans"] = config.in_chans
    return config.name, args


def prepare_given_model(model: nn.Module, num_classes: int, cfg: TrainConfig, report: bool = True) -> nn.Module:
    """A model handed in by the caller: give it a zero head when its classes do not match; see `own_module`
    for a module that is not vitlab's."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_dict"):
        return own_module(model, cfg, report)
    if config.num_classes != num_classes and hasattr(model, "reset_classifier"):
        model.reset_classifier(num_classes)
    if cfg.save_model:
        refuse_unsavable(model)
    return model


def own_module(model: nn.Module, cfg: TrainConfig, report: bool) -> nn.Module:
    """A module of the caller's own (not built by vitlab) trains as it is. --dropout / --drop-path rebuild a vitlab
    model from its config: on such a module they were recorded in config.yaml and applied nowhere, so they are
    refused. Its model folder cannot be written (vitlab.load rebuilds a model from a vitlab config): the run
    failed on that after its last step, with no summary.json; now it leaves model/ out, says so at the start,
    and records save_model false."""
    given = [f"--{k.replace('_', '-')}" for k in ("dropout", "drop_path") if getattr(cfg, k) is not None]
    name = type(model).__name__
    if given:
        raise VitlabError(f"{' and '.join(given)} apply to vitlab's models; {name} is a module of your own: set its "
                          f"dropout in its code and drop {' and '.join(given)}")
    if cfg.save_model:
        cfg.save_model = False
        if report:
            print(f"vitlab: {name} is not a vitlab model, so the run writes no model/ folder (vitlab.load rebuilds "
                  "models from their config); its weights are in the run's checkpoints and in the result's .model",
                  file=sys.stderr, flush=True)
    return model


def refuse_unsavable(model: nn.Module) -> None:
    """A given vitlab model that `vitlab.save` refuses (a head put in by hand: `weights.native.check_savable`) is
    refused before the first step, where the run's save refused it only after the last."""
    from vitlab.weights.native import check_savable

    try:
        check_savable(model)
    except VitlabError as exc:
        raise VitlabError(f"{exc} (the run saves its model at the end; save_model=False trains without saving "
                          "it)") from None


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
        print("vitlab: batchnorm=sync needs several CUDA processes (torchrun on GPUs); running plain "
              "BatchNorm (statistics of each process's micro-batch)", file=sys.stderr)
    return model



def init_head(model: nn.Module, cfg: TrainConfig) -> None:
    """--head-bias-init, and fine-tuning's zero head (paper B.1.1: also when the classes match)."""
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear):
        return
    with torch.no_grad():
        if cfg.head_bias_init is not None:
            head.bias.fill_(float(cfg.head_bias_init))
        if cfg.weights and cfg.zero_head:
            head.weight.zero_()
            head.bias.zero_()


def new_head_note(model: nn.Module, cfg: TrainConfig, given_classes: int | None, num_classes: int) -> str | None:
    """The line that says the head the run starts from is new (fine-tuning's zero head, or a given model's head
    replaced for other classes), so that nobody takes the weights' own head to be the one trained on."""
    if not isinstance(getattr(model, "head", None), nn.Linear):
        return None
    if cfg.weights and cfg.zero_head:
        return f"head: new, zero-initialised, {num_classes} classes (fine-tuning, paper B.1.1)"
    if given_classes is not None and given_classes != num_classes:
        return f"head: new, zero-initialised, {num_classes} classes (the model's head had {given_classes})"
    return None


def build_transforms(cfg: TrainConfig, model: nn.Module, data, preprocess, device: torch.device):
    """The train and eval transforms for this model and data: (tcfg, train_tf, eval_tf, image_size). Fills in
    cfg.image_size and, when fine-tuning, cfg.mean / cfg.std from the weights' preprocessing (recorded)."""
    from vitlab.data.transforms import TransformConfig, build_eval_transform, build_train_transform

    mcfg = getattr(model, "config", None)
    image_size = tuple(mcfg.image_size) if mcfg is not None else (cfg.image_size or data.train.image_size[0],) * 2
    in_chans = mcfg.in_chans if mcfg is not None else data.channels
    mean, std = cfg.mean, cfg.std
    # fine-tuning keeps the normalisation the weights were trained with, as the run recorded it when it started: a
    # resume that read it from the weights again went on with another where the file had changed since
    if preprocess is not None and not cfg.resume:
        mean, std = tuple(preprocess.mean), tuple(preprocess.std)
        cfg.mean, cfg.std = list(mean), list(std)
    if cfg.image_size is None:
        cfg.image_size = int(image_size[0])
    overrides = dict(mean=mean, std=std, inception_crop=cfg.inception_crop, crop_scale=tuple(cfg.crop_scale),
                     crop_sampler=cfg.crop_sampler,
                     random_erasing=cfg.random_erasing, random_shift=cfg.random_shift, mixup=cfg.mixup, cutmix=cfg.cutmix,
                     randaugment=tuple(cfg.randaugment) if cfg.randaugment else None)
    if cfg.hflip is not None:
        overrides["hflip"] = cfg.hflip
    tcfg = TransformConfig.for_source(cfg.data, image_size, in_chans, **overrides)
    return tcfg, build_train_transform(tcfg).to(device), build_eval_transform(tcfg).to(device), image_size


# ------------------------------------------------------------------------------ batch arithmetic
@dataclass(frozen=True)
class BatchPlan:
    """global batch = micro x processes x accumulation; the steps of the run and of an epoch."""

    micro: int
    world: int
    accum: int
    batches_per_epoch: int  # micro-batches of one process
    steps_per_epoch: int
    total_steps: int
    num_epochs: int
    warmup: int


def split_batch(batch_size: int, micro_batch: int | None, world: int) -> tuple[int, int]:
    """(micro, accumulation) with micro x world x accumulation == batch_size, or a one-line refusal."""
    micro = micro_batch or max(1, batch_size // world)
    accum = max(1, batch_size // (micro * world))
    if micro * world * accum != batch_size:
        raise VitlabError(f"batch_size {batch_size} is not micro_batch {micro} x {world} processes x an integer "
                          f"number of accumulation steps; pick a batch_size divisible by {micro * world}")
    return micro, accum


def plan_steps(cfg: TrainConfig, micro: int, world: int, accum: int, batches_per_epoch: int,
               n_train: int) -> BatchPlan:
    """Steps per epoch, total steps (--steps, else --epochs), epochs and warm-up steps."""
    steps_per_epoch = batches_per_epoch // accum
    if steps_per_epoch == 0:
        # the recipes' batches are for sets of thousands; a folder of a few dozen images needs a number to try
        fits = max(world, n_train - n_train % world)
        raise VitlabError(f"batch_size {cfg.batch_size} is larger than the training set ({n_train} images), so an "
                          f"epoch would have no step; use --batch-size {fits} or less")
    total_steps = cfg.steps if cfg.steps > 0 else max(1, math.ceil(cfg.epochs * steps_per_epoch))
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    return BatchPlan(micro, world, accum, batches_per_epoch, steps_per_epoch, total_steps, num_epochs,
                     min(requested_warmup(cfg, steps_per_epoch), total_steps))


def requested_warmup(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """The warm-up steps the config asks for (--warmup-steps, else --warmup-epochs), before the run's length caps it."""
    return int(cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_epochs * steps_per_epoch))


def warmup_notice(cfg: TrainConfig, plan: BatchPlan) -> str | None:
    """One line where the warm-up takes the whole run: the learning rate then only rises, never reaching its peak,
    and the schedule's decay never starts. The run goes on (a smoke run may want just that), but not unsaid."""
    requested = requested_warmup(cfg, plan.steps_per_epoch)
    if plan.total_steps < 2 or requested < plan.total_steps:
        return None
    asked = f"the warm-up asked for ({requested:,} steps)" if requested > plan.warmup else "the warm-up"
    return (f"vitlab: {asked} is as long as the run ({plan.total_steps:,} steps) or longer: the learning rate rises "
            "for the whole run and never reaches its peak or decays; lower --warmup-steps (or --warmup-epochs) or "
            "train longer")


# ------------------------------------------------------------------------- precision, products, optimizer
def run_products(cfg: TrainConfig, device: torch.device, model: nn.Module, precision: str, micro_batch: int,
                 info: D.DistInfo) -> str:
    """The route of the run's CPU fp32 training products ("auto" is a timing: rank 0 decides for all)."""
    from vitlab.train.products import resolve_products

    chosen = resolve_products(cfg.products, device, precision, model, micro_batch) if info.is_main else None
    return D.broadcast_object(chosen, info)


def run_precision(cfg: TrainConfig, device: torch.device, model: nn.Module, info: D.DistInfo) -> str:
    """The precision this run computes in. "auto" on a CPU is a timing: rank 0 decides for all, so that every
    process computes alike; bf16 on a CPU without it falls back to fp32 (one line says so)."""
    precision = D.broadcast_object(resolve_precision(cfg.precision, device, model) if info.is_main else None, info)
    if precision in ("bf16", "bf16-stem") and device.type == "cpu" and not cpu_bf16_supported():
        if info.is_main:
            print("vitlab: this CPU has no bf16 support; using fp32", file=sys.stderr)
        precision = "fp32"
    return precision


def plain_name(name: str) -> str:
    """Parameter name without the DDP / FSDP / compile wrapper prefixes."""
    for prefix in ("_orig_mod.", "module.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def param_groups(model: nn.Module, mask: dict[str, bool], weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters in two groups: weight decay where `mask` says so, none elsewhere (empty ones dropped)."""
    named = {plain_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    groups = [{"params": [p for n, p in named.items() if mask.get(n, False)], "weight_decay": weight_decay},
              {"params": [p for n, p in named.items() if not mask.get(n, False)], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimization(cfg: TrainConfig, model: nn.Module, mask: dict[str, bool], plan: BatchPlan, precision: str,
                       device: torch.device):
    """(optimizer, scheduler, scaler) for the (wrapped) model."""
    optimizer = build_optimizer(param_groups(model, mask, cfg.weight_decay), cfg.optimizer, cfg.lr, cfg.weight_decay,
                                tuple(cfg.betas), cfg.momentum)
    scheduler = build_scheduler(optimizer, plan.total_steps, plan.warmup, cfg.decay, cfg.lr, cfg.lr_end)
    scaler = torch.amp.GradScaler(device.type, enabled=(precision == "fp16"))
    return optimizer, scheduler, scaler
