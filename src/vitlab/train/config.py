"""`TrainConfig` (every knob of a run), the named recipes, and the recipe < YAML < flags merge.

A run's `config.yaml` is `TrainConfig.to_dict()` after merging, so `--config RUN/config.yaml`
repeats the run exactly.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from vitlab.errors import VitlabError
from vitlab.train.loggers import parse_logger
from vitlab.values import (  # noqa: F401 - typed values moved below train/ (values.py); re-exported here
    NotOfType,
    as_per_channel,
    convert,
    describe,
    is_null,
    parse_kv,
    shown,
    split_outside_brackets,
    typed_model_args,
    yaml_problem,
)


@dataclass
class TrainConfig:
    """Everything a training run needs; flat so that any field is one `--set key=value` away."""

    # --- what and where
    recipe: str = "small-data"
    data: str = "bundled"
    classes: Any = None  # names or indices, a list or "A,B,C"
    per_class: int | None = None
    val_fraction: float = 0.1
    # the test split the run leaves out, and the seed of the split (None: `seed`): recorded so that `vitlab evaluate
    # RUN` tests on the images the run never saw where a study split the data with its own settings
    test_fraction: float = 0.1
    data_seed: int | None = None
    model: str = "custom"  # a registry name (vit-b/16, resnet-50, custom) ...
    model_args: dict = field(default_factory=dict)  # ... with overrides (dim, depth, heads, mlp_dim, patch_size)
    weights: str | None = None  # fine-tuning: any checkpoint vitlab.load reads
    image_size: int | None = None  # None: the data's size (scratch) or the checkpoint's (fine-tune)
    out_dir: str = "runs"
    name: str | None = None  # run folder name; None: <recipe>-<data>-<time>
    seed: int = 0
    deterministic: bool = False
    # --- schedule length: epochs, or steps when steps > 0
    epochs: float = 10
    steps: int = 0
    batch_size: int = 128  # global batch (all processes, after accumulation)
    micro_batch: int | None = None  # per-process batch per forward; None: batch_size / world_size
    eval_batch_size: int = 500
    # --- optimiser and schedule
    optimizer: str = "adamw"  # adamw (= the paper's Adam + decoupled decay), adam, sgd
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.9
    weight_decay: float = 0.05  # decoupled, x lr (AdamW semantics); weight matrices only
    warmup_steps: int | None = None
    warmup_epochs: float = 0.0  # used when warmup_steps is None
    decay: str = "cosine"  # cosine, linear, constant
    lr_end: float = 0.0  # final lr of the linear decay (official 1e-5)
    grad_clip: float | None = 1.0  # global norm; None/0: off
    label_smoothing: float = 0.0
    head_bias_init: float | None = None  # e.g. -10 (paper i21k); None: keep the model's
    zero_head: bool = True  # fine-tuning: zero-initialised new head (paper B.1.1)
    drop_path: float | None = None  # stochastic depth; None: keep the model's
    dropout: float | None = None
    # --- augmentation (vitlab.data.transforms.TransformConfig)
    inception_crop: bool = True
    crop_scale: tuple[float, float] = (0.05, 1.0)
    # the inception crop's box sampler: "torchvision" (RandomResizedCrop) or "tf" (TF's
    # sample_distorted_bounding_box, as the official pipelines; vitlab.data.transforms.sample_tf_crop_boxes)
    crop_sampler: str = "torchvision"
    hflip: bool | None = None  # None: the data source's default (no flip for digits)
    randaugment: tuple[int, int] | None = None
    random_erasing: float = 0.0
    random_shift: int = 0  # pixels of random translation (pad + random crop)
    mixup: float = 0.0
    cutmix: float = 0.0
    mean: Any = 0.5
    std: Any = 0.5
    # --- budget
    device: str = "auto"  # auto, cpu, cuda, cuda:1
    precision: str = "auto"  # auto, bf16, fp16, fp32, bf16-stem (conv stem in bf16, Transformer in fp32)
    products: str = "auto"  # auto, onednn, torch: the CPU fp32 training products' route (train/products.py)
    grad_checkpointing: bool = False
    compile: bool = False
    threads: int | None = None  # torch intra-op threads on CPU; None: torch's default
    fsdp: bool = False  # shard parameters over processes (models too big for one device)
    # seconds a collective (torchrun) waits for the other processes before the run stops with one line;
    # 10 min instead of gloo's 30: a stopped or hung process ends the run instead of blocking it for half an hour
    dist_timeout: float = 600.0
    # BatchNorm during training (models without BN ignore it; docs/training.md): "train" updates the
    # running statistics (torchvision / timm / HF Trainer default); "frozen" keeps BN layers in eval
    # mode (statistics fixed, affine weights still learn: fine-tuning with small batches); "sync"
    # SyncBatchNorm over the processes of a multi-GPU run (a logged no-op elsewhere).
    batchnorm: str = "train"
    # --- run folder
    ckpt_every: int = 200  # optimizer steps between mid-epoch checkpoints (0: epoch ends only)
    keep_last: int = 2
    log_every: int = 10
    eval_every: int = 1  # epochs
    quiet: bool = False
    # run trackers beside metrics.jsonl (always written): none, tensorboard, wandb or a comma list (loggers.py)
    logger: str = "none"
    resume: str | None = None
    save_model: bool = True

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for k, v in out.items():
            if isinstance(v, tuple):
                out[k] = list(v)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        cfg = cls()
        return apply_overrides(cfg, data, source="from the config dict")

    def replace(self, **changes: Any) -> TrainConfig:
        return apply_overrides(dataclasses.replace(self), changes, source="from TrainConfig.replace")


# Recipes: overrides of the TrainConfig defaults (reference official-vit.md section 4, small-data.md section 2).
# The paper's recipes crop as the official pipelines do: TF's sample_distorted_bounding_box with area 5-100 %
# (vit_jax/input_pipeline.py `_pp`; pre-training "the same as in the fine-tuning code", VT#2; big_vision
# `inception_crop`), whose boxes are smaller on average than torchvision's RandomResizedCrop's (crop_sampler).
RECIPES: dict[str, dict[str, Any]] = {
    # Paper 4.1 / B.1: Adam(0.9, 0.999), decoupled wd 0.1 on kernels only, linear warm-up then linear
    # decay to 1e-5, clip at global norm 1. Paper: batch 4096, 10k warm-up steps; scaled-down defaults here.
    "pretrain": dict(optimizer="adamw", lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1, decay="linear",
                     lr_end=1e-5, warmup_epochs=1.0, grad_clip=1.0, label_smoothing=0.0, batch_size=512,
                     epochs=30, inception_crop=True, crop_scale=(0.05, 1.0), crop_sampler="tf"),
    # Paper B.1.1: SGD momentum 0.9, no weight decay, warm-up + cosine, clip 1, zero-initialised head,
    # batch 512; paper 500 warm-up / 10k steps (CIFAR) - scaled to small data here.
    "finetune": dict(optimizer="sgd", lr=0.01, momentum=0.9, weight_decay=0.0, decay="cosine",
                     warmup_steps=100, steps=1000, epochs=0, grad_clip=1.0, label_smoothing=0.0,
                     batch_size=128, zero_head=True, inception_crop=True, crop_scale=(0.05, 1.0), crop_sampler="tf"),
    # From scratch on small sets (DeiT / CCT style, small-data.md 2.3): AdamW, label smoothing 0.1,
    # warm-up + cosine, light crops + flips; stochastic depth / RandAugment / mixup via flags.
    "small-data": dict(optimizer="adamw", lr=1e-3, weight_decay=0.05, decay="cosine", warmup_epochs=1.0,
                       grad_clip=1.0, label_smoothing=0.1, batch_size=128, epochs=10,
                       inception_crop=True, crop_scale=(0.6, 1.0)),
}

# The model of both presets below: model_args of `create_model("custom", ...)`.
# Exact (erf) GELU: at this width the tanh form the paper's models use made a training step about 4 % slower
# (51.6 vs 49.7 ms, 64 images; docs/training.md, "Measured defaults").
FMNIST_HYBRID: dict[str, Any] = dict(conv_stem=[48, 96, 192], patch_size=1, classifier="gap", posemb="sincos2d",
                                     dim=64, depth=6, heads=4, mlp_dim=128, gelu="exact")

# Presets: a recipe plus data and model, for documented runs (docs/RESULTS.md, `vitlab demo`).
PRESETS: dict[str, dict[str, Any]] = {
    # A hybrid ViT (paper 3.1: CNN feature map -> patches -> Transformer) whose CNN is the conv stem of
    # Xiao et al. 2021 (three 3x3 stride-2 convolutions, 48/96/192 channels, GroupNorm + ReLU): 28 px ->
    # 4x4 = 16 tokens of width 64, 6 blocks, global average pooling, fixed 2-D sin-cos position
    # embeddings ("Better plain ViT baselines"). Against the earlier one-convolution stem with 7x7 patches
    # it is faster per step and 0.6 points better on the test set (docs/RESULTS.md). Batch 128 runs 1.2x
    # more images/s than 64 under torchrun x 2, paid in 26 epochs instead of 20; those alone overfit
    # (train 97 %, test 92.0 %), and a random shift of 1 pixel beside the flip and random erasing
    # (p 0.25) closed that gap: test 92.38 % and 92.73 % over two seeds in 13.5-14.5 min (docs/RESULTS.md).
    "fashion-mnist": dict(
        recipe="small-data", data="fashion-mnist",
        model="custom", model_args=FMNIST_HYBRID,
        epochs=26, batch_size=128, lr=2e-3, warmup_epochs=0.5, weight_decay=0.05, label_smoothing=0.1,
        inception_crop=False, hflip=True, random_erasing=0.25, random_shift=1, ckpt_every=200,
    ),
    "demo": dict(  # the fashion-mnist model on the bundled 4,500-image subset, about 30 s on 2 cores
        recipe="small-data", data="bundled",
        model="custom", model_args=FMNIST_HYBRID,
        epochs=10, batch_size=64, lr=2e-3, warmup_epochs=0.5, weight_decay=0.05, label_smoothing=0.1,
        inception_crop=True, crop_scale=(0.8, 1.0), hflip=True, ckpt_every=0,
    ),
}


def recipe_names() -> list[str]:
    return list(RECIPES) + list(PRESETS)


def recipe_overrides(name: str) -> dict[str, Any]:
    """The overrides of a recipe or preset (a preset expands to its recipe first)."""
    if name in RECIPES:
        return dict(RECIPES[name], recipe=name)
    if name in PRESETS:
        preset = dict(PRESETS[name])
        base = dict(RECIPES[preset["recipe"]])
        base.update(preset)
        base["recipe"] = name
        return base
    raise VitlabError(f"unknown recipe {name!r}; choose one of {', '.join(recipe_names())}")


_FIELDS = {f.name: f for f in fields(TrainConfig)}
_ALIASES = {"batch": "batch_size", "wd": "weight_decay", "sd": "drop_path", "stochastic_depth": "drop_path",
            "warmup": "warmup_steps", "clip": "grad_clip"}
# The declared types as objects (this module's annotations are strings): what every value is coerced to.
_TYPES = typing.get_type_hints(TrainConfig)
# Fields typed Any: `classes` passes through (the data package reads names or indices); the normalisation
# statistics are one number or one per channel.
_PER_CHANNEL = ("mean", "std")

def _coerce(name: str, value: Any, source: str) -> Any:
    """`value` as the declared type of field `name`; one line naming field, value and type when impossible."""
    if name in _PER_CHANNEL:
        try:
            return as_per_channel(value)
        except NotOfType:
            raise VitlabError(f"{name} must be a finite number or one per channel (e.g. 0.5 or [0.5,0.5,0.5]), "
                              f"got {shown(value)} ({source})") from None
    if name == "logger":  # "tensorboard,wandb" or a YAML list, kept as canonical text
        return parse_logger(value)
    if name == "classes":  # names or indices: the data package checks them against the data's classes
        return None if is_null(value) else value
    hint = _TYPES[name]
    try:
        return convert(hint, value)
    except NotOfType:
        raise VitlabError(f"{name} must be {describe(hint)}, got {shown(value)} ({source})") from None


def typed_overrides(overrides: dict[str, Any], source: str = "from the command line") -> dict[str, Any]:
    """{field: value of the field's type} for a dict of settings (aliases resolved); one-line errors for
    an unknown key or a value that is not of the field's type."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        name = _field_name(key, source)
        if name == "model_args":
            value = parse_kv(value) if isinstance(value, str) else value
            if value is not None and not isinstance(value, dict):
                raise VitlabError(f"model_args must be a mapping such as dim=64,depth=6, got {shown(value)} ({source})")
            out[name] = typed_model_args(dict(value or {}), source)
        else:
            out[name] = _coerce(name, value, source)
    return out


def _field_name(key: Any, source: str) -> str:
    """The TrainConfig field a key names (aliases and dashes allowed); one line naming near misses if none."""
    text = str(key).strip()
    name = _ALIASES.get(text.replace("-", "_"), text.replace("-", "_"))
    if name in _FIELDS:
        return name
    close = difflib.get_close_matches(name, list(_FIELDS) + list(_ALIASES), n=3)
    hint = f"did you mean {' or '.join(close)}?" if close else f"known: {', '.join(sorted(_FIELDS))}"
    raise VitlabError(f"unknown training setting {text!r} ({source}); {hint}")


def setting_name(key: Any, source: str) -> str:
    """The TrainConfig field a user's key names (aliases and dashes allowed), or a one-line error naming near misses."""
    return _field_name(key, source)


def recorded_values(data: dict[str, Any]) -> dict[str, Any]:
    """The fields of a recorded config.yaml, each as its declared type (so that 10 and 10.0, or a tuple and
    its YAML list, compare equal); keys that are no field, or values that no longer fit, are kept as written."""
    out = {}
    for key, value in data.items():
        if key not in _FIELDS:
            continue
        try:
            out[key] = typed_overrides({key: value}, source="in the run's config.yaml")[key]
        except VitlabError:
            out[key] = value
    return out


def apply_overrides(cfg: TrainConfig, overrides: dict[str, Any], source: str = "from the command line") -> TrainConfig:
    """Set fields from a dict, each value coerced to its field's type, with one-line errors naming an
    unknown key or a value of the wrong type.

    `model_args` merge into the ones already set (a preset's model stays, `dim=96` changes one value),
    unless the same layer names another `model`: then the earlier model's arguments are dropped.
    """
    named = typed_overrides(overrides, source)
    if "model" in named and named["model"] != cfg.model:
        cfg.model_args = {}
    for name, value in named.items():
        if name == "model_args":
            cfg.model_args = _merge(cfg.model_args, value)
        else:
            setattr(cfg, name, value)
    return cfg


def _merge(base: dict, extra: dict) -> dict:
    """Recursive dict update that leaves both inputs untouched (nested dicts such as `resnet` merge too)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise VitlabError(f"--config {p} is a folder; give its config.yaml (e.g. --config {p / 'config.yaml'})")
    if not p.is_file():
        raise VitlabError(f"no such config file: {p}; check the path")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise VitlabError(f"{p} is not valid YAML ({yaml_problem(exc)}); fix the file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise VitlabError(f"cannot read {p} as a text file ({type(exc).__name__}); give a YAML file of settings") from None
    if data is None:  # an empty (or all-comment) file is more likely a mistake than a wish for the defaults
        raise VitlabError(f"{p} holds no settings; write one per line, e.g. 'lr: 0.001', or drop --config")
    if not isinstance(data, dict):
        raise VitlabError(f"{p} must hold a mapping of training settings, e.g. 'lr: 0.001', "
                          f"not a {type(data).__name__}")
    return data


# Settings added after runs were recorded without them: a record that lacks one trained with the value here (the
# behaviour before the setting existed), which its resume keeps, whatever the recipe now says; a different value
# given for the resume is a change of the run (refused unless allowed, `resume.check_run_settings`).
ADDED_LATER: dict[str, Any] = {"crop_sampler": "torchvision", "products": "onednn"}


def lacked_by(recorded: dict[str, Any]) -> dict[str, Any]:
    """The ADDED_LATER settings a run's record lacks, with the values the run trained with ({} without a record)."""
    return {k: v for k, v in ADDED_LATER.items() if k not in recorded} if recorded else {}


def settings_of_older_runs(resume: str | Path) -> dict[str, Any]:
    """For `--resume RUN`: `lacked_by` RUN's record."""
    from vitlab.train.resume import recorded_config  # torch: only a resume reads a checkpoint's record

    return lacked_by(recorded_config(resume))


def resolve_config(recipe: str | None = None, yaml_path: str | Path | dict[str, Any] | None = None,
                   overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults < recipe (or preset) < YAML file < (on resume) ADDED_LATER settings the run's record lacks <
    explicit overrides; the result is what the run saves.
    `yaml_path` may also be the file's settings as a dict (a checkpoint's record of a run without config.yaml)."""
    if isinstance(yaml_path, dict):
        file_values, file_source = dict(yaml_path), "from the checkpoint's record of the run's settings"
    else:
        file_values, file_source = (load_yaml(yaml_path) if yaml_path else {}), f"from {yaml_path}"
    name = recipe or file_values.get("recipe") or "small-data"
    cfg = apply_overrides(TrainConfig(), recipe_overrides(str(name)), source=f"from recipe {name}")
    resume = (overrides or {}).get("resume")
    older = settings_of_older_runs(resume) if resume else {}  # below the command line: a value given there wins
    layers = ((file_values, file_source), (older, "as the resumed run trained"), (overrides or {}, "from the command line"))
    for values, source in layers:
        cfg = apply_overrides(cfg, values, source=source)
        epochs_win_over_earlier_steps(cfg, values, source)
    validate(cfg)
    return cfg


# (length in epochs, length in steps, the steps value that lets the epochs count)
_LENGTHS = (("epochs", "steps", 0), ("warmup_epochs", "warmup_steps", None))


def steps_given_up_for_epochs(values: dict[str, Any], source: str) -> dict[str, Any]:
    """{steps field: the value that lets the epochs count} for each length that the layer `values` gives in epochs
    and not in steps: such a layer overrides an earlier layer's steps."""
    named = {setting_name(key, source) for key in values}
    return {steps: counts_epochs for epochs, steps, counts_epochs in _LENGTHS if epochs in named and steps not in named}


def epochs_win_over_earlier_steps(cfg: TrainConfig, values: dict[str, Any], source: str) -> None:
    """A layer that gives a length in epochs and not in steps overrides an earlier layer's steps. Steps take
    precedence within one layer, so without this the finetune recipe's 1000 steps silently outlived
    `--epochs 1` (and its 100 warm-up steps a `--warmup-epochs`)."""
    for steps, value in steps_given_up_for_epochs(values, source).items():
        setattr(cfg, steps, value)


def validate(cfg: TrainConfig) -> None:
    """Coerce every field to its declared type and refuse impossible settings, before any work is done
    (nothing is created yet: a bad value must not leave an empty run folder behind)."""
    for name in _FIELDS:
        if name != "model_args":
            setattr(cfg, name, _coerce(name, getattr(cfg, name), "in the training config"))
    _check_choices(cfg)
    _check_schedule(cfg)
    _check_rates(cfg)
    _check_budget(cfg)


def _refuse(name: str, value: Any, rule: str) -> None:
    shown = f"{value:g}" if isinstance(value, float) else value  # epochs -1, not -1.0 (the field is a float)
    raise VitlabError(f"{name} must be {rule}, got {shown}")


def _at_least(cfg: TrainConfig, name: str, low: float, rule: str | None = None) -> None:
    value = getattr(cfg, name)
    if value is not None and value < low:
        _refuse(name, value, rule or f">= {low:g}")


def _in_range(cfg: TrainConfig, name: str, low: float, high: float, high_included: bool = False) -> None:
    value = getattr(cfg, name)
    if value is None:
        return
    inside = low <= value <= high if high_included else low <= value < high
    if not inside:
        _refuse(name, value, f"in [{low:g}, {high:g}{']' if high_included else ')'}")


def _check_choices(cfg: TrainConfig) -> None:
    if cfg.optimizer not in ("adamw", "adam", "sgd"):
        raise VitlabError(f"optimizer must be adamw, adam or sgd, got {cfg.optimizer!r}")
    if cfg.decay not in ("cosine", "linear", "constant"):
        raise VitlabError(f"decay must be cosine, linear or constant, got {cfg.decay!r}")
    from vitlab.data.transforms import CROP_SAMPLERS  # here, not at the top: the CLI's --help stays light

    if cfg.crop_sampler not in CROP_SAMPLERS:
        raise VitlabError(f"crop_sampler must be {' or '.join(CROP_SAMPLERS)}, got {cfg.crop_sampler!r}")
    if cfg.batchnorm not in ("train", "frozen", "sync"):
        raise VitlabError(f"batchnorm must be train, frozen or sync, got {cfg.batchnorm!r}")
    if cfg.precision not in ("auto", "bf16", "fp16", "fp32", "bf16-stem"):
        raise VitlabError(f"precision must be auto, bf16, fp16, fp32 or bf16-stem, got {cfg.precision!r}")
    if cfg.products not in ("auto", "onednn", "torch"):
        raise VitlabError(f"products must be auto, onednn or torch, got {cfg.products!r}")


def _check_schedule(cfg: TrainConfig) -> None:
    """Length, batch and learning-rate settings."""
    _at_least(cfg, "steps", 0, ">= 0 (0: train for --epochs)")
    _at_least(cfg, "epochs", 0)
    if cfg.steps == 0 and cfg.epochs == 0:
        raise VitlabError("set epochs > 0 or steps > 0 (e.g. --epochs 10)")
    for name in ("batch_size", "micro_batch", "eval_batch_size"):
        _at_least(cfg, name, 1)
    if cfg.lr <= 0:
        _refuse("lr", cfg.lr, "> 0 (e.g. 0.001)")
    for name in ("lr_end", "weight_decay", "warmup_steps", "warmup_epochs", "grad_clip"):
        _at_least(cfg, name, 0)
    _in_range(cfg, "momentum", 0, 1)
    if not all(0 <= beta < 1 for beta in cfg.betas):
        _refuse("betas", list(cfg.betas), "two numbers in [0, 1), e.g. 0.9,0.999")


def _check_rates(cfg: TrainConfig) -> None:
    """Regularisation and augmentation strengths."""
    for name in ("label_smoothing", "dropout", "drop_path"):  # 1 would drop everything / erase the labels
        _in_range(cfg, name, 0, 1)
    _in_range(cfg, "random_erasing", 0, 1, high_included=True)  # a probability per image
    _in_range(cfg, "val_fraction", 0, 1)
    _in_range(cfg, "test_fraction", 0, 1)
    for name in ("mixup", "cutmix"):  # Beta(alpha, alpha) parameters, not probabilities
        _at_least(cfg, name, 0, ">= 0 (a Beta alpha; 0: off)")
    _at_least(cfg, "random_shift", 0)
    low, high = cfg.crop_scale
    if not 0 < low <= high <= 1:
        _refuse("crop_scale", list(cfg.crop_scale), "two area fractions 0 < min <= max <= 1, e.g. 0.6,1.0")
    if cfg.randaugment is not None:
        n, m = cfg.randaugment
        if not (n >= 1 and 0 <= m <= 30):
            _refuse("randaugment", list(cfg.randaugment), "N,M with N >= 1 ops and magnitude 0 <= M <= 30, e.g. 2,9")
    std = cfg.std if isinstance(cfg.std, list) else [cfg.std]
    if any(s <= 0 for s in std):
        _refuse("std", cfg.std, "> 0 (it divides the pixels; e.g. 0.5)")


def _check_budget(cfg: TrainConfig) -> None:
    """Sizes, counts and intervals of the run."""
    for name in ("per_class", "image_size", "threads", "keep_last", "log_every", "eval_every"):
        _at_least(cfg, name, 1)
    for name in ("seed", "ckpt_every"):
        _at_least(cfg, name, 0)
    if cfg.seed > 2**32 - 1:  # the samplers' seeds are 32 bits (the same bound as the commands' --seed)
        _refuse("seed", cfg.seed, f"from 0 to {2**32 - 1}")
    if cfg.dist_timeout <= 0:
        _refuse("dist_timeout", cfg.dist_timeout, "> 0 seconds (e.g. 600)")


def save_yaml(cfg: TrainConfig, path: str | Path) -> None:
    """Written whole or not at all (temporary file, then rename): a resume with an allowed change rewrites the
    run's config.yaml, and half a file (a full disk, a kill) stopped every later --resume on invalid YAML."""
    # imported here: checkpoint.py imports torch, which `vitlab --help` and the config checks do without
    from vitlab.train.checkpoint import atomic_write_text

    atomic_write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), path)
