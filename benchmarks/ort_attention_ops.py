"""One self-attention layer (qkv projection + attention core, fp32) through ONNX Runtime's two CPU attention
operators: `com.microsoft.Attention` (what vitlab's fused graphs use; QAttention is its int8 form) against
`com.microsoft.MultiHeadAttention`, which has a flash-attention path on the CPU, fed by three q, k, v MatMuls or by
one MatMul and a Split. Also one (D, D) MatMul, to show what the projection alone costs. Runs where onnxruntime
and onnx are installed (the peers' environment of docs/benchmarks.md, or `pip install 'vitlab[onnx]'`):

    python benchmarks/ort_attention_ops.py                  # ViT-S/16 and B/16 shapes, batch 32 and 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

# (label, width, heads, batch); 197 tokens (224 px, patch 16)
SHAPES = [("ViT-S/16, batch 32", 384, 6, 32), ("ViT-B/16, batch 32", 768, 12, 32),
          ("ViT-B/16, batch 1", 768, 12, 1), ("ViT-Ti/16, batch 32", 192, 3, 32)]
TOKENS = 197


def session(nodes, initializers, batch: int, width: int, threads: int) -> ort.InferenceSession:
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, TOKENS, width]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "attention", [io[0]], [io[1]], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def graphs(width: int, heads: int, batch: int, threads: int) -> dict[str, ort.InferenceSession]:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((width, 3 * width)) / np.sqrt(width)).astype(np.float32)
    b = (rng.standard_normal(3 * width) * 0.1).astype(np.float32)
    wq, wk, wv = np.split(w, 3, axis=1)
    init = numpy_helper.from_array
    mha = helper.make_node("MultiHeadAttention", ["q", "k", "v", "b"], ["y"], domain="com.microsoft", num_heads=heads)
    return {
        "Attention (vitlab's graphs)": session(
            [helper.make_node("Attention", ["x", "w", "b"], ["y"], domain="com.microsoft", num_heads=heads)],
            [init(w, "w"), init(b, "b")], batch, width, threads),
        "3 MatMuls + MultiHeadAttention": session(
            [helper.make_node("MatMul", ["x", n], [o]) for n, o in (("wq", "q"), ("wk", "k"), ("wv", "v"))] + [mha],
            [init(wq, "wq"), init(wk, "wk"), init(wv, "wv"), init(b, "b")], batch, width, threads),
        "MatMul + Split + MultiHeadAttention": session(
            [helper.make_node("MatMul", ["x", "w"], ["qkv"]),
             helper.make_node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=2), mha],
            [init(w, "w"), init(b, "b"), init(np.array([width] * 3, np.int64), "sizes")], batch, width, threads),
        "one (D, D) MatMul": session([helper.make_node("MatMul", ["x", "wq"], ["y"])], [init(wq, "wq")],
                                     batch, width, threads),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args()
    print(f"onnxruntime {ort.__version__}, {args.threads} threads, {TOKENS} tokens, median of {args.rounds} "
          "interleaved rounds, ms per call")
    for label, width, heads, batch in SHAPES:
        sessions = graphs(width, heads, batch, args.threads)
        x = np.random.default_rng(1).standard_normal((batch, TOKENS, width)).astype(np.float32)
        outputs = {name: s.run(None, {"x": x})[0] for name, s in sessions.items()}
        ref = outputs["Attention (vitlab's graphs)"]
        times = {name: [] for name in sessions}
        for r in range(args.rounds):
            names = list(sessions)[r % len(sessions):] + list(sessions)[:r % len(sessions)]
            for name in names:
                start = time.perf_counter()
                sessions[name].run(None, {"x": x})
                times[name].append(time.perf_counter() - start)
        print(label)
        for name, t in times.items():
            diff = "" if name.startswith("one") else f"   max |diff| vs Attention {np.abs(outputs[name] - ref).max():.1e}"
            print(f"  {name:36s} {statistics.median(t) * 1e3:8.2f}{diff}", flush=True)


if __name__ == "__main__":
    main()
