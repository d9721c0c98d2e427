"""`vitlab study transfer`: the seeds' zero-shot vs fine-tuned study, reproduced end to end on real images
(pre-train on some classes, transfer to others); `vitlab study scaling`: test accuracy against training-set
size, every model from scratch on nested subsets (paper Fig. 3/4). Tables, a figure and run folders; resumable."""

from __future__ import annotations

import argparse
import re

from vitlab.commands._argtypes import (
    THREADS_HELP,
    fraction,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    seed_value,
)

STUDY_THREADS_HELP = THREADS_HELP + "; decided once for all the study's runs and recorded; a rerun uses the recorded count"
STUDY_DEVICE_HELP = ("every run's device: auto (the GPU where there is one, else the CPU), cpu, cuda, cuda:1 "
                     "(default auto); recorded, a rerun must give the same")


def _names(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _model_list(text: str) -> list[str]:
    from vitlab.values import split_outside_brackets

    return [s.strip() for s in split_outside_brackets(text) if s.strip()]


def _ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in _names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    return values


def _check_positive(flag: str, values: list[int]) -> None:
    """Sizes and images per class; checked here because the studies create their folder first."""
    if not values or min(values) < 1:
        from vitlab.errors import VitlabError

        raise VitlabError(f"{flag} must be positive whole numbers, got {','.join(map(str, values))}")


def _check_training(what: str, recipe: str, overrides: dict, flags: dict[str, str]) -> None:
    """Resolve a TrainConfig with the study's training values, so that an impossible one fails now,
    with one line, before the study folder exists (the studies create it first). `flags`: the study's flag for
    each TrainConfig field it sets, which the line names instead of the field (`in_study_flags`)."""
    from vitlab.errors import VitlabError
    from vitlab.train.config import resolve_config

    try:
        resolve_config(recipe, overrides=overrides)
    except VitlabError as exc:
        raise VitlabError(f"{what}: {in_study_flags(str(exc), flags)}") from None


def in_study_flags(text: str, flags: dict[str, str]) -> str:
    """A training-config message with each field the study sets named by the study's own flag: the config's
    checks speak of `vitlab train` ("set epochs > 0 or steps > 0 (e.g. --epochs 10)"), and a study has no
    --epochs. Both spellings are replaced, the field (`batch_size`) and train's flag (`--batch-size`)."""
    for field, flag in flags.items():
        for word in (f"--{field.replace('_', '-')}", field):
            text = re.sub(rf"(?<![\w-]){re.escape(word)}(?![\w-])", flag, text)
    return text


# The TrainConfig field each study flag sets, for in_study_flags.
PRETRAIN_FLAGS = {"epochs": "--pretrain-epochs", "lr": "--pretrain-lr", "seed": "--seed"}
FINETUNE_FLAGS = {"epochs": "--finetune-epochs", "steps": "--finetune-min-steps", "lr": "--finetune-lr"}
SCALING_FLAGS = {"epochs": "--min-epochs", "steps": "--min-steps", "batch_size": "--batch-size", "lr": "--lr",
                 "val_fraction": "--val-fraction", "seed": "--seed"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("study", help="multi-run studies: transfer (pre-train, then zero-shot vs fine-tuned), "
                                         "scaling (accuracy vs training-set size)")
    studies = p.add_subparsers(dest="study", metavar="STUDY", required=True)
    t = studies.add_parser(
        "transfer", help="pre-train ViT / hybrid / ResNet on some classes, transfer to others",
        description="Pre-train every model from scratch on the upstream classes with one budget, then for each "
                    "downstream size evaluate frozen features (kNN, few-shot ridge: no training), fine-tune, "
                    "evaluate again on the same downstream test set. Writes study.md/.csv/.json, study.png, "
                    "one compare folder per size and the pre-training runs. Run the same command again to "
                    "resume; finished parts are not redone.",
    )
    from vitlab.experiments.transfer import FMNIST_FOOTWEAR, FMNIST_UPSTREAM, TransferSettings

    d = TransferSettings()
    t.add_argument("--data", default=d.data, help="data source with both class sets (default fashion-mnist)")
    t.add_argument("--upstream", type=_names, default=FMNIST_UPSTREAM,
                   help="pre-training classes (default: Fashion-MNIST's seven non-footwear classes)")
    t.add_argument("--downstream", type=_names, default=FMNIST_FOOTWEAR,
                   help="transfer classes (default: Sandal,Sneaker,Ankle boot)")
    t.add_argument("--models", type=_model_list, default=d.models,
                   help="vit, hybrid, resnet (the study's ~0.4 M-parameter families) or registry specs "
                        "such as 'resnet-26-small(base_width=16)' (default vit,hybrid,resnet)")
    t.add_argument("--per-class", type=_ints, default=d.per_class, help="downstream sizes (default 10,100,1000)")
    t.add_argument("--pretrain-epochs", type=positive_float, default=d.pretrain_epochs,
                   help="pre-training epochs on the upstream classes, the same for every model")
    t.add_argument("--pretrain-lr", type=positive_float, default=d.pretrain_lr, help="pre-training AdamW peak learning rate")
    t.add_argument("--finetune-lr", type=positive_float, default=d.finetune_lr, help="fine-tuning AdamW peak learning rate")
    t.add_argument("--finetune-epochs", type=non_negative_float, default=d.finetune_epochs,
                   help="fine-tuning epochs on each downstream size (at least --finetune-min-steps steps)")
    t.add_argument("--finetune-min-steps", type=non_negative_int, default=d.finetune_min_steps,
                   help="fine-tuning steps at the least, where --finetune-epochs of a small size are fewer")
    t.add_argument("--seed", type=seed_value, default=0, help="seed of the splits, the subsets and every run")
    t.add_argument("--threads", type=positive_int, help=STUDY_THREADS_HELP)
    t.add_argument("--device", default="auto", help=STUDY_DEVICE_HELP)
    t.add_argument("--out", default="study-transfer", help="study folder (default study-transfer)")
    t.add_argument("--quiet", action="store_true", help="no progress bars, one line per epoch")
    t.set_defaults(func=run_transfer)
    _register_scaling(studies)


def run_transfer(args: argparse.Namespace) -> int:
    from vitlab.experiments.transfer import TransferSettings, run_transfer_study

    _check_positive("--per-class", args.per_class)
    _check_training("pre-training", "small-data",
                    dict(epochs=args.pretrain_epochs, lr=args.pretrain_lr, seed=args.seed), PRETRAIN_FLAGS)
    _check_training("fine-tuning", "finetune",
                    dict(epochs=args.finetune_epochs, steps=args.finetune_min_steps, lr=args.finetune_lr),
                    FINETUNE_FLAGS)
    st = TransferSettings(
        data=args.data, upstream_classes=args.upstream, downstream_classes=args.downstream, models=args.models,
        per_class=args.per_class, pretrain_epochs=args.pretrain_epochs, pretrain_lr=args.pretrain_lr,
        finetune_lr=args.finetune_lr, finetune_epochs=args.finetune_epochs,
        finetune_min_steps=args.finetune_min_steps, seed=args.seed, quiet=args.quiet, threads=args.threads,
        device=args.device,
    )
    from vitlab.train.resume import resume_advice

    with resume_advice("the same `vitlab study transfer` command (finished runs are kept)"):
        run_transfer_study(st, args.out)
    print((f"{args.out}/study.md").replace("//", "/"))
    print(open(f"{args.out}/study.md").read())
    return 0


def _register_scaling(studies: argparse._SubParsersAction) -> None:
    from vitlab.experiments.scaling import ScalingSettings

    d = ScalingSettings()
    s = studies.add_parser(
        "scaling", help="train ViT / hybrid / ResNet from scratch on nested subsets; accuracy vs data size",
        description="Carve a fixed validation split out of the training data, then train every model from "
                    "scratch on nested, class-stratified subsets of the rest with one budget rule "
                    "(steps = max(--min-steps, --min-epochs x size / batch)), keep the best-validation "
                    "checkpoint and evaluate it on the full test set. Writes study.md/.csv/.json, study.png "
                    "and one run folder per model, size and seed under OUT/runs/. Run the same command "
                    "again to resume; finished runs are not redone.",
    )
    s.add_argument("--data", default=d.data, help="data source with a test split (default fashion-mnist)")
    s.add_argument("--models", type=_model_list, default=d.models,
                   help="vit, hybrid, resnet26 (ResNet-26 at base width 8, the default ResNet), resnet "
                        "(transfer's ResNet-50) or registry specs such as 'resnet-18-small(base_width=16)' "
                        "(default vit,hybrid,resnet26)")
    s.add_argument("--sizes", type=_ints, default=d.sizes,
                   help="training-set sizes; one above the images left after the validation split means "
                        "all of them (default 1000,3000,10000,30000,60000)")
    s.add_argument("--seeds", type=positive_int, default=d.seeds, help="seeds at the small sizes (default 3)")
    s.add_argument("--multi-seed-max", type=non_negative_int, default=d.multi_seed_max,
                   help="sizes up to this get --seeds seeds, larger ones one (default 10000)")
    s.add_argument("--min-epochs", type=non_negative_float, default=d.min_epochs,
                   help="budget: at least this many epochs (default 5)")
    s.add_argument("--min-steps", type=positive_int, default=d.min_steps,
                   help="budget: at least this many optimizer steps (default 500)")
    s.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="default 128")
    s.add_argument("--lr", type=positive_float, default=d.lr, help="AdamW peak learning rate (default 2e-3)")
    s.add_argument("--val-fraction", type=fraction, default=d.val_fraction,
                   help="validation split carved out of the training data first (default 0.1)")
    s.add_argument("--evals", type=positive_int, default=d.evals, help="validation passes per run, about (default 8)")
    s.add_argument("--seed", type=seed_value, default=d.seed, help="validation split seed and first run seed (default 0)")
    s.add_argument("--threads", type=positive_int, help=STUDY_THREADS_HELP)
    s.add_argument("--device", default="auto", help=STUDY_DEVICE_HELP)
    s.add_argument("--out", default="study-scaling", help="study folder (default study-scaling)")
    s.add_argument("--quiet", action="store_true",
                   help="one line per run only; the training's own lines go to each run's train.log")
    s.set_defaults(func=run_scaling)


def run_scaling(args: argparse.Namespace) -> int:
    from vitlab.experiments.scaling import ScalingSettings, run_scaling_study

    _check_positive("--sizes", args.sizes)
    _check_training("training", "small-data",
                    dict(epochs=args.min_epochs, steps=args.min_steps, batch_size=args.batch_size, lr=args.lr,
                         val_fraction=args.val_fraction, seed=args.seed), SCALING_FLAGS)
    if args.val_fraction <= 0:  # the study selects checkpoints on the validation split: it needs one
        from vitlab.errors import VitlabError

        raise VitlabError(f"--val-fraction must be between 0 and 1, got {args.val_fraction}")
    st = ScalingSettings(
        data=args.data, models=args.models, sizes=args.sizes, seeds=args.seeds, multi_seed_max=args.multi_seed_max,
        min_epochs=args.min_epochs, min_steps=args.min_steps, batch_size=args.batch_size, lr=args.lr,
        val_fraction=args.val_fraction, evals=args.evals, seed=args.seed, quiet=args.quiet, threads=args.threads,
        device=args.device,
    )
    from vitlab.train.resume import resume_advice

    with resume_advice("the same `vitlab study scaling` command (finished runs are kept, an interrupted "
                       "one goes on from its checkpoint)"):
        run_scaling_study(st, args.out)
    print((f"{args.out}/study.md").replace("//", "/"))
    print(open(f"{args.out}/study.md").read())
    return 0
