"""`vitlab predict WEIGHTS IMAGE_OR_FOLDER...`: top-k class names and probabilities per image."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from vitlab.commands._argtypes import THREADS_HELP, positive_int
from vitlab.commands._engine_args import add_engine_arguments
from vitlab.commands._load_args import WEIGHTS_HELP, add_load_arguments


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict", help="classify images with any weights (vitlab folder, official .npz, timm, Hugging Face, torchvision)",
        description="Print the top-k classes of each image, preprocessed as stored with the weights "
                    "(or the format's standard: official/timm mean=std=0.5, Hugging Face resize bilinear).",
    )
    p.add_argument("weights", help=WEIGHTS_HELP)
    p.add_argument("images", nargs="+", help="image files and/or folders of images")
    p.add_argument("--top-k", type=int, default=5, help="classes to show per image (default 5)")
    p.add_argument("--format", choices=["table", "json", "csv"], default="table", help="how the answers are printed")
    p.add_argument("--batch-size", type=int, default=32, help="images per model call")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ... (default auto: cuda when available)")
    p.add_argument("--threads", type=positive_int, help=THREADS_HELP)
    add_load_arguments(p)
    p.add_argument("--skip-bad", action="store_true", help="skip unreadable images (listed on stderr) instead of stopping")
    p.add_argument("--quiet", action="store_true", help="no progress bar or notes on stderr")
    add_engine_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vitlab.commands._engine_args import engine_for, resolved_source, run_calibration
    from vitlab.commands._load_args import load_overrides
    from vitlab.data.images import BadImageError, is_image_file, one_line
    from vitlab.errors import VitlabError
    from vitlab.predict import collect_images, format_predictions, predict_files, preprocess_for
    from vitlab.runtime import device_for_engine, setup_runtime
    from vitlab.weights import load_with_meta

    if args.top_k < 1:
        raise VitlabError(f"--top-k must be at least 1, got {args.top_k}")
    if args.batch_size < 1:
        raise VitlabError(f"--batch-size must be at least 1, got {args.batch_size}")
    runtime = setup_runtime(device_for_engine(args.device, args.engine, args.int8), args.threads)
    if is_image_file(args.weights) and Path(args.weights).is_file():  # checked first: else the images fail first
        raise VitlabError(f"{args.weights} is an image, not weights: the weights come first "
                          "(`vitlab predict WEIGHTS IMAGES`)")
    files, skipped = collect_images(args.images)
    overrides, image_size = load_overrides(args)
    model, meta = load_with_meta(args.weights, image_size=image_size, **overrides)
    if meta.get("zero_head") and not args.quiet:
        print("vitlab predict: warning: the classification head in these weights is all zeros (an ImageNet-21k "
              "pre-training file); the probabilities are uniform - fine-tune first", file=sys.stderr)
    engines = []  # made when the first batch is ready: a bad first image fails before anything is built

    def make_engine():
        engines.append(engine_for(args, model, source=resolved_source(args.weights),
                                  preprocess=preprocess_for(model, meta), batch_size=min(args.batch_size, len(files)),
                                  device=runtime.device, command="predict", defer_note=True, release=True,
                                  default_calibration=lambda: run_calibration(args.weights, preprocess_for(model, meta))))
        return engines[-1]

    try:
        preds, failed = predict_files(model, meta, files, args.top_k, args.batch_size, runtime.device,
                                      progress=not args.quiet and len(files) > 50, strict=not args.skip_bad,
                                      engine_factory=make_engine)
    except BadImageError as exc:
        if len(files) == 1:
            raise
        raise VitlabError(f"{exc}; add --skip-bad to leave unreadable images out") from None
    # announced after the images were read: a bad image still fails with exactly one line
    runtime.announce("predict", args.quiet)
    if engines and not args.quiet:  # eager PyTorch (as asked, or on a GPU) is said as the other engines are
        print(engines[0].note if engines[0] is not None else
              f"vitlab predict: engine: torch on {runtime.device} (eager)", file=sys.stderr)
    print(format_predictions(preds, args.format))
    if not args.quiet:
        for _path, reason in failed:
            print(f"vitlab predict: skipped {reason}", file=sys.stderr)
        if skipped:  # by reason: a dangling link or a link loop is no "non-image file"
            reasons = Counter(reason for _, reason in skipped)
            print(f"vitlab predict: ignored {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} in the folders ("
                  + "; ".join(f"{why}: {n}" for why, n in reasons.items()) + f"; first: {one_line(skipped[0][0])})",
                  file=sys.stderr)
    if not preds:
        raise VitlabError("no image could be read")
    return 0
