"""`vitlab inspect`: the paper's inspection figures (filters, position embeddings, attention
distance, rollout) for a model, as PNGs plus one self-contained HTML report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vitlab.commands._argtypes import THREADS_HELP, fraction, non_negative_int, positive_int, seed_value
from vitlab.commands._engine_args import add_engine_arguments
from vitlab.commands._load_args import (
    WEIGHTS_HELP,
    add_load_arguments,
    model_folder_name,
    weights_folder_name,
)
from vitlab.errors import VitlabError

if TYPE_CHECKING:
    import torch


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="look inside a ViT: embedding filters, position-embedding similarity, attention distance, rollout",
        description="Write the ViT paper's inspection figures (Fig. 6, 7, 10, 11, 14) as PNGs and one HTML report.",
    )
    p.add_argument("model", metavar="MODEL",
                   help=WEIGHTS_HELP)
    p.add_argument("--images", nargs="+", metavar="PATH", help="image files and/or folders (searched recursively)")
    p.add_argument("--skip-bad", action="store_true", help="skip unreadable --images (listed on stderr) instead of "
                   "stopping")
    p.add_argument("--data", metavar="SOURCE", help="take the images from a data set, e.g. fashion-mnist, digits, a folder")
    p.add_argument("--split", default="test", choices=["test", "val", "train"], help="split of --data (default test)")
    p.add_argument("--out", metavar="DIR", help="output folder for the PNGs, report.html and arrays (default: "
                   "RUN/inspect for a run folder, RUN/inspect-<name> for RUN/checkpoints/<name>.pt, "
                   "RUN/inspect-images or RUN/inspect-<data> for --images or other --data than the run's, else "
                   "inspect-<model>)")
    p.add_argument("-n", "--num-images", type=non_negative_int, default=None,
                   help="images the attention distance averages over (default 128, as the paper)")
    p.add_argument("--rollout-images", type=non_negative_int, default=8, help="images shown with rollout overlays (default 8)")
    p.add_argument("--head-fusion", choices=["mean", "max", "min"], default="mean",
                   help="how rollout fuses the heads (default mean, as the paper)")
    p.add_argument("--discard-ratio", type=fraction, default=0.0,
                   help="rollout: zero this fraction of the lowest fused attention entries per layer (default 0)")
    p.add_argument("--cls", choices=["exclude", "zero"], default="exclude",
                   help="attention distance: 'exclude' the class token and renormalise over patches (default) or "
                        "count attention to it as distance 'zero'")
    p.add_argument("--components", type=positive_int, default=28, help="principal components of the embedding filters (default 28)")
    p.add_argument("--image-size", type=int, default=None, help="run at this input size (position embeddings resampled)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="images per model call")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default auto: cuda when available)")
    p.add_argument("--threads", type=positive_int, help=THREADS_HELP)
    p.add_argument("--seed", type=seed_value, default=0, help="which images --data picks (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, only notes on what the report leaves out "
                   "and the report path")
    add_load_arguments(p)
    add_engine_arguments(p, int8=False)
    p.set_defaults(func=run)


def resolve_model_path(path: str) -> str:
    """What MODEL names, by the rule every command shares (`vitlab.weights.resolve_weights`): a weights file or
    folder, a run folder (its RUN/model/), a pretrained name, hf:ORG/NAME or an official name."""
    from vitlab.weights import resolve_weights

    return str(resolve_weights(path))


def load_model(path: str, image_size: int | None = None, **overrides):
    """(model, class_names, preprocess) from anything `vitlab.load` reads or a run folder (`overrides`: the config
    fields a file cannot tell, as `vitlab.load` takes them)."""
    from vitlab.weights import load_with_meta

    model, meta = load_with_meta(resolve_model_path(path), image_size=image_size, **overrides)
    return model, meta.get("class_names"), meta.get("preprocess")


def _own_position_table(args, model, image_size, overrides):
    """(position table, grid) of the model at its own size when --image-size resampled the one it runs with."""
    if args.image_size is None or getattr(model.config, "arch", "vit") != "vit" or model.config.posemb != "learn":
        return None  # a fixed sin-cos table is the same function at any grid
    own, _, _ = load_model(args.model, None, **overrides)
    if tuple(own.config.grid_size) == tuple(model.config.grid_size):
        return None
    return own.pos_embed.detach(), tuple(own.config.grid_size)


def make_preprocess(model, preprocess):
    """The weights' preprocessing, or the official fallback: plain resize to the model size, mean = std = 0.5."""
    from vitlab.data.preprocess import Preprocess

    if isinstance(preprocess, dict):
        preprocess = Preprocess.from_dict(preprocess)
    cfg = model.config
    if preprocess is None:
        return Preprocess.for_model(cfg.image_size, channels=cfg.in_chans)
    if tuple(preprocess.image_size) != tuple(cfg.image_size) or preprocess.channels != cfg.in_chans:
        d = preprocess.to_dict()
        d["image_size"] = list(cfg.image_size)
        if preprocess.channels != cfg.in_chans:
            d.update(channels=cfg.in_chans, mean=[0.5] * cfg.in_chans, std=[0.5] * cfg.in_chans)
        preprocess = Preprocess.from_dict(d)
    return preprocess


