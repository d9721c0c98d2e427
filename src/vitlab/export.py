"""Export a model to ONNX for fast inference elsewhere, and check the file against PyTorch."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from vitlab.errors import VitlabError


def export_onnx(
    model: nn.Module,
    path: str | Path,
    image_size: tuple[int, int] | None = None,
    opset: int = 18,
    dynamic_batch: bool = True,
    metadata: dict | None = None,
) -> Path:
    """Write `model` as ONNX with input `images` (B, C, H, W) and output `logits` (B, K).

    `metadata` (class names, preprocessing) is stored as JSON in the file's metadata_props.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    h, w = image_size or cfg.image_size
    x = torch.zeros(1, cfg.in_chans, h, w)
    model = model.eval()
    dynamic = {"images": {0: "batch"}, "logits": {0: "batch"}} if dynamic_batch else None
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (x,), str(path), input_names=["images"], output_names=["logits"],
            dynamic_axes=dynamic, opset_version=opset, dynamo=False,
        )
    if metadata:
        _write_metadata(path, metadata)
    return path


def check_onnx(model: nn.Module, path: str | Path, batch: int = 2, seed: int = 0) -> float:
    """Max absolute difference between ONNX Runtime's and PyTorch's logits on random input."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise VitlabError("checking an ONNX file needs onnxruntime: pip install onnxruntime") from exc
    cfg = model.config
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()  # the runtime's choice (runtime.py), not one per core
    sess = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    shape = sess.get_inputs()[0].shape
    h = shape[2] if isinstance(shape[2], int) else cfg.image_size[0]
    w = shape[3] if isinstance(shape[3], int) else cfg.image_size[1]
    x = torch.randn(batch, cfg.in_chans, h, w, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = model.eval()(x).numpy()
    out = sess.run(["logits"], {"images": x.numpy()})[0]
    return float(np.abs(out - ref).max())


def _write_metadata(path: Path, metadata: dict) -> None:
    import onnx

    proto = onnx.load(str(path))
    entry = proto.metadata_props.add()
    entry.key, entry.value = "vitlab", json.dumps(metadata)
    onnx.save(proto, str(path))


def export_for_engine(
    model: nn.Module,
    path: str | Path,
    engine: str = "torch",
    *,
    int8: str | None = None,
    calibration: list | None = None,
    source: str | Path | None = None,
    metadata: dict | None = None,
    quiet: bool = False,
) -> tuple[Path, str]:
    """Write the ONNX file an engine runs; returns (path, what was written).

    engine "torch": the portable graph (standard ONNX operators, any runtime; `export_onnx`).
    "onnxruntime": the fp32 graph with ORT's transformer fusions (contrib operators: ONNX Runtime only).
    "auto": whichever of the two ONNX Runtime runs faster on this machine (timed). `int8` (auto|static|dynamic):
    the quantized graph `--int8` runs, static calibrated on `calibration`. The built files are kept beside the
    model like every engine's (`vitlab.engine.choose.artefact_folder`).
    """
    import shutil

    from vitlab.engine import ENGINES
    from vitlab.engine.choose import interleaved_speeds, prepare_engine

    if engine not in ENGINES:
        raise VitlabError(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    if engine == "compiled":
        raise VitlabError("--engine compiled is torch.compile at run time, not a file; export writes ONNX: "
                          "use --engine onnxruntime (fused for ORT), torch (portable) or auto")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if int8 is not None:
        built = prepare_engine(model, "onnxruntime", int8=int8, calibration=calibration, source=source,
                               command="export", quiet=quiet)
        kind = built.name
    elif engine == "torch":
        export_onnx(model, path, metadata=metadata)
        return path, "portable ONNX (standard operators)"
    else:
        built = prepare_engine(model, "onnxruntime", source=source, command="export", quiet=True)
        kind = "onnxruntime fp32 (fused)"
        if engine == "auto":
            portable = export_onnx(model, path.with_suffix(".portable.onnx"))
            from vitlab.engine.ort import OrtEngine

            x = torch.randn(8, model.config.in_chans, *model.config.image_size)
            speeds = interleaved_speeds({"fused": built, "portable": OrtEngine(portable, torch.get_num_threads())}, x)
            if speeds["portable"] >= speeds["fused"]:
                portable.replace(path)
                kind = "portable ONNX (standard operators)"
            else:
                portable.unlink()
            kind += f" (auto: ONNX Runtime fused {speeds['fused']:.1f} vs portable {speeds['portable']:.1f} images/s)"
            if kind.startswith("portable"):
                if metadata:
                    _write_metadata(path, metadata)
                return path, kind
    shutil.copyfile(built.path, path)
    if metadata:
        _write_metadata(path, {**metadata, "engine": kind})
    return path, kind
