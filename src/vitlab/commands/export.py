"""`vitlab export WEIGHTS OUT.onnx`: an ONNX file for fast inference, checked against PyTorch."""

from __future__ import annotations

import argparse

from vitlab.commands._argtypes import THREADS_HELP, positive_int
from vitlab.commands._engine_args import add_engine_arguments
from vitlab.commands._load_args import WEIGHTS_HELP, add_load_arguments


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export weights to ONNX (checked with ONNX Runtime when installed)")
    p.add_argument("weights", help=WEIGHTS_HELP)
    p.add_argument("output", help="the .onnx file to write (.xml for --engine openvino)")
    p.add_argument("--image-size", type=int, nargs="+", default=None, metavar="S",
                   help="input size H [W] (default: the model's); resamples position embeddings")
    p.add_argument("--opset", type=int, default=18, help="ONNX opset of the portable graph (14 or later)")
    p.add_argument("--static-batch", action="store_true", help="fix the batch size to 1")
    p.add_argument("--no-check", action="store_true", help="skip the ONNX Runtime comparison")
    p.add_argument("--threads", type=positive_int, help=THREADS_HELP)
    p.add_argument("--quiet", action="store_true", help="only the line naming the file written (errors still show)")
    add_load_arguments(p)
    add_engine_arguments(p, default="torch", engine_help=(
        "which graph to write: torch (portable ONNX, standard operators, any runtime; the default), onnxruntime "
        "(the fused fp32 graph ONNX Runtime runs), openvino (an OpenVINO model, OUT.xml + OUT.bin), auto (the "
        "graph --engine auto picks for this model on this machine)"))
    # None: not given (the portable graph, or with --int8 the int8 graph); a --engine torch given with --int8 is refused
    p.set_defaults(engine=None)
    p.epilog = ("--engine torch writes the portable graph (standard operators, any runtime); onnxruntime the fp32 "
                "graph with ONNX Runtime's transformer fusions (runs only in ONNX Runtime); auto the faster of the two "
                "here; openvino an OpenVINO model (OUT.xml and OUT.bin); --int8 the quantized graph (--calibration "
                "DATA for static int8).")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vitlab.commands._load_args import load_overrides
    from vitlab.errors import VitlabError
    from vitlab.export import export_onnx, external_data_path, matches_pytorch, onnx_difference
    from vitlab.runtime import setup_runtime
    from vitlab.weights import load_with_meta

    size = None
    if args.image_size:
        if len(args.image_size) > 2:
            raise VitlabError("--image-size takes H or H W")
        size = tuple(args.image_size) if len(args.image_size) == 2 else (args.image_size[0],) * 2
    # the export traces on the CPU (an .onnx file is device-neutral); the threads matter for tracing and the check
    _check_engine_flags(args)
    runtime = setup_runtime("cpu", args.threads)
    overrides, size = load_overrides(argparse.Namespace(model_args=args.model_args, heads=args.heads, image_size=size))
    model, meta = load_with_meta(args.weights, image_size=size, **overrides)
    runtime.announce("export", quiet=args.quiet)
    pre = meta.get("preprocess")
    metadata = {
        "class_names": meta.get("class_names"),
        "preprocess": pre.to_dict() if hasattr(pre, "to_dict") else pre,
        "model": model.config.to_dict(),
    }
    if args.engine != "torch" or args.int8:
        return _export_for_engine(args, model, meta, metadata)
    path = export_onnx(model, args.output, opset=args.opset, dynamic_batch=not args.static_batch, metadata=metadata)
    data = external_data_path(path)
    checked = "not checked (--no-check)"
    if not args.no_check:
        try:
            diff, scale = onnx_difference(model, path)
        except VitlabError as exc:  # onnxruntime not installed: the file stands, unchecked
            checked = f"not checked: {exc}"
        except Exception as exc:  # the file does not run in ONNX Runtime: it is not left behind as if it did
            path.unlink(missing_ok=True)
            data.unlink(missing_ok=True)
            raise VitlabError(f"the exported file does not run in ONNX Runtime ({type(exc).__name__}: "
                              f"{str(exc).strip()[:160]}); nothing written, please report this") from exc
        else:
            if not matches_pytorch(diff, scale):
                path.unlink(missing_ok=True)
                data.unlink(missing_ok=True)
                raise VitlabError(f"the ONNX model differs from PyTorch by {diff:.2e} (largest logit {scale:.3g}); "
                                  "nothing written, please report this")
            checked = f"ONNX Runtime vs PyTorch: max abs logit difference {diff:.2e}"
    # a graph over protobuf's 2 GB keeps its weights in OUT.onnx.data, which must travel with it
    beside = f"; its weights in {data.name} beside it (keep the two together)" if data.exists() else ""
    print(f"wrote {path} ({_inputs_and_outputs(model, '1' if args.static_batch else 'B')}{beside})")
    if not args.quiet:
        print(checked)
    return 0