def image_files(paths: list[str]) -> list[Path]:
    from vitlab.data.images import is_image_file

    files: list[Path] = []
    for item in paths:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and is_image_file(f))
            if not found:
                raise VitlabError(f"no image files in folder {p} (looked for .jpg, .png, ...)")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise VitlabError(f"no such image file or folder: {p}")
    return files


def gather_images(args: argparse.Namespace, preprocess) -> tuple[torch.Tensor, list[str], dict, list[str]]:
    """Normalised (N, C, H, W) images, a label per image (file name or class name), the settings that say where
    they came from (recorded in the report and inspect.json) and notes on anything that made N differ from -n."""
    import torch

    from vitlab.data.images import BadImageError, open_image

    tensors, labels, notes = [], [], []
    settings: dict = {"num_images_requested": args.num_images}
    files = image_files(args.images or [])
    if files:
        settings["image_paths"] = list(args.images)
    for f in files:
        if len(tensors) == args.num_images:
            # -n is a limit on --images too; saying so keeps a folder of 500 files from looking fully used
            notes.append(f"-n {args.num_images}: only the first {args.num_images} of the {len(files)} --images are used")
            break
        try:
            tensors.append(preprocess(open_image(f)))
        except BadImageError as exc:
            if not args.skip_bad:
                raise VitlabError(f"{exc}; add --skip-bad to leave unreadable images out") from None
            print(f"vitlab inspect: skipped {exc}", file=sys.stderr)
            continue
        labels.append(f.stem[:16])
    remaining = args.num_images - len(tensors)
    if files and not args.data and remaining > 0 and getattr(args, "num_images_given", False):
        notes.append(f"-n {args.num_images}: only {len(tensors)} --images given, so {len(tensors)} "
                     f"{'are' if len(tensors) != 1 else 'is'} used")
    if args.data and remaining > 0:
        from vitlab.data import load_data

        # a run's own data comes with its class subset and split settings, as `vitlab evaluate RUN` reads it
        splits = load_data(args.data, **{"seed": args.seed, **getattr(args, "run_data", {})},
                           **preprocess.storage())  # the photos as the model reads them
        # the asked-for split, else the first non-empty one (a source without a test split still gives images)
        split = next((name for name in (args.split, "test", "val", "train")
                      if getattr(splits, name, None) is not None and len(getattr(splits, name))), None)
        if split is None:
            raise VitlabError(f"data set {args.data!r} has no images in its {args.split} split")
        if split != args.split:
            notes.append(f"data {args.data} has no {args.split} split: images from its {split} split")
        ds = getattr(splits, split)
        settings.update(data=args.data, split=split, seed=args.seed)
        if remaining > len(ds):
            used = len(tensors) + len(ds)
            notes.append(f"-n {args.num_images}: the {split} split of {args.data} has only {len(ds)} "
                         f"image{'s' if len(ds) != 1 else ''}, so {used} {'are' if used != 1 else 'is'} used")
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(args.seed))[:remaining]
        for i in order.tolist():
            img, y = ds[i]
            tensors.append(preprocess(img))
            labels.append(splits.class_names[int(y)] if splits.class_names else str(int(y)))
    settings["num_images"] = len(tensors)
    if not tensors:
        return torch.empty(0), [], settings, notes
    return torch.stack(tensors), labels, settings, notes


def _attention_engine(args: argparse.Namespace, model, runtime, n_images: int):
    """What computes logits + attention for the images (vitlab.engine.attention); None = the torch model."""
    if not n_images or args.engine == "torch":
        return None
    if runtime.device.type != "cpu":
        from vitlab.runtime import device_for_engine

        device_for_engine(str(runtime.device), args.engine)  # the one refusal of CPU-only engines on a GPU
        return None
    from vitlab.commands._engine_args import resolved_source
    from vitlab.engine.attention import prepare_attention_engine

    return prepare_attention_engine(model, args.engine, batch_size=min(args.batch_size, n_images),
                                    image_size=tuple(model.config.image_size),
                                    source=resolved_source(resolve_model_path(args.model)), quiet=args.quiet)


