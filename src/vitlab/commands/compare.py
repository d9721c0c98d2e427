"""`vitlab compare --data D --models vit-b/16,resnet-50,resnet-152`: zero-shot, fine-tune, evaluate each
model with one identical budget; a Markdown + CSV table, per-epoch validation curves, runtimes."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from vitlab.commands._argtypes import non_negative_float, non_negative_int, positive_float, positive_int
from vitlab.commands.evaluate import (
    add_data_args,
    add_frozen_args,
    add_runtime_args,
    frozen_options,
    load_splits,
)
from vitlab.errors import VitlabError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare", help="zero-shot vs fine-tuned comparison of several models (table, curves, runtimes)",
        description="For each model: zero-shot evaluation on the test split, fine-tuning on the training "
                    "split with the same settings for all, final evaluation. A model is a registry name "
                    "(trained from scratch; overrides as custom(dim=32,depth=1,heads=2)), a weights file/folder, "
                    "or a vitlab run folder; --weights gives pretrained weights per model. 'Zero-shot' is real "
                    "transfer only through a class map (--zero-shot-map, or the model's own class names): without "
                    "one a pretrained model gets a new random head and its row says 'fresh head, chance'; "
                    "--fewshot, --knn and --probe add frozen-feature rows (no backbone training) "
                    "(docs/evaluation.md).",
    )
    add_data_args(p, required=True)
    p.add_argument("--models", required=True, help="comma-separated, e.g. vit-b/16,resnet-50,resnet-152")
    p.add_argument("--weights", help="one per model, comma-separated; '-' or 'none' = from scratch (e.g. --weights=vit.npz,-,- or --weights vit.npz,none,none)")
    p.add_argument("--epochs", type=positive_float, default=3, help="fine-tuning epochs (default 3)")
    p.add_argument("--lr", type=positive_float, default=1e-5, help="learning rate (default 1e-5)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="batch size (default 16)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"], help="default adamw")
    p.add_argument("--weight-decay", type=non_negative_float, default=0.0, help="decoupled weight decay (default 0)")
    p.add_argument("--decay", default="constant", choices=["constant", "cosine", "linear"],
                   help="learning-rate schedule (default constant)")
    p.add_argument("--warmup-steps", type=non_negative_int, default=0, help="linear learning-rate warm-up steps")
    p.add_argument("--grad-clip", type=non_negative_float, default=None, help="global-norm clipping (default off)")
    p.add_argument("--augment", action="store_true", help="random crops + flips while fine-tuning (default: none)")
    p.add_argument("--image-size", type=positive_int,
                   help="model input size (default: a pretrained model's own, a from-scratch model's = the data's)")
    p.add_argument("--zero-shot-map", metavar="MAP",
                   help="class map to the pretrained head: inline 'Sandal=774,Sneaker=770+630,Ankle boot=514', "
                        "a file (JSON {\"Sandal\": [774], ...} or 'Sandal = 774' lines; head label names allowed "
                        "when the model stores them), or a bundled map: fashion-mnist-footwear-in1k, "
                        "fashion-mnist-footwear-in21k (BiT-M)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other training setting (TrainConfig field), repeatable, e.g. --set label_smoothing=0.1; "
                        "not the data, seed, threads, image size or folders (compare's own flags set those)")
    p.add_argument("--batchnorm", choices=["train", "frozen", "sync"],
                   help="BatchNorm models (resnet-50, ...) while fine-tuning: train (update the statistics, as the "
                        "seed studies did; default) or frozen (keep the pretrained statistics: small batches)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="fine-tuning precision (auto: bf16 on GPUs that have it, else fp16; on a CPU bf16 only where "
                        "measured faster than fp32)")
    add_runtime_args(p)  # --device, --threads (decided once: every evaluation and fine-tuning run uses it)
    p.add_argument("--eval-batch-size", type=positive_int, default=64, help="batch size of the evaluations")
    p.add_argument("--out", help="output folder (default compare-<data>-<UTC time>); an existing one is resumed: "
                                 "models finished there with the same settings are reused, the rest redone")
    p.add_argument("--resume", metavar="OUT", help="resume the study in OUT (the same as --out OUT, but OUT must exist)")
    p.add_argument("--quiet", action="store_true", help="no progress bars, one line per epoch")
    add_frozen_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from vitlab.experiments.compare import (
        check_model_specs,
        check_study,
        parse_models,
        recorded_threads,
        run_compare,
    )
    from vitlab.runtime import setup_runtime
    from vitlab.train.resume import resume_advice

    models = parse_models(args.models, args.weights)
    # before the data loads (run_compare checks again at the data's size, and for callers of the API)
    check_model_specs(models, args.image_size)
    settings = _settings(args)
    out = _out_dir(args)
    # one thread count for the whole study, evaluations and every fine-tuning run: --threads, else the count
    # the study recorded when it started (a resume), else decided now; recorded in the settings
    recorded = None if args.threads else recorded_threads(out, models)
    runtime = setup_runtime(args.device, args.threads or recorded)
    if recorded:
        runtime = dataclasses.replace(runtime, threads_reason=f"recorded by the study in {out}")
    settings = dataclasses.replace(settings, threads=runtime.threads)
    data = load_splits(args, storage={"model_side": args.image_size})  # --image-size 384: photos stored at 384
    check_study(data, models, settings)  # one class, a batch over the training set, a size a model cannot take
    if not args.quiet:
        print(f"data: {data.summary()}")
    from vitlab.data.load import absolute_source

    # recorded as the absolute path: a resume from another folder, or with '/home/me/photos/' for 'photos', is
    # the same data (a relative path read again elsewhere would be other data)
    data_args = {"data": absolute_source(args.data), "classes": args.classes, "per_class": args.per_class,
                 "val_fraction": args.val_fraction, "test_fraction": args.test_fraction}
    runtime.announce("compare", args.quiet)
    again = f"the same `vitlab compare` command with --resume {shlex.quote(str(out))} (finished models are kept)"
    with resume_advice(again):
        summary = run_compare(data, models, settings, out, frozen=frozen_options(args), data_args=data_args)
    _print_table(summary, out)
    if summary["failed"]:
        # non-zero so that scripts notice a missing row; the tables for the others are written anyway
        reasons = "; ".join(f"{r['model']} ({r['error']})" for r in summary["models"] if r["status"] != "ok")
        n, total = len(summary["failed"]), len(models)
        where = ("the others are in" if n < total else "their rows are in")  # "the others" of 1 of 1 are none
        raise VitlabError(f"{n} of {total} model{'s' if total != 1 else ''} failed: {reasons}; {where} "
                          f"{out / 'compare.md'}; rerun the same command to retry only the failed ones")
    return 0


def _settings(args: argparse.Namespace):
    from vitlab.experiments.compare import CompareSettings, check_train_overrides
    from vitlab.train.config import parse_kv, typed_overrides

    extra: dict = {}
    if args.batchnorm:
        extra["batchnorm"] = args.batchnorm
    for item in args.set:
        extra.update(parse_kv(item))
    check_train_overrides(extra)  # the data, folders and threads are compare's own (its flags)
    settings = CompareSettings(
        epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, optimizer=args.optimizer,
        weight_decay=args.weight_decay, decay=args.decay, warmup_steps=args.warmup_steps,
        grad_clip=args.grad_clip, augment=args.augment, image_size=args.image_size, precision=args.precision,
        device=args.device, threads=args.threads, seed=args.seed, eval_batch_size=args.eval_batch_size,
        zero_shot_map=args.zero_shot_map, train_overrides=typed_overrides(extra, "from --set"), quiet=args.quiet,
    )
    _check_training(settings)
    return settings


def _check_training(st) -> None:
    """Resolve the fine-tuning config every model will get (`experiments.compare.training_config`, the same
    resolution each model's run gets), so that an impossible value fails now, before any folder exists."""
    from vitlab.experiments.compare import training_config

    training_config(st)


def _out_dir(args: argparse.Namespace) -> Path:
    if args.resume:
        out = Path(args.resume)
        if args.out and Path(args.out) != out:
            raise VitlabError(f"--out {args.out} and --resume {args.resume} name different folders; give one")
        if not out.is_dir():
            raise VitlabError(f"--resume {out}: no such folder; give the --out of the study to resume")
        return out
    if args.out:
        from vitlab.experiments.compare import check_out_dir

        check_out_dir(Path(args.out))
        return Path(args.out)
    stem = "".join(c if c.isalnum() or c in "-_" else "-" for c in Path(args.data.split(":")[0]).name) or "data"
    return Path(f"compare-{stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")


def _print_table(summary: dict, out: Path) -> None:
    from vitlab.evaluate.runner import rows_markdown
    from vitlab.experiments.compare import PRINT_COLS, frozen_rows, markdown_table, table_rows

    print("\n".join(markdown_table(table_rows(summary), PRINT_COLS)))
    counts = summary.get("test_class_counts") or []
    missing = [n for n, c in zip(summary["class_names"], counts) if c == 0]
    if missing:  # trained on, never scored: the accuracies above say nothing about these classes
        print(f"not scored: {', '.join(missing)} (no test image: too few images to carve one); the accuracies are "
              f"over the other classes' {summary['test_images']} test images")
    frozen = frozen_rows(summary)
    if frozen:
        print(f"\nfrozen features before fine-tuning (frozen.csv):\n{rows_markdown(frozen, with_model=True)}")
    if summary["models"] and len(summary["failed"]) < len(summary["models"]):
        figures = ("curves from epoch 0 (before fine-tuning): val_loss.png, val_accuracy.png; runtime.png"
                   if summary.get("val_images") else "runtime.png; no validation split, so no curves")
        print(f"table: {out / 'compare.md'} (CSV: compare.csv); {figures}")
    else:
        print(f"table: {out / 'compare.md'} (CSV: compare.csv); no model finished, so no figures")
