"""`vitlab train`: train from scratch / pre-train with a named recipe; every value overridable.

Precedence: recipe defaults < `--config FILE.yaml` < flags < `--set key=value`. The resolved config
is saved as RUN/config.yaml. Under `torchrun --nproc-per-node N -m vitlab train ...` it runs DDP.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# flag -> (TrainConfig field, type, help)
_FLAGS: list[tuple[str, str, object, str]] = [
    ("--data", "data", str, "data source: fashion-mnist, mnist, cifar10:PATH, cifar100:PATH, digits, bundled, a "
                            "folder, a CSV, tar shards, hf:PATH (docs/data.md; default: the recipe's, else bundled)"),
    ("--classes", "classes", str, "class subset, names or indices, comma-separated"),
    ("--per-class", "per_class", int, "keep N training images per class"),
    ("--val-fraction", "val_fraction", float, "share of the training images held out for validation when the data "
                                              "has no val split (default 0.1)"),
    ("--test-fraction", "test_fraction", float, "share of the images held out for testing when the data has no "
                                                "test split (default 0.1)"),
    ("--data-seed", "data_seed", int, "seed of the train / val / test split (default: --seed)"),
    ("--model", "model", str, "registry name (vit-ti/16, vit-s/16, resnet-50, custom, ...)"),
    ("--model-args", "model_args", str, "model overrides, e.g. dim=64,depth=6,heads=4,mlp_dim=128,patch_size=4"),
    ("--image-size", "image_size", int, "training resolution (default: the data's / the checkpoint's)"),
    ("--epochs", "epochs", float, "epochs (ignored when --steps is given too; replaces the steps of a recipe or "
                                  "--config, e.g. the finetune recipe's 1000)"),
    ("--steps", "steps", int, "optimizer steps (overrides --epochs; 0: train for --epochs)"),
    ("--batch-size", "batch_size", int, "global batch size (all processes, after accumulation)"),
    ("--micro-batch", "micro_batch", int, "per-process batch of one forward pass; the rest is gradient accumulation"),
    ("--optimizer", "optimizer", str, "adamw | adam | sgd"),
    ("--lr", "lr", float, "base learning rate"),
    ("--weight-decay", "weight_decay", float, "weight decay of the weight matrices only: decoupled (x lr) with adamw, L2 with sgd, none with adam"),
    ("--momentum", "momentum", float, "SGD momentum"),
    ("--warmup-steps", "warmup_steps", int, "linear warm-up steps"),
    ("--warmup-epochs", "warmup_epochs", float, "linear warm-up in epochs (ignored when --warmup-steps is given "
                                                "too; replaces the warm-up steps of a recipe or --config)"),
    ("--decay", "decay", str, "cosine | linear | constant"),
    ("--lr-end", "lr_end", float, "final lr of the linear decay"),
    ("--grad-clip", "grad_clip", float, "clip gradients at this global norm (0: off)"),
    ("--label-smoothing", "label_smoothing", float, "label smoothing"),
    ("--head-bias-init", "head_bias_init", float, "initial head bias (paper i21k: -10)"),
    ("--drop-path", "drop_path", float, "stochastic depth rate"),
    ("--dropout", "dropout", float, "dropout rate"),
    ("--randaugment", "randaugment", str, "RandAugment N,M, e.g. 2,9"),
    ("--mixup", "mixup", float, "mixup alpha (0: off)"),
    ("--cutmix", "cutmix", float, "cutmix alpha (0: off)"),
    ("--random-erasing", "random_erasing", float, "random erasing probability"),
    ("--random-shift", "random_shift", int, "random translation by up to N pixels (pad + crop)"),
    ("--crop-scale", "crop_scale", str, "inception-crop area range, e.g. 0.6,1.0"),
    ("--precision", "precision", str, "auto | bf16 | fp16 | fp32 | bf16-stem (autocast; fp16 uses loss scaling; bf16-stem: "
                                          "conv stem in bf16, Transformer in fp32)"),
    ("--products", "products", str, "auto | onednn | torch: the route of CPU fp32 training's matrix products (auto: "
                                    "timed once per machine and model, recorded in the run; see docs/training.md)"),
    ("--batchnorm", "batchnorm", str, "BatchNorm models: train (update statistics, the default) | frozen (keep the "
                                      "pretrained statistics: small fine-tuning batches) | sync (SyncBatchNorm, CUDA DDP)"),
    ("--device", "device", str, "auto | cpu | cuda | cuda:N"),
    ("--threads", "threads", int, "CPU threads for torch (default: automatic)"),
    ("--eval-batch-size", "eval_batch_size", int, "batch size for validation and test"),
    ("--dist-timeout", "dist_timeout", float, "torchrun: seconds a collective waits for the other processes before "
                                              "the run stops with one line (default 600 = 10 min)"),
    ("--out", "out_dir", str, "folder for run folders (default runs/)"),
    ("--name", "name", str, "run folder name (default: recipe-data-time)"),
    ("--seed", "seed", int, "seed of everything"),
    ("--ckpt-every", "ckpt_every", int, "optimizer steps between mid-epoch checkpoints (0: epoch ends only)"),
    ("--keep-last", "keep_last", int, "step checkpoints to keep (best.pt is kept apart)"),
    ("--log-every", "log_every", int, "steps between metrics.jsonl step records"),
    ("--eval-every", "eval_every", int, "epochs between validations"),
    ("--logger", "logger", str, "run trackers beside metrics.jsonl: none (default) | tensorboard (RUN/tensorboard/) | "
                                "wandb (respects WANDB_MODE=offline) | a comma list, e.g. tensorboard,wandb"),
]
_SWITCHES = [
    ("--deterministic", "deterministic", "deterministic algorithms (bit-identical reruns and resumes)"),
    ("--grad-checkpointing", "grad_checkpointing", "activation checkpointing: recompute blocks in backward to save memory"),
    ("--compile", "compile", "torch.compile the model"),
    ("--fsdp", "fsdp", "shard the model over processes (FSDP) instead of replicating it (DDP)"),
    ("--no-hflip", "hflip", "no horizontal flips"),
    ("--no-inception-crop", "inception_crop", "plain resize instead of the inception crop"),
]


def add_train_arguments(p: argparse.ArgumentParser, default_recipe: str) -> None:
    from vitlab.train.config import recipe_names

    p.add_argument("--recipe", default=None,
                   help=f"named recipe or preset: {', '.join(recipe_names())} (default {default_recipe})")
    p.add_argument("--config", default=None, metavar="YAML", help="YAML file of settings (a run's config.yaml works)")
    for flag, dest, typ, help_ in _FLAGS:
        p.add_argument(flag, dest=f"cfg_{dest}", type=typ, default=None, help=help_, metavar=dest.upper())
    for flag, dest, help_ in _SWITCHES:
        p.add_argument(flag, dest=f"sw_{dest}", action="store_true", help=help_)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="any TrainConfig field, e.g. --set betas=0.9,0.95 (repeatable)")
    p.add_argument("--resume", default=None, metavar="RUN", help="continue a run folder (or checkpoint file) exactly")
    p.add_argument("--allow-change", dest="allow_change", action="append", default=[], metavar="SETTING",
                   help="with --resume: accept a setting (any config field, e.g. batch_size, or threads, precision, "
                        "world_size) that differs from the run's record; config.yaml records the change (it then "
                        "no longer matches an uninterrupted run; repeatable or comma-separated)")
    p.add_argument("--force-unlock", dest="force_unlock", action="store_true",
                   help="take over the run folder's lock held by a process on another machine (only when no run "
                        "is going on there)")
    p.add_argument("--quiet", action="store_true", help="no progress bar: one line per epoch (for logs)")


def overrides_from_args(args: argparse.Namespace) -> dict:
    from vitlab.train.config import steps_given_up_for_epochs

    out = {}
    for _, dest, _, _ in _FLAGS:
        v = getattr(args, f"cfg_{dest}")
        if v is not None:
            out[dest] = v
    for flag, dest, _ in _SWITCHES:
        if getattr(args, f"sw_{dest}"):
            out[dest] = not flag.startswith("--no-")
    sets = {}
    for item in args.sets:
        if "=" not in item:
            from vitlab.errors import VitlabError

            raise VitlabError(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        sets[k.strip()] = v
    # --set is the later layer (docs/training.md): its length in epochs beats a flag's in steps (`--steps 3
    # --set epochs=2` trains 2 epochs), as between resolve_config's layers
    for steps, value in steps_given_up_for_epochs(sets, "from --set").items():
        if steps in out:
            out[steps] = value
    out.update(sets)
    if args.quiet:
        out["quiet"] = True
    return out


def config_from_args(args: argparse.Namespace, default_recipe: str, extra: dict | None = None):
    """Resolve the run's TrainConfig; `--resume RUN` starts from RUN/config.yaml (without one: from the settings
    its checkpoint recorded)."""
    from vitlab.train.config import resolve_config

    overrides = dict(extra or {})
    overrides.update(overrides_from_args(args))
    yaml_path = args.config
    if args.resume:
        from vitlab.train.resume import checkpoint_config, run_folder_of

        folder = run_folder_of(args.resume)
        if yaml_path is None and (folder / "config.yaml").is_file():
            yaml_path = folder / "config.yaml"
        elif yaml_path is None:  # config.yaml lost: the checkpoint records the same settings (else: the defaults)
            yaml_path = checkpoint_config(args.resume) or None
        overrides["resume"] = str(args.resume)
    recipe = args.recipe or (None if yaml_path else default_recipe)
    cfg = resolve_config(recipe, yaml_path, overrides)
    if args.resume and args.recipe and cfg.recipe != args.recipe:
        refuse_recipe_on_resume(args, cfg.recipe)
    return cfg


def refuse_recipe_on_resume(args: argparse.Namespace, recorded: str) -> None:
    """--recipe on a resume was silently dropped: the run's config.yaml outranks a recipe, so the run went on with
    its recorded settings whatever recipe was named."""
    from vitlab.errors import VitlabError

    raise VitlabError(f"cannot resume {args.resume} with --recipe {args.recipe}: the run continues with its recorded "
                      f"settings (recipe {recorded}); drop --recipe, and change single settings with their flags and "
                      "--allow-change")


def allowed_changes(args: argparse.Namespace) -> tuple[str, ...]:
    """`--allow-change threads,batch` -> ("threads", "batch_size"): config field names (aliases allowed) or
    world_size; an unknown name is refused with the near misses."""
    from vitlab.train.config import setting_name

    names = [n.strip().replace("-", "_") for item in args.allow_change for n in item.split(",") if n.strip()]
    return tuple(name if name == "world_size" else setting_name(name, f"--allow-change {name}") for name in names)


def print_summary(result, quiet: bool = False) -> None:
    tm = result.test_metrics
    lines = []
    if tm:
        lo, hi = tm["accuracy_ci95"]
        precision = getattr(result.config, "precision", "fp32")
        how = "" if precision == "fp32" else (f", computed in {precision} as the run trained (`vitlab evaluate "
                                              "RUN` computes in fp32 and can differ slightly)")
        lines.append(f"accuracy {tm['accuracy']:.4f} (95% CI {lo:.4f}-{hi:.4f}), macro-F1 {tm['macro_f1']:.4f} "
                     f"on {tm['n']} held-out images{how}")
    else:  # said, not left out: the run ended with no score at all
        lines.append("no accuracy: the data has no validation or test split to score (none given, and too few images per "
                     "class to carve one); add images, or give val/ and test/ folders beside train/")
    lines.append(f"wall time {result.wall_time_s:.0f} s, {result.images_per_s:.0f} training images/s")
    # the files this run wrote (no held-out split: no confusion matrix)
    names = ("summary.json", "metrics.jsonl", "loss.png", "accuracy.png", "confusion_matrix.png", "model")
    written = [n + ("/" if n == "model" else "") for n in names if (Path(result.run_dir) / n).exists()]
    lines.append(f"run folder: {result.run_dir}  ({', '.join(written)})")
    if "tensorboard" in str(getattr(result.config, "logger", "")):
        lines.append(f"watch it: tensorboard --logdir {result.run_dir / 'tensorboard'}")
    for line in lines:
        print(f"vitlab: {line}", file=sys.stdout)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train from scratch / pre-train with a named recipe (pretrain, small-data, ...)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(p, "small-data")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, "small-data")
    if cfg.weights:
        from vitlab.errors import VitlabError

        if args.resume:  # a fine-tuning run, resumed with the wrong command
            raise VitlabError(f"{args.resume} is a fine-tuning run; resume it with `vitlab finetune --resume "
                              f"{args.resume}`")
        raise VitlabError("`vitlab train` starts from scratch; use `vitlab finetune --weights W` to start from weights")
    return report(train_or_exit(args, cfg))


def report(result) -> int:
    """The run's summary (the first process), then, under torchrun, the end of this process at once (exit status
    0). The run has passed its last collective and torn its process group down, and its files are written and
    closed; what is left would be freed by the interpreter's finalization, where gloo's teardown aborted one
    process of an FSDP run once ("terminate called without an active exception", 1 run in many), failing a
    torchrun whose run had finished. As after a peer's failure (train_or_exit), the process ends without it."""
    import os

    if _is_main():
        print_summary(result)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _end_process(0)
    return 0


def train_or_exit(args: argparse.Namespace, cfg):
    """`train(cfg)`; when another torchrun process stopped answering, print the one line and end this process
    at once: freeing the failed collective's objects would wait for the missing process forever."""
    from vitlab.cli import one_line
    from vitlab.train import train
    from vitlab.train.distributed import PeerFailure

    try:
        return train(cfg, allow_change=allowed_changes(args), force_unlock=args.force_unlock)
    except PeerFailure as exc:
        print(f"vitlab {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        _end_process(2)


def _end_process(code: int) -> None:
    """End this process at once with `code`, its output flushed, without the interpreter's finalization."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _is_main() -> bool:
    import os

    return int(os.environ.get("RANK", "0")) == 0
