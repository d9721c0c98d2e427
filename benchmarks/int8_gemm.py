"""How fast can an int8 matrix product run on this CPU? One ViT linear layer (tokens x in -> out) through every
int8 route at hand, against fp32, so the int8 engine's ceiling is known before its graph is tuned.

    python benchmarks/int8_gemm.py                  # ViT-B/16 batch 32 shapes (6,304 tokens)
    python benchmarks/int8_gemm.py --tokens 197     # batch 1

Routes: ONNX Runtime fp32 MatMul; ORT dynamic int8 (`quantize_dynamic`, per-channel weights: what vitlab's
`--int8 dynamic` runs, DynamicQuantizeMatMul); ORT MatMulNBits (8 and 4 bits, blockwise, int8 compute,
accuracy_level 4; needs the `onnx_ir` package); torch fp32 `F.linear`; torch's deprecated dynamic-quantized
Linear on each quantized engine; `torch._int_mm` on int8 tensors already quantized (the bare int8 kernel, no
quantization work: an upper bound). Median of 5 calls, 50 ms pause before each.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linear import timed  # noqa: E402  (median of calls, 50 ms pause before each)

SHAPES = [(768, 3072), (3072, 768), (768, 768)]  # fc1, fc2, attention proj of ViT-B/16
REPS = 5


def linear_graph(k: int, n: int, path: Path) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    w, b = (rng.standard_normal((k, n)) * 0.02).astype(np.float32), (rng.standard_normal(n) * 0.02).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return w, b


def session(path: Path, threads: int):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def ort_routes(k: int, n: int, x: np.ndarray, threads: int, d: Path) -> dict[str, float]:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fp32, int8 = d / "fp32.onnx", d / "int8.onnx"
    linear_graph(k, n, fp32)
    quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8, per_channel=True)
    out = {}
    for label, path in (("ORT fp32", fp32), ("ORT int8 dynamic", int8)):
        s = session(path, threads)
        out[label] = timed(lambda s=s: s.run(None, {"x": x}), REPS)
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as exc:  # onnx_ir missing: say so, time the rest
        print(f"  (MatMulNBits skipped: {exc})")
        return out
    for bits, block in ((8, 32), (8, 128), (4, 32)):
        quantizer = MatMulNBitsQuantizer(onnx.load(str(fp32)), bits=bits, block_size=block, is_symmetric=True,
                                         accuracy_level=4)
        quantizer.process()
        path = d / f"nbits{bits}_{block}.onnx"
        quantizer.model.save_model_to_file(str(path))
        s = session(path, threads)
        out[f"ORT MatMulNBits {bits}-bit, block {block}"] = timed(lambda s=s: s.run(None, {"x": x}), REPS)
    return out


def torch_routes(k: int, n: int, x: np.ndarray) -> dict[str, float]:
    xt, layer = torch.from_numpy(x), torch.nn.Linear(k, n)
    out = {}
    with torch.no_grad():
        out["torch fp32 F.linear"] = timed(lambda: layer(xt), REPS)
        for engine in torch.backends.quantized.supported_engines:
            if engine not in ("fbgemm", "onednn", "x86"):
                continue
            torch.backends.quantized.engine = engine
            q = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(layer), {torch.nn.Linear}, dtype=torch.qint8)
            out[f"torch dynamic int8 ({engine})"] = timed(lambda q=q: q(xt), REPS)
        a = torch.randint(-128, 127, (x.shape[0], k), dtype=torch.int8)
        b = torch.randint(-128, 127, (k, n), dtype=torch.int8)
        out["torch._int_mm (bare int8 kernel)"] = timed(lambda: torch._int_mm(a, b), REPS)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=6304)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger().setLevel(logging.ERROR)  # ORT's quantizer advice on every call
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__}, {args.threads} threads; ms (GOP/s)")
    for k, n in SHAPES:
        x = np.random.default_rng(1).standard_normal((args.tokens, k)).astype(np.float32)
        with tempfile.TemporaryDirectory() as tmp:
            times = {**ort_routes(k, n, x, args.threads, Path(tmp)), **torch_routes(k, n, x)}
        gop = 2 * args.tokens * k * n / 1e9
        print(f"{args.tokens} x {k} -> {n}:")
        for label, t in times.items():
            print(f"  {label:40s} {t * 1e3:8.1f} ms  ({gop / t:5.0f} GOP/s)")


if __name__ == "__main__":
    main()
