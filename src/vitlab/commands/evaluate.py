"""`vitlab evaluate MODEL --data D`: accuracy (95% CI), top-5, macro-F1, per-class table, confusion
matrix; optionally few-shot ridge, kNN and a linear probe on frozen features."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vitlab.commands._argtypes import (
    THREADS_HELP,
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
    seed_value,
)
from vitlab.commands._engine_args import add_engine_arguments
from vitlab.commands._load_args import (
    WEIGHTS_HELP,
    add_load_arguments,
    model_folder_name,
    weights_folder_name,
)
from vitlab.errors import VitlabError


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    twice = sorted({v for v in vals if vals.count(v) > 1})
    if twice:  # it ran the same evaluation again and printed the row twice
        raise argparse.ArgumentTypeError(f"{text!r} lists {', '.join(map(str, twice))} twice; give each shot count once")
    return vals


# the split flags' defaults: the parser's, and what a run's own data is compared with (`_own_data_variant`)
SPLIT_DEFAULTS = {"val_fraction": 0.1, "test_fraction": 0.1, "seed": 0}


def add_data_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    """The data flags shared by evaluate and compare (passed to `vitlab.data.load_data`)."""
    p.add_argument("--data", required=required,
                   help="data source: fashion-mnist, mnist, cifar10:PATH, cifar100:PATH, digits, bundled, a folder, "
                        "a CSV, tar shards, hf:PATH (docs/data.md)"
                        + ("" if required else " (default for a training run, its model folder or one of its checkpoints: the run's data)"))
    p.add_argument("--classes", help="keep these classes, e.g. 'Sandal,Sneaker,Ankle boot' (names or indices)")
    p.add_argument("--per-class", type=positive_int, help="keep N training images per class (val/test stay whole)")
    p.add_argument("--val-fraction", type=fraction, default=SPLIT_DEFAULTS["val_fraction"], help="validation share carved from train if the source has none")
    p.add_argument("--test-fraction", type=fraction, default=SPLIT_DEFAULTS["test_fraction"], help="test share carved from train if the source has none")
    p.add_argument("--seed", type=seed_value, default=SPLIT_DEFAULTS["seed"], help="seed of the splits, the fresh head and the samplers (default 0)")


def add_frozen_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("frozen-feature evaluation (no backbone training)")
    g.add_argument("--fewshot", action="store_true", help="few-shot linear evaluation: closed-form ridge on pre-logits (paper, big_vision)")
    g.add_argument("--knn", action="store_true", help="weighted kNN on L2-normalised features (DINO)")
    g.add_argument("--probe", action="store_true", help="linear probe: logistic regression on cached features")
    g.add_argument("--shots", type=_int_list, default=(1, 5, 10, 25), help="shots per class (default 1,5,10,25)")
    g.add_argument("--fewshot-seeds", type=positive_int, default=3, help="seeds per shot count (default 3)")
    g.add_argument("--l2", type=non_negative_float, default=1024.0, help="ridge lambda (default 2^10 = 1024)")
    g.add_argument("--knn-k", type=positive_int, default=20, help="neighbours (default 20)")
    g.add_argument("--knn-temperature", type=positive_float, default=0.07, help="vote weight exp(cos/T) (default 0.07)")
    g.add_argument("--max-train-per-class", type=positive_int,
                   help="at most N training images per class for kNN/probe features (saves time on a CPU)")


# Settings of one frozen-feature analysis, with their defaults: given without the analysis they would do nothing
_FROZEN_SETTINGS = {"fewshot": {"shots": (1, 5, 10, 25), "fewshot_seeds": 3, "l2": 1024.0},
                    "knn": {"knn_k": 20, "knn_temperature": 0.07}}


def frozen_options(args: argparse.Namespace):
    from vitlab.evaluate.runner import FrozenOptions

    for analysis, settings in _FROZEN_SETTINGS.items():
        changed = [name for name, default in settings.items() if _as_tuple(getattr(args, name)) != _as_tuple(default)]
        if changed and not getattr(args, analysis):
            given = ", ".join("--" + name.replace("_", "-") for name in changed)
            raise VitlabError(f"{given} set{'s' if len(changed) == 1 else ''} up --{analysis}, which is not on; "
                              f"add --{analysis}, or drop {given}")
    return FrozenOptions(fewshot=args.fewshot, knn=args.knn, probe=args.probe, shots=tuple(args.shots),
                         fewshot_seeds=args.fewshot_seeds, l2_reg=args.l2, knn_k=args.knn_k,
                         knn_temperature=args.knn_temperature, max_train_per_class=args.max_train_per_class)


def _as_tuple(value) -> tuple:
    """A setting as a tuple, so that (1, 5) from the command line and a default compare alike."""
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate", help="accuracy (95%% CI), macro-F1, per-class table, confusion matrix; few-shot / kNN / probe",
        description="Evaluate a model on a data split. MODEL is a weights file or folder (any format vitlab "
                    "loads), a training run folder, or a model name (random initialisation). When the "
                    "model's head does not fit the data's classes it is evaluated zero-shot: through "
                    "--zero-shot-map, or with a fresh untrained head (chance level), labelled as such.",
    )
    p.add_argument("model", metavar="MODEL", help=WEIGHTS_HELP + "; or a model name (random initialisation)")
    add_data_args(p)
    p.add_argument("--split", default="test", choices=["train", "val", "test"], help="split to evaluate (default test)")
    p.add_argument("--out", help="folder for the report (default: <run>/eval-<split>, <run>/eval-<checkpoint>-<split> "
                                         "for a run's checkpoint, <run>/eval-<data>-<split> for other data than "
                                         "the run's or its own with other classes or split settings, else "
                                         "eval-<model>-<split>)")
    p.add_argument("--zero-shot-map", metavar="MAP",
                   help="map the data's classes to the pretrained head's: inline 'Sandal=774,Sneaker=770+630,Ankle boot=514', "
                        "a JSON or 'name = index' text file, or a shipped map (fashion-mnist-footwear-in1k)")
    p.add_argument("--head", choices=["auto", "trained", "mapped", "fresh"], default="auto",
                   help="auto: the model's head if its classes are the data's, a map by name if they are a "
                        "subset, else a fresh head (chance); or force one")
    p.add_argument("--image-size", type=positive_int, help="model input size (resamples ViT position embeddings)")
    add_load_arguments(p)
    p.add_argument("--batch-size", type=positive_int, default=64,
                   help="images per forward pass (default 64); the metrics do not depend on it")
    add_runtime_args(p)
    add_engine_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars; print only the summary table")
    add_frozen_args(p)
    p.set_defaults(func=run)


def _engine(args: argparse.Namespace, loaded, data, runtime):
    """The engine for the head pass (vitlab.engine); None where it cannot apply: a random model's fresh head,
    or few-shot / kNN / probe, whose features come from the torch model in the same pass."""
    from vitlab.commands._engine_args import engine_for, resolved_source

    explicit = args.engine != "auto" or args.int8
    if loaded.source == "registry" or frozen_options(args).any:
        if explicit and not args.quiet:
            print("vitlab evaluate: engine: torch (few-shot, kNN, probe and fresh heads need the torch model's "
                  "features; --engine/--int8 apply to a plain head evaluation)", file=sys.stderr)
        return None

    def train_images():
        from vitlab.engine.calibration import calibration_from_dataset

        train = getattr(data, "train", None)
        if train is None or not hasattr(train, "__getitem__"):
            return None
        return calibration_from_dataset(train, loaded.preprocess)

    return engine_for(args, loaded.model, source=resolved_source(args.model), preprocess=loaded.preprocess,
                      batch_size=args.batch_size, device=runtime.device, command="evaluate",
                      default_calibration=train_images)


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """--device and --threads, shared by evaluate and compare (decided by `vitlab.runtime.setup_runtime`)."""
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 (default auto)")
    p.add_argument("--threads", type=positive_int, help=THREADS_HELP)


def load_splits(args: argparse.Namespace, run_config: dict | None = None, storage: dict | None = None):
    """The data `args` name; `storage`: `load_data`'s storage arguments (`Preprocess.storage()`: file images stored
    as the model's preprocessing makes them)."""
    from vitlab.data import load_data
    from vitlab.evaluate.loading import is_runs_data, run_data_kwargs

    from_run = run_data_kwargs(run_config)
    source = args.data or from_run.get("data")
    if not source:
        raise VitlabError("no data given; add --data (e.g. --data bundled, --data fashion-mnist, --data PATH)")
    # the run's split settings (seed, fractions, classes) whenever its own data is evaluated, named or not: with
    # another seed the carved test split would hold the run's training images
    same_source = bool(from_run.get("data")) and is_runs_data(args.data, run_config)
    if args.data and same_source and not getattr(args, "quiet", False):
        print(f"data: {args.data} is the run's own data: its split settings (seed, fractions, classes) apply; "
              "flags given here win", file=sys.stderr)

    def pick(key: str, val, default):  # a flag left at its default takes the run's value
        return from_run.get(key, val) if (same_source and val == default) else val

    return load_data(
        str(source),
        classes=args.classes if args.classes is not None else (from_run.get("classes") if same_source else None),
        per_class=args.per_class if args.per_class is not None else (from_run.get("per_class") if same_source else None),
        val_fraction=pick("val_fraction", args.val_fraction, 0.1),
        test_fraction=pick("test_fraction", args.test_fraction, 0.1),
        seed=pick("seed", args.seed, 0),
        progress=not getattr(args, "quiet", False),
        report=True,  # what the loader left out (files in no class folder, tst/ not read) is said under --quiet too
        eval_splits=("val", "test", getattr(args, "split", "test")),  # streamed: these never substitute
        **(storage or {}),
    )