def run_defaults(args: argparse.Namespace) -> dict:
    """As evaluate does: a run folder's report goes into it (RUN/inspect), and its images come from the run's own
    data unless --images or --data say otherwise; a run's checkpoint is treated the same, written to
    RUN/inspect-<checkpoint> (RUN/inspect-best); other models write to ./inspect-<model> (file suffix dropped).
    Returns the settings this decided, for the report."""
    from vitlab.evaluate.loading import is_runs_data, read_run_config, run_data_settings, run_of

    run, checkpoint = run_of(args.model)
    settings: dict = {}
    if args.out is None:
        if run is not None:
            # other images than the run's get a folder of their own, as evaluate's other data does: they replaced
            # the run's own report (vitlab demo's, with its curves and confusion matrix, too)
            other = "images" if args.images else (None if is_runs_data(args.data, read_run_config(run))
                                                  else model_folder_name(args.data))
            args.out = str(run / "-".join(filter(None, ("inspect", checkpoint, other))))
        else:
            args.out = f"inspect-{weights_folder_name(args.model)}"
    if run is not None:
        settings["run"] = str(run)
    if run is not None and not args.images and not args.data:
        recorded = run_data_settings(run)
        args.data = recorded.pop("data", None)
        args.run_data = recorded  # classes, per_class, fractions, seed: the run's images, not others
        settings.update({f"run_{k}": v for k, v in recorded.items()})
        if args.data:
            settings["data_from"] = "the run's config.yaml"
            if not args.quiet:
                print(f"images from the run's data ({args.data}); --images or --data choose others", file=sys.stderr)
    return settings


def _run_figures(model: str, out: Path) -> list:
    """A training run's own figures (curves, test confusion matrix) as the report's first sections, embedded and
    linked, as `vitlab demo`'s report has them: `vitlab inspect RUN` replaced the demo's report with one without
    them. None for a checkpoint (the confusion matrix is the final model's) or a model that is no run."""
    import os

    from vitlab.evaluate.loading import run_of
    from vitlab.inspect.report import Section

    run, checkpoint = run_of(model)
    if run is None or checkpoint is not None:
        return []
    figures = [("Training curves: accuracy", "accuracy.png", "Training and validation accuracy per epoch of this "
                "run (its metrics.jsonl)."),
               ("Training curves: loss", "loss.png", "Training and validation loss per epoch of this run."),
               ("Confusion matrix (the run's test split)", "confusion_matrix.png",
                "Rows: true class, columns: predicted; the run's final model on its test split (val where it has "
                "none), as training wrote it.")]
    return [Section(title, text, run / name, link=Path(os.path.relpath(run / name, os.path.abspath(out))).as_posix())
            for title, name, text in figures if (run / name).is_file()]


def run(args: argparse.Namespace) -> int:
    from vitlab.inspect import check_inspectable, inspect_model
    from vitlab.runtime import device_for_engine, setup_runtime

    # None: not given, the paper's 128 (a note says when fewer images are at hand only where -n was asked for)
    args.num_images_given = args.num_images is not None
    args.num_images = 128 if args.num_images is None else args.num_images
    if args.num_images < 0 or args.rollout_images < 0 or args.batch_size < 1 or args.components < 1:
        raise VitlabError("--num-images and --rollout-images must be >= 0, --batch-size and --components >= 1")
    if not 0.0 <= args.discard_ratio < 1.0:
        raise VitlabError(f"--discard-ratio must be in [0, 1), got {args.discard_ratio}")
    runtime = setup_runtime(device_for_engine(args.device, args.engine), args.threads)
    from vitlab.commands._load_args import load_overrides

    overrides, image_size = load_overrides(args)
    model, class_names, preprocess = load_model(args.model, image_size, **overrides)
    settings = {"model": args.model, **run_defaults(args)}
    check_inspectable(model)
    preprocess = make_preprocess(model, preprocess)
    images, labels, image_settings, notes = gather_images(args, preprocess)
    settings.update(image_settings)
    model = model.to(runtime.device).eval()
    runtime.announce("inspect", args.quiet)
    forward = _attention_engine(args, model, runtime, len(images))
    settings.update(device=str(runtime.device), engine=getattr(forward, "name", "torch"), batch_size=args.batch_size)
    res = inspect_model(
        model, images if len(images) else None, args.out,
        mean=preprocess.mean, std=preprocess.std, labels=labels, class_names=class_names,
        batch_size=args.batch_size, rollout_images=args.rollout_images, head_fusion=args.head_fusion,
        discard_ratio=args.discard_ratio, cls=args.cls, num_components=args.components,
        title=f"vitlab inspect: {args.model}", progress=not args.quiet, forward=forward,
        settings=settings, notes=notes, position_table=_own_position_table(args, model, image_size, overrides),
        extra_sections=_run_figures(args.model, Path(args.out)),
    )
    # Notes say what the report leaves out or changed (an analysis skipped, -n capped): one line each, printed
    # even with --quiet, since without them the report's content is a surprise.
    for note in res.notes:
        print(note)
    if not args.quiet:
        for name, path in res.figures.items():
            print(f"{name:9s} {path}")
        if res.attention_distance is not None:
            per_layer = ", ".join(f"{v:.1f}" for v in res.attention_distance.mean(1))
            print(f"mean attention distance per layer (px, {len(images)} images): {per_layer}")
        from vitlab.inspect.summary import summary_lines

        for line in summary_lines(res.summary):  # the Fig. 7 findings as numbers (docs/inspect.md)
            print(line)
    print(f"report    {res.report}")
    return 0
