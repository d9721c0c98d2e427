"""`vitlab demo`: train a small ViT on the bundled Fashion-MNIST subset, evaluate it and write a run
folder with curves, a confusion matrix and attention figures - offline, in about a minute on 2 CPU cores."""

from __future__ import annotations

import argparse
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train + evaluate a small ViT on bundled data in about a minute (offline)",
                       description=__doc__)
    p.add_argument("--out", default="runs", help="folder for the run folder (default runs/)")
    p.add_argument("--name", default=None, help="run folder name (default demo-<time>)")
    p.add_argument("--epochs", type=float, default=None, help="epochs (default: the demo preset's)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: automatic)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--no-inspect", action="store_true", help="skip the attention figures")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _new_name(out: str) -> str:
    """demo-<UTC time>, with a suffix where a demo of the same second has the folder (a named run folder that
    already holds a run is refused)."""
    from pathlib import Path

    from vitlab.train.run_dir import unused_folder

    return unused_folder(Path(out) / time.strftime("demo-%Y%m%d-%H%M%S", time.gmtime())).name


def run(args: argparse.Namespace) -> int:
    from vitlab.train import resolve_config, train

    overrides = {"out_dir": args.out, "device": args.device, "quiet": args.quiet, "name": args.name or _new_name(args.out)}
    if args.epochs is not None:
        overrides["epochs"] = args.epochs
    if args.threads is not None:
        overrides["threads"] = args.threads
    cfg = resolve_config("demo", overrides=overrides)
    print("vitlab demo: training a small Vision Transformer on the bundled Fashion-MNIST subset (offline)")
    result = train(cfg)
    figures = [] if args.no_inspect else _attention_figures(result, args.quiet)
    tm = result.test_metrics or {}
    run_dir = result.run_dir
    print()
    print("vitlab demo: done")
    print(f"  test accuracy  {tm.get('accuracy', float('nan')):.4f}   macro-F1 {tm.get('macro_f1', float('nan')):.4f}"
          f"   ({tm.get('n', 0)} held-out images, 10 classes)")
    print(f"  wall time      {result.wall_time_s:.0f} s   ({result.images_per_s:.0f} training images/s)")
    print(f"  run folder     {run_dir}")
    print(f"  look at        {run_dir / 'accuracy.png'}, {run_dir / 'loss.png'}, {run_dir / 'confusion_matrix.png'}")
    if figures:
        print(f"                 {figures[0].parent / 'report.html'} (curves, confusion matrix, attention maps, "
              "rollout, position embeddings; what was skipped and why)")
    print(f"  the model      vitlab predict {run_dir / 'model'} IMAGE.png")
    return 0


def _run_sections(result) -> list:
    """The run's own figures (curves, confusion matrix) as report sections, embedded and linked."""
    from vitlab.inspect.report import Section

    tm = result.test_metrics or {}
    run_dir = result.run_dir
    figures = [
        ("Training curves: accuracy", "accuracy.png",
         "Training and validation accuracy per epoch of this demo run (the run's metrics.jsonl)."),
        ("Training curves: loss", "loss.png", "Training and validation loss per epoch of this demo run."),
        ("Confusion matrix (held-out test images)", "confusion_matrix.png",
         f"Rows: true class, columns: predicted; test accuracy {tm.get('accuracy', float('nan')):.4f} on "
         f"{tm.get('n', 0)} images."),
    ]
    return [Section(title, text, run_dir / name, link=f"../{name}")
            for title, name, text in figures if (run_dir / name).is_file()]


def _attention_figures(result, quiet: bool = False) -> list:
    """The demo's report.html: the run's curves and confusion matrix, then the inspection figures
    (vitlab.inspect) on a few test images, and the analyses that were skipped, with why; optional."""
    try:
        from vitlab.inspect.pipeline import inspect_model
    except Exception:
        return []
    try:
        import torch

        from vitlab.data import load_data
        from vitlab.data.transforms import TransformConfig, build_eval_transform

        model = result.model.cpu().eval()
        cfg = result.config
        data = load_data(cfg.data, val_fraction=cfg.val_fraction, seed=cfg.seed, progress=False)
        split = data.test if data.test is not None else data.val
        n = min(64, len(split))
        x = torch.stack([split[i][0] for i in range(n)])
        labels = [data.class_names[int(split.labels[i])] for i in range(n)]
        tcfg = TransformConfig(image_size=model.config.image_size, channels=model.config.in_chans,
                               mean=cfg.mean, std=cfg.std)
        images = build_eval_transform(tcfg)(x)
        out = result.run_dir / "inspect"
        inspect_model(model, images, out, mean=tcfg.mean, std=tcfg.std, labels=labels,
                      class_names=list(data.class_names), progress=not quiet, title="vitlab demo: inside the ViT",
                      extra_sections=_run_sections(result))
        return sorted(out.glob("*.png"))
    except Exception as exc:  # figures are a bonus: never fail the demo over them
        print(f"vitlab demo: attention figures skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
        return []