def _own_data_variant(args: argparse.Namespace, run_config: dict | None, run_classes, data_classes) -> str | None:
    """For an evaluation of a run's own data: None where it is the run's split (classes, per-class, fractions, seed),
    else a folder-name part that names the data and what differs (`bundled-classes-Sandal-Sneaker-Ankle-boot`)."""
    from vitlab.evaluate.loading import run_data_kwargs
    from vitlab.experiments.naming import folder_name

    from_run = run_data_kwargs(run_config)
    parts = []
    if run_classes:
        differ = list(map(str, data_classes)) != list(map(str, run_classes))
    else:  # weights without class names: the flag against the run's record
        from vitlab.data.splits import parse_classes

        differ = args.classes is not None and parse_classes(args.classes) != parse_classes(from_run.get("classes"))
    if differ:
        parts.append("classes-" + "-".join(map(str, data_classes)))
    if args.per_class is not None and args.per_class != from_run.get("per_class"):
        parts.append(f"per-class-{args.per_class}")
    for key, flag in (("val_fraction", "val"), ("test_fraction", "test"), ("seed", "seed")):
        given, default = getattr(args, key), SPLIT_DEFAULTS[key]
        if given != default and given != from_run.get(key, default):
            parts.append(f"{flag}-{given:g}")
    if not parts:
        return None
    source = from_run.get("data") or args.data or "data"
    return folder_name(f"{model_folder_name(str(source))}-{'-'.join(parts)}", collapse=True)


