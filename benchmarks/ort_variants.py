"""Why vitlab's ONNX Runtime graphs look the way they do: each choice of `engine/ort.py` against its alternative,
timed in one process (interleaved, 50 ms pause before each call), plus ORT's own per-operator profile.

    python benchmarks/ort_variants.py --model vit-s/16 --batch 32
    python benchmarks/ort_variants.py --model vit-b/16 --batch 32 --profile "int8 dynamic (vitlab);int8 dynamic, SkipLN kept"

Random weights (perturbed so no range is degenerate): speeds only; accuracy lives in benchmarks/int8_accuracy.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

import vitlab
from vitlab.engine.choose import interleaved_speeds
from vitlab.engine.onnx_graph import export_fusable
from vitlab.engine.ort import (
    INT8_OPS,
    OrtEngine,
    _head_nodes,
    _int8_source,
    _quiet_tools,
    build_fp32,
    build_int8_dynamic,
    fused_operator_counts,
    optimize_vit_graph,
)
from vitlab.engine.static_int8 import build_int8_static
from vitlab.export import export_onnx

FLOAT = {"DefaultTensorType": onnx.TensorProto.FLOAT}


def dynamic(src: Path, out: Path, split_bias: bool = True, **kw) -> Path:
    """vitlab's dynamic int8 (`build_int8_dynamic`) with one of its choices changed by `kw` or `split_bias`."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    if split_bias:
        src = _int8_source(src, out)
    options = {"weight_type": QuantType.QInt8, "op_types_to_quantize": INT8_OPS, "per_channel": True,
               "nodes_to_exclude": _head_nodes(src), "extra_options": FLOAT}
    options.update(kw)
    with _quiet_tools():
        quantize_dynamic(str(src), str(out), **options)
    return out


def qdq_static(fp32: Path, out: Path, calibration: list[np.ndarray]) -> Path:
    """ORT's own static quantizer (QDQ, MinMax ranges on the same images) on the MatMuls, the fused attention
    blocks dynamic QAttention (the static quantizer does not cover them): vitlab's static int8 until
    2026-11-25, and what `quantize_static` gives a user."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter(calibration)

        def get_next(self):
            x = next(self.batches, None)
            return None if x is None else {"images": x}

    source, pre, staged = _int8_source(fp32, out), out.with_suffix(".pre.onnx"), out.with_suffix(".qdq.onnx")
    with _quiet_tools():
        # shape inference first: without known types the fused graph's activations are not quantized at all
        quant_pre_process(str(source), str(pre), skip_optimization=True)
        quantize_static(str(pre), str(staged), Reader(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                        nodes_to_exclude=_head_nodes(pre), calibrate_method=CalibrationMethod.MinMax,
                        extra_options=FLOAT)
        quantize_dynamic(str(staged), str(out), weight_type=QuantType.QInt8, op_types_to_quantize=["Attention"],
                         extra_options=FLOAT)
    return out


def optimized(raw: Path, out: Path, cfg, skip: bool = True, attention: bool = True) -> Path:
    """ORT's transformer optimizer output as it is (SkipLayerNormalization kept), optionally without fusions."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    opts = FusionOptions("vit")
    opts.enable_skip_layer_norm = opts.enable_bias_skip_layer_norm = skip
    opts.enable_attention = attention
    with _quiet_tools():
        optimize_model(str(raw), model_type="vit", num_heads=cfg.heads, hidden_size=cfg.dim, opt_level=0,
                       optimization_options=opts).save_model_to_file(str(out))
    return out


def _embed_subtracting(self, x: torch.Tensor) -> torch.Tensor:
    """`VisionTransformer.embed` with the position embeddings subtracted as their negation: the same numbers to the
    bit (IEEE subtraction is the addition of the negation), but a Sub node in the graph instead of an Add."""
    self._check_images(x)
    x, grid = self.patch_embed(x)
    if self.cls_token is not None:
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
    return self.pos_drop(x - (-self._pos_embed_for(grid)))


def first_block_fused(model, d: Path, size) -> Path:
    """vitlab's fp32 graph with the first block's attention fused too.

    ORT's attention matcher walks up from a block's residual through the first of its inputs made by an Add node
    and does not try the other; in the first block that is the tokens + position embeddings Add, so vitlab's graph
    leaves that block unfused (11 of 12 Attention nodes at ViT-B/16 with the class-token-only last block's explicit
    one). With the position embeddings subtracted as their negation (`_embed_subtracting`) every block fuses."""
    import types

    from vitlab.engine import onnx_graph

    real = onnx_graph.fusable_copy

    def subtracting(m):
        twin = real(m)
        twin.embed = types.MethodType(_embed_subtracting, twin)
        return twin

    onnx_graph.fusable_copy = subtracting  # export_fusable looks it up when called
    try:
        raw = export_fusable(model, d / "raw_first_fused.onnx", size)
    finally:
        onnx_graph.fusable_copy = real
    return optimize_vit_graph(raw, d / "first_block_fused.onnx", model.config)