def _inputs_and_outputs(model, batch: str) -> str:
    """What every exported file takes and gives, in the same words for the portable and the engine graphs."""
    c, (h, w) = model.config.in_chans, model.config.image_size
    return (f"input 'images' {batch}x{c}x{h}x{w}, output 'logits' {_output_width(model, batch)}; class names and "
            "preprocessing in its metadata 'vitlab', docs/serving.md \"Exported files\"")


def _output_width(model, batch: str) -> str:
    """What the file's one output holds: the class logits, or for a model without a head (num_classes 0) its
    features, which the line gave as 'Bx0' though the file gives B x width."""
    if model.config.num_classes:
        return f"{batch}x{model.config.num_classes}"
    width = getattr(model, "num_features", None)
    return f"{batch}x{width} (features: the model has no classification head)" if width else (
        "the features (the model has no classification head)")


def opset_range() -> tuple[int, int]:
    """The ONNX opsets an export can ask for: from 14 (scaled_dot_product_attention) to the newest torch writes."""
    try:
        from torch.onnx._constants import ONNX_MAX_OPSET
    except ImportError:  # a private module: if it moves, keep a bound every torch since 2.2 writes
        ONNX_MAX_OPSET = 18  # noqa: N806
    return 14, int(ONNX_MAX_OPSET)


def _check_engine_flags(args: argparse.Namespace) -> None:
    """Flag combinations export cannot honour, refused before anything is loaded."""
    from vitlab.errors import VitlabError
    from vitlab.export import check_export_engine

    if args.engine == "torch" and args.int8:  # asked for the portable graph, and got ONNX Runtime's int8 graph
        raise VitlabError("--engine torch writes the portable fp32 graph, and --int8 the int8 graph of ONNX Runtime "
                          "(its own operators): drop --engine torch, or use --engine openvino for OpenVINO's int8")
    args.engine = args.engine or "torch"
    check_export_engine(args.engine, args.output)
    low, high = opset_range()
    if not low <= args.opset <= high:  # else torch's exporter fails mid-trace, reported as a vitlab bug
        raise VitlabError(f"--opset {args.opset}: vitlab's graphs need opset {low} to {high} (attention is "
                          f"scaled_dot_product_attention, opset 14 and later; {high} is the newest this torch writes)")
    if (args.engine != "torch" or args.int8) and (args.static_batch or args.opset != 18):
        raise VitlabError("--static-batch and --opset apply to the portable export (--engine torch) only")
    if args.int8 == "static" and not args.calibration:
        raise VitlabError("--int8 static needs your images: add --calibration DATA (a folder of images or a --data "
                          "source), or use --int8 dynamic")


def _export_for_engine(args: argparse.Namespace, model, meta: dict, metadata: dict) -> int:
    """--engine onnxruntime|auto or --int8: the graph an engine runs (checked when it is built)."""
    from vitlab.commands._engine_args import calibration_for, resolved_source
    from vitlab.export import export_for_engine
    from vitlab.predict import preprocess_for

    calibration = calibration_for(args, preprocess_for(model, meta))
    path, kind = export_for_engine(model, args.output, args.engine, int8=args.int8, calibration=calibration,
                                   source=resolved_source(args.weights), metadata=metadata, quiet=args.quiet)
    print(f"wrote {path}: {kind} ({_inputs_and_outputs(model, 'B')})")  # engine graphs keep a free batch
    return 0