def _data_image_size(data) -> int | None:
    """The stored image side of the data (for models built from a name), when square."""
    ds = data.train if data.train is not None else data.test
    size = getattr(ds, "image_size", None)
    if size is None:
        return None
    h, w = (size, size) if isinstance(size, int) else size
    return int(h) if h == w else int(max(h, w))


def run(args: argparse.Namespace) -> int:
    from vitlab.commands._load_args import load_overrides
    from vitlab.evaluate.loading import fit_image_size, is_runs_data, load_for_eval, weights_path
    from vitlab.evaluate.runner import evaluate_model, rows_markdown, write_report
    from vitlab.runtime import device_for_engine, setup_runtime

    quiet = args.quiet
    # decided before loading: loading and the data's decoding already compute with torch's threads
    runtime = setup_runtime(device_for_engine(args.device, args.engine, args.int8), args.threads)
    # the one rule of every command (vitlab.weights.resolve_model): weights, run folder, pretrained name,
    # hf:ID or official name -> weights; a registry name -> None; anything else fails here, before the data
    if weights_path(args.model) is not None:
        overrides, image_size = load_overrides(args)
        loaded = load_for_eval(args.model, image_size=image_size, overrides=overrides)
        data = load_splits(args, loaded.run_config, loaded.preprocess.storage() if loaded.preprocess else None)
    else:  # a model name: build it for the data's classes, channels and (by default) image size
        if args.zero_shot_map:  # it used to be ignored without a word
            raise VitlabError(f"{args.model} is built untrained from its name: it has no pretrained head for "
                              "--zero-shot-map to map; give weights (a file, folder or run), or drop --zero-shot-map")
        data = load_splits(args)
        loaded = load_for_eval(args.model, num_classes=data.num_classes,
                               image_size=args.image_size or fit_image_size(args.model, _data_image_size(data)),
                               in_chans=data.channels, seed=args.seed)
    if not quiet:
        print(f"model: {loaded.description}")
        print(f"data: {data.summary()}")
    runtime.announce("evaluate", quiet)
    engine = _engine(args, loaded, data, runtime)
    res = evaluate_model(
        loaded.model, data, loaded.preprocess, split=args.split, model_classes=loaded.class_names,
        zero_shot_map=args.zero_shot_map, head=args.head, frozen=frozen_options(args),
        batch_size=args.batch_size, device=runtime.device, seed=args.seed, progress=not quiet,
        name=Path(args.model).name if Path(args.model).exists() else args.model,
        untrained=loaded.source == "registry", engine=engine, release=True,
    )
    # an int8 evaluation's numbers are another model's: its own folder, next to the fp32 report it had replaced
    # (the exact engines give the eager model's logits, so they share the fp32 folder)
    int8 = f"int8-{args.int8}" if getattr(args, "int8", None) else None
    if args.out:
        out = Path(args.out)
    elif loaded.run is not None:  # RUN and RUN/model: RUN/eval-test; RUN/checkpoints/best.pt: RUN/eval-best-test
        # other data than the run's gets a folder of its own (it had replaced the run's own report)
        if is_runs_data(args.data, loaded.run_config):
            # the run's own data with other classes or split settings: a folder of its own too (a 3-class
            # evaluation had replaced the run's own 10-class RUN/eval-test report)
            other = _own_data_variant(args, loaded.run_config, loaded.class_names, data.class_names)
        else:
            other = model_folder_name(args.data)
        out = loaded.run / "-".join(filter(None, ("eval", loaded.checkpoint, other, args.split, int8)))
    else:
        out = Path("-".join(filter(None, ("eval", weights_folder_name(args.model), args.split, int8))))
    res.info["model_description"] = loaded.description
    res.info["data"] = data.summary()
    # the square file images are stored at (they are resized from it to the model's input)
    res.info["data_image_size"] = list(data.splits()[args.split].image_size) if args.split in data.splits() else None
    res.info["runtime"] = runtime.to_dict()
    # what computed the logits: an int8 graph's report must not read as the fp32 model's
    res.info["engine"] = ({"name": engine.name, "note": getattr(engine, "note", None)} if engine is not None
                          else {"name": f"torch ({runtime.device})", "note": None})
    files = write_report(res, out)
    from vitlab.data import write_skipped

    (out / "skipped_files.txt").unlink(missing_ok=True)  # an earlier evaluation's list, if this one skips none
    line = write_skipped(data, out)  # load-time skips and training files that failed while streaming
    if data.all_skipped() and not quiet:
        if len(data.all_skipped()) == len(data.skipped):  # the load already said how many and why
            line = f"data: the skipped files are listed in {out / 'skipped_files.txt'}"
        print(line, file=sys.stderr)
    print(rows_markdown(res.rows))
    if not quiet:
        from vitlab.evaluate.metrics import format_report

        print()
        print(format_report(res.head_metrics, res.rows[0]["label"]))
        if res.head_mode == "fresh":  # a fresh head or an untrained model
            print("note: the head is new and untrained, so this accuracy is chance level by construction; "
                  "use --zero-shot-map for real zero-shot transfer or --fewshot/--knn/--probe for the features")
    print(f"report: {files['report']}")
    return 0
