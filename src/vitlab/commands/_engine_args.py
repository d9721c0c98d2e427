"""`--engine`, `--int8` and `--calibration`, shared by predict, evaluate, inspect and export (vitlab.engine)."""

from __future__ import annotations

import argparse

# the same names as vitlab.engine.ENGINES and INT8_MODES (tests/test_cli_startup.py keeps them in step): spelled out
# here so that `vitlab --help` never imports the engine package
ENGINE_CHOICES = ("auto", "torch", "onnxruntime", "compiled", "openvino")
INT8_CHOICES = ("auto", "static", "dynamic")


def add_engine_arguments(p: argparse.ArgumentParser, default: str = "auto", int8: bool = True,
                         engine_help: str | None = None) -> None:
    p.add_argument("--engine", choices=ENGINE_CHOICES, default=default,
                   help=engine_help or "what runs the model on the CPU: auto (time torch, ONNX Runtime and OpenVINO, where "
                        "installed, once per machine and shape, keep the fastest exact one; cached beside the model), "
                        "torch (eager), onnxruntime (fused fp32 graph), compiled (torch.compile), openvino (needs "
                        f"vitlab[openvino]) (default {default}); with --device auto, onnxruntime, compiled"
                        f"{', openvino and --int8' if int8 else ' and openvino'} run on the CPU also where a GPU is "
                        "present")  # inspect has no --int8: its help named a flag it refuses
    if int8:
        p.add_argument("--int8", nargs="?", const="auto", choices=INT8_CHOICES, default=None,
                       help="int8 inference in ONNX Runtime or OpenVINO (predict and evaluate with --engine auto: both, where installed; "
                            "timed once per machine and batch size, the fastest kept): static (activation ranges calibrated on your images), "
                            "dynamic (ranges per call; ONNX Runtime only), or auto (static unless dynamic times over "
                            "5%% faster, of those whose top-1 agreement with fp32 on held-out images is not "
                            "measurably below 99%%; dynamic without calibration images)")
        p.add_argument("--calibration", metavar="DATA",
                       help="images for static int8: a folder of images or any --data source (default: evaluate "
                            "takes its data's training split, predict and serve a training run's own training "
                            "images; other models need it for static int8, and --int8 auto without it is dynamic)")


def engine_for(args: argparse.Namespace, model, *, source, preprocess, batch_size: int, device, command: str,
               default_calibration=None, defer_note: bool = False, release: bool = False):
    """The engine for this command, or None where the model itself runs (a GPU). With `defer_note` the command
    prints `engine.note` itself, once its inputs have been read. With `release` (a command that owns `model` and
    runs nothing but the engine) the torch weights are freed where the engine holds its own
    (`engine.release.release_model`)."""
    from vitlab.runtime import device_for_engine

    int8 = getattr(args, "int8", None)
    quiet = getattr(args, "quiet", False) or defer_note
    if getattr(device, "type", str(device)) != "cpu":
        device_for_engine(str(device), args.engine, int8)  # the one refusal of CPU-only engines on a GPU
        return None
    if args.engine == "torch" and not int8:
        engine = eager_engine(model, command, quiet)
    else:
        from vitlab.engine import prepare_engine

        calibration = calibration_for(args, preprocess, default_calibration)
        engine = prepare_engine(model, args.engine, int8=int8, calibration=calibration, batch_size=batch_size,
                                source=source, command=command, quiet=quiet,
                                progress=not getattr(args, "quiet", False))
        _for_a_stream(engine)
    if release:
        from vitlab.engine.release import release_model

        calibration = None  # freed before the memory goes back to the OS
        release_model(model, engine)
    return engine


def eager_engine(model, command: str, quiet: bool):
    """`--engine torch` on the CPU for predict and evaluate: TorchEngine (the model's logits, with its linear
    weights packed once for oneDNN and a ViT's blocks as direct operator calls), as `--engine auto` times it.
    Calling the model itself, as these commands did, left the packed weights out. These commands call the engine
    batch after batch without a pause, so its smallest calls keep both threads: the one-thread rule, which serve's
    engine keeps for requests that come after idle time, made a stream of the Fashion-MNIST ViT's batch-1 calls
    slower (benchmarks/predict_engine_torch.py, docs/results/predict_engine_torch.txt). Nothing is built or
    written: no folder, no timing."""
    import sys

    from vitlab.engine.torch_engines import TorchEngine

    engine = TorchEngine(model, small_calls_on_one_thread=False)
    engine.note = f"vitlab {command}: engine: torch (eager, as asked)"
    if not quiet:
        print(engine.note, file=sys.stderr)
    return engine


def _for_a_stream(engine) -> None:
    """Predict and evaluate call their engine batch after batch: where `--engine auto` picked eager PyTorch, its
    smallest calls keep both threads too (`eager_engine`)."""
    from vitlab.engine.torch_engines import TorchEngine

    inner = getattr(engine, "engine", engine)  # the engine a SubBatched wraps
    if isinstance(inner, TorchEngine):
        inner.small_calls_on_one_thread = False


def calibration_for(args: argparse.Namespace, preprocess, default=None):
    """Static int8's calibration batches: `--calibration DATA`, else `default()` (the command's own images), else
    None; None without `--int8`."""
    if not getattr(args, "int8", None):
        return None
    if getattr(args, "calibration", None):
        from vitlab.engine.calibration import calibration_from_source
        from vitlab.errors import VitlabError

        try:
            return calibration_from_source(args.calibration, preprocess)
        except VitlabError as exc:  # the data loader's words name no flag ('cal has no class subfolders')
            raise VitlabError(f"--calibration {args.calibration}: {exc}") from exc
    return default() if default is not None else None


def run_calibration(spec, preprocess):
    """Static int8's default calibration for a training run (RUN, RUN/model or one of RUN's checkpoints): a seeded
    sample of the run's own training images, as `vitlab evaluate RUN` uses; None for other models, which then need
    `--calibration`. Never the images of the call: the same image would get other answers beside other images."""
    from vitlab.evaluate.loading import run_data_settings, run_of

    run = run_of(spec)[0]
    if run is None:
        return None
    from vitlab.data import load_data
    from vitlab.engine.calibration import calibration_from_dataset

    settings = run_data_settings(run)
    source = settings.pop("data", None)
    if not source:
        return None
    data = load_data(str(source), progress=False, report=False, **preprocess.storage(), **settings)
    return calibration_from_dataset(data.train, preprocess)


def resolved_source(spec):
    """The local file or folder a model came from (artefacts are kept beside it); None for a registry name."""
    from vitlab.weights import resolve_model

    return resolve_model(spec)