def variants(name: str, d: Path, wanted) -> dict[str, Path]:
    """The graphs whose names `wanted(name)` accepts, built (each build only when asked for)."""
    torch.manual_seed(0)
    model = vitlab.create_model(name).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    cfg, size = model.config, tuple(model.config.image_size)
    built: dict[str, Path] = {}

    def once(key, build):  # a graph other variants start from is built once
        if key not in built:
            built[key] = build()
        return built[key]

    fp32 = lambda: once("fp32", lambda: build_fp32(model, d / "ours", size))  # noqa: E731
    raw = lambda: once("raw", lambda: export_fusable(model, d / "raw.onnx", size))  # noqa: E731
    skip_kept = lambda: once("skip", lambda: optimized(raw(), d / "skip_kept.onnx", cfg))  # noqa: E731
    first_fused = lambda: once("first", lambda: first_block_fused(model, d, size))  # noqa: E731
    rng = np.random.RandomState(0)
    calibration = [rng.randn(16, 3, *size).astype(np.float32) for _ in range(2)]
    recipes = {
        "fp32 (vitlab: fused, SkipLN put back)": fp32,
        "fp32, SkipLN kept": skip_kept,
        "fp32, first block's attention fused too": first_fused,
        "int8 dynamic (vitlab)": lambda: build_int8_dynamic(fp32(), d / "dyn.onnx"),
        "int8 dynamic, fc1 bias inside FastGelu": lambda: dynamic(fp32(), d / "dyn_bias_gelu.onnx", split_bias=False),
        "int8 dynamic, first block's attention fused too": lambda: build_int8_dynamic(first_fused(),
                                                                                       d / "dyn_first_fused.onnx"),
        "int8 dynamic, per-tensor weights": lambda: dynamic(fp32(), d / "dyn_tensor.onnx", per_channel=False),
        "int8 dynamic, patch conv quantized": lambda: dynamic(fp32(), d / "dyn_conv.onnx",
                                                              op_types_to_quantize=[*INT8_OPS, "Conv"]),
        "int8 dynamic, SkipLN kept": lambda: dynamic(skip_kept(), d / "dyn_skip.onnx"),
        "int8 dynamic, attention core int8 too": lambda: dynamic(
            optimized(raw(), d / "unfused_attention.onnx", cfg, skip=False, attention=False), d / "dyn_core.onnx",
            op_types_to_quantize=["MatMul"], extra_options={**FLOAT, "MatMulConstBOnly": False}),
        "int8 dynamic of the portable export": lambda: dynamic(export_onnx(model, d / "portable.onnx"),
                                                               d / "dyn_portable.onnx"),
        "int8 static (vitlab)": lambda: build_int8_static(fp32(), d / "static.onnx", calibration),
        "int8 static, ORT's quantize_static (QDQ)": lambda: qdq_static(fp32(), d / "static_qdq.onnx", calibration),
    }
    return {label: build() for label, build in recipes.items() if wanted(label)}


def op_times(path: Path, x: np.ndarray, threads: int, runs: int = 3) -> collections.Counter:
    """ORT's own profiler: ms of kernel time per operator type and run (after one warm-up run)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.enable_profiling = threads, True
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    for _ in range(runs + 1):
        session.run(None, {"images": x})
    trace = Path(session.end_profiling())  # ORT writes it into the working directory: read, then remove
    events = json.loads(trace.read_text())
    trace.unlink()
    first_run = min((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    warm = first_run["ts"] + first_run["dur"]
    per_op: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= warm:
            per_op[e["args"]["op_name"]] += e["dur"] / 1e3 / runs
    return per_op


def profile(path: Path, x: np.ndarray, threads: int, runs: int = 3) -> dict[str, float]:
    """Share of ORT's kernel time per operator type."""
    per_op = op_times(path, x, threads, runs)
    total = sum(per_op.values())
    return {op: 100 * t / total for op, t in per_op.most_common(8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit-s/16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--profile", default="", help="variant names to profile per operator, separated by ;")
    ap.add_argument("--only", default="", help="time only the variants whose names contain one of these words, "
                                                 "separated by ;")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        words = [w.strip() for w in args.only.split(";") if w.strip()]
        paths = variants(args.model, Path(tmp), lambda label: not words or any(w in label for w in words))
        engines = {label: OrtEngine(p, args.threads) for label, p in paths.items()}
        x = torch.randn(args.batch, 3, 224, 224)
        speeds = interleaved_speeds(engines, x, args.rounds)
        print(f"{args.model}, batch {args.batch}, {args.threads} threads, onnxruntime {ort.__version__}")
        for label, v in speeds.items():
            fused = {k: n for k, n in fused_operator_counts(paths[label]).items() if k in ("Attention", "QAttention")}
            print(f"  {label:40s} {v:8.2f} images/s   {fused}")
        for label in filter(None, args.profile.split(";")):
            shares = profile(paths[label.strip()], x.numpy(), args.threads)
            print(f"  profile of {label.strip()}: " + ", ".join(f"{op} {s:.1f} %" for op, s in shares.items()))


if __name__ == "__main__":
    main()
