"""Ideas for more int8 (and batch-1 eager) speed that were measured and not adopted (docs/benchmarks.md, "Tried and
not adopted (2026-11-26)"). Each part times its candidates interleaved, median of the rounds after the first:

    python benchmarks/int8_attempts.py streams      # ORT int8: one 2-thread session vs two 1-thread ones on halves
    python benchmarks/int8_attempts.py torch-int8   # torch's own dynamic int8 (fbgemm) on HF's ViT vs ORT int8
    python benchmarks/int8_attempts.py attention    # the attention core in bf16 vs fp32; fused vs explicit at batch 1
    python benchmarks/int8_attempts.py hybrid       # ORT int8 linear layers per block + torch's attention core
    python benchmarks/int8_attempts.py profile      # ORT static int8 per node: QAttention against its q, k, v products
    python benchmarks/int8_attempts.py openvino --model vit-s/16   # variants of vitlab's OpenVINO int8 graph (and
                                                    # NNCF's quantization of the same export, where nncf is installed)

`--model vit-b/16 --batch 32 --cut 8 --rounds 6` are the defaults (cut: the sub-batch every row runs in).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from peers import perturbed  # non-zero heads and biases: same speed, real value ranges

import vitlab
from vitlab.engine.ort import build_fp32, build_int8_dynamic, make_session


def int8_graph(model: nn.Module, folder: Path) -> Path:
    """vitlab's dynamic int8 graph (what `--int8 dynamic` runs)."""
    return build_int8_dynamic(build_fp32(model, folder, tuple(model.config.image_size)), folder / "int8.onnx")


def in_cuts(fn, x, cut: int):
    return [fn(x[i:i + cut]) for i in range(0, len(x), cut)]


def interleaved(rows: dict, images: int, rounds: int) -> None:
    """Print images/s per row: every row in turn each round (50 ms apart: ORT's threads spin after a run)."""
    speeds = {k: [] for k in rows}
    for _ in range(rounds):
        for k, fn in rows.items():
            time.sleep(0.05)
            t = time.perf_counter()
            fn()
            speeds[k].append(images / (time.perf_counter() - t))
    for k, v in speeds.items():
        print(f"  {k:<40} {statistics.median(v[1:]):7.2f} images/s   rounds " + " ".join(f"{s:.1f}" for s in v))


def streams(args) -> None:
    model = perturbed(vitlab.create_model(args.model))
    x = np.random.default_rng(0).standard_normal((args.batch, 3, 224, 224), np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = int8_graph(model, Path(tmp))
        both, half_a, half_b = make_session(path, 2), make_session(path, 1), make_session(path, 1)
        name, h = both.get_inputs()[0].name, args.batch // 2
        pool = ThreadPoolExecutor(1)

        def run(sess, xs):
            return np.concatenate(in_cuts(lambda b: sess.run(None, {name: b})[0], xs, min(args.cut, len(xs))))

        def two_streams():
            other = pool.submit(run, half_a, x[:h])
            mine = run(half_b, x[h:])
            return np.concatenate([other.result(), mine])

        print(f"{args.model}, batch {args.batch} in cuts of {args.cut}, int8 dynamic: max logit difference of the "
              f"two ways {np.abs(run(both, x) - two_streams()).max():.3g} (the activation scale is per call)")
        interleaved({"one session, 2 threads": lambda: run(both, x),
                     "two sessions, 1 thread each, half each": two_streams}, args.batch, args.rounds)


def torch_int8(args) -> None:
    import torch.ao.quantization as tq
    from transformers import ViTConfig, ViTForImageClassification

    dims = {"vit-ti/16": (192, 3), "vit-s/16": (384, 6), "vit-b/16": (768, 12)}[args.model]
    hf = ViTForImageClassification(ViTConfig(hidden_size=dims[0], num_attention_heads=dims[1],
                                             intermediate_size=4 * dims[0], num_labels=1000,
                                             attn_implementation="sdpa", hidden_act="gelu_pytorch_tanh")).eval()
    quantized = tq.quantize_dynamic(hf, {nn.Linear}, dtype=torch.qint8)
    x = torch.randn(args.batch, 3, 224, 224)
    with tempfile.TemporaryDirectory() as tmp:
        model = perturbed(vitlab.create_model(args.model))
        session = make_session(int8_graph(model, Path(tmp)), torch.get_num_threads())
        name, xn = session.get_inputs()[0].name, x.numpy()

        def torch_rows():
            with torch.inference_mode():
                in_cuts(lambda b: quantized(pixel_values=b), x, args.cut)

        print(f"{args.model}, batch {args.batch} in cuts of {args.cut}; torch quantized engine "
              f"{torch.backends.quantized.engine}")
        interleaved({"torch dynamic int8 (fbgemm), HF's ViT": torch_rows,
                     "ORT dynamic int8, vitlab's graph": lambda: in_cuts(lambda b: session.run(None, {name: b}),
                                                                         xn, args.cut)},
                    args.batch, args.rounds)


def attention(args) -> None:
    model = perturbed(vitlab.create_model(args.model))
    heads, dim = model.config.heads, model.config.dim
    q, k, v = (torch.randn(args.cut, heads, 197, dim // heads) for _ in range(3))
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    explicit = {"fp32": lambda: ((q @ k.transpose(-1, -2)).softmax(-1) @ v),
                "bf16": lambda: ((qb @ kb.transpose(-1, -2)).softmax(-1) @ vb)}
    print(f"attention core of {args.cut} images, {heads} heads x 197 tokens x {dim // heads}, explicit form, "
          f"{torch.get_num_threads()} threads (ms, median of 5 x 20 calls):")
    with torch.inference_mode():
        for label, fn in explicit.items():
            fn()
            times = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(20):
                    fn()
                times.append((time.perf_counter() - t) / 20 * 1e3)
            print(f"  {label}: {statistics.median(times):.2f} ms")
    from vitlab.engine.torch_engines import TorchEngine
    from vitlab.models import attention_core
    from vitlab.runtime import tune_cpu_allocator

    tune_cpu_allocator()  # as the CLI runs eager PyTorch
    engine, x = TorchEngine(model), torch.randn(1, 3, 224, 224)

    def batch_one(max_tokens):
        def run():
            attention_core.EXPLICIT_MAX_TOKENS = max_tokens
            for _ in range(20):
                engine(x)
        return run

    print(f"{args.model}, batch 1, eager: the fused kernel (as shipped: explicit only up to "
          f"{attention_core.EXPLICIT_MAX_TOKENS} tokens) vs the explicit form at 197 tokens")
    shipped = attention_core.EXPLICIT_MAX_TOKENS
    try:
        interleaved({"fused": batch_one(shipped), "explicit": batch_one(10_000)}, 20, args.rounds)
    finally:
        attention_core.EXPLICIT_MAX_TOKENS = shipped


class _Piece(nn.Module):
    """One cut of the model between two attention cores: (x, attention output) -> (x, next block's qkv)."""

    def __init__(self, model: nn.Module, i: int):
        super().__init__()
        self.model, self.i = model, i

    def forward(self, x, ctx=None):
        m, i = self.model, self.i
        if i < 0:  # the stem: patches, class token, position embeddings, then block 0's qkv
            x, _ = m.patch_embed(x)
            x = torch.cat([m.cls_token.expand(x.shape[0], -1, -1), x], 1) + m.pos_embed
            return x, m.blocks[0].attn.qkv(m.blocks[0].norm1(x))
        block = m.blocks[i]
        last = i == len(m.blocks) - 1
        x = (x[:, :1] if last else x) + block.attn.proj(ctx)  # the last block: the class token alone
        x = x + block.mlp(block.norm2(x))
        if last:
            return (m.head(m.norm(x)[:, 0]),)
        return x, m.blocks[i + 1].attn.qkv(m.blocks[i + 1].norm1(x))


def hybrid(args) -> None:
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers.optimizer import optimize_model

    from vitlab.engine.ort import _quiet_tools

    model = perturbed(vitlab.create_model(args.model)).requires_grad_(False)
    dim, heads, n = model.config.dim, model.config.heads, model.pos_embed.shape[1]
    depth = len(model.blocks)
    folder = Path(tempfile.mkdtemp())

    def export(i: int) -> Path:
        piece, raw = _Piece(model, i), folder / f"piece{i + 1}.raw.onnx"
        if i < 0:
            inputs, names = (torch.randn(2, 3, 224, 224),), ["images"]
        else:
            inputs, names = (torch.randn(2, n, dim), torch.randn(2, 1 if i == depth - 1 else n, dim)), ["x_in", "ctx"]
        outputs = ["logits"] if i == depth - 1 else ["x", "qkv"]
        with torch.no_grad():
            torch.onnx.export(piece, inputs, str(raw), input_names=names, output_names=outputs, opset_version=17,
                              dynamic_axes={k: {0: "b"} for k in names + outputs}, dynamo=False)
        with _quiet_tools():
            fused = folder / f"piece{i + 1}.fp32.onnx"
            optimize_model(str(raw), model_type="bert", num_heads=0, hidden_size=0, opt_level=0).save_model_to_file(
                str(fused))
            head = [nd.name for nd in onnx.load(str(fused)).graph.node if nd.op_type in ("MatMul", "Gemm")][-1:]
            out = folder / f"piece{i + 1}.int8.onnx"
            quantize_dynamic(str(fused), str(out), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                             per_channel=True, nodes_to_exclude=(head + [f"{h}_MatMul" for h in head]
                                                                 if i == depth - 1 else []),
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        return out

    def session(path: Path, spinning: bool):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.log_severity_level = torch.get_num_threads(), 3
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])

    paths = [export(i) for i in range(-1, depth)]
    pieces = {spin: [session(p, spin) for p in paths] for spin in (False, True)}

    def core(qkv: torch.Tensor, queries: int | None, bf16: bool) -> np.ndarray:
        b, tokens, _ = qkv.shape
        q, k, v = (t.reshape(b, tokens, heads, dim // heads).transpose(1, 2) for t in qkv.chunk(3, -1))
        q = q[:, :, :queries] if queries else q
        if bf16:
            q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        out = ((q * (dim // heads) ** -0.5) @ k.transpose(-1, -2)).softmax(-1) @ v
        return np.ascontiguousarray(out.transpose(1, 2).reshape(b, -1, dim).float().numpy())

    def run(images: np.ndarray, bf16: bool, spinning: bool) -> np.ndarray:
        sessions = pieces[spinning]
        with torch.inference_mode():
            x, qkv = sessions[0].run(None, {"images": images})
            for i, s in enumerate(sessions[1:]):
                ctx = core(torch.from_numpy(qkv), 1 if i == depth - 1 else None, bf16)
                out = s.run(None, {"x_in": x, "ctx": ctx})
                if i == depth - 1:
                    return out[0]
                x, qkv = out

    with tempfile.TemporaryDirectory() as tmp:
        whole = make_session(int8_graph(model, Path(tmp)), torch.get_num_threads())
        name = whole.get_inputs()[0].name
        x = np.random.default_rng(0).standard_normal((args.batch, 3, 224, 224), np.float32)
        with torch.no_grad():
            ref = model(torch.from_numpy(x[:args.cut])).numpy()
        scale = np.abs(ref).max()
        print(f"{args.model}, batch {args.batch} in cuts of {args.cut}; max |logit - fp32| / max |logit|: "
              f"vitlab int8 graph {np.abs(whole.run(None, {name: x[:args.cut]})[0] - ref).max() / scale:.3g}, "
              f"hybrid fp32 core {np.abs(run(x[:args.cut], False, False) - ref).max() / scale:.3g}, "
              f"hybrid bf16 core {np.abs(run(x[:args.cut], True, False) - ref).max() / scale:.3g}")
        rows = {"vitlab int8 dynamic graph": lambda: in_cuts(lambda b: whole.run(None, {name: b}), x, args.cut)}
        for bf16 in (False, True):
            for spinning in (False, True):
                label = f"hybrid, {'bf16' if bf16 else 'fp32'} core, ORT spinning {'on' if spinning else 'off'}"
                rows[label] = (lambda bf16=bf16, spinning=spinning:
                               in_cuts(lambda b: run(b, bf16, spinning), x, args.cut))
        interleaved(rows, args.batch, args.rounds)


def profile(args) -> None:
    """ORT's profiler per node of vitlab's static int8 graph: the fused QAttention blocks against the first block,
    which stays unfused (its q, k, v products apart from its attention core)."""
    import json

    import onnxruntime as ort

    from vitlab.engine.static_int8 import build_int8_static

    model = perturbed(vitlab.create_model(args.model))
    rng = np.random.default_rng(0)
    calibration = [rng.standard_normal((16, 3, 224, 224), np.float32) for _ in range(2)]
    x = rng.standard_normal((args.cut, 3, 224, 224), np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = build_fp32(model, Path(tmp), tuple(model.config.image_size))
        path = build_int8_static(fp32, Path(tmp) / "static.onnx", calibration)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.enable_profiling = args.threads, True
        opts.profile_file_prefix = str(Path(tmp) / "profile")
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        runs = 3
        for _ in range(runs + 1):
            session.run(None, {"images": x})
        events = json.loads(Path(session.end_profiling()).read_text())
    first = min((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    per_node: dict[str, list] = {}
    for e in events:  # after the warm-up run, ms per run
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first["ts"] + first["dur"]:
            entry = per_node.setdefault(e["name"].removesuffix("_kernel_time"), [e["args"]["op_name"], 0.0])
            entry[1] += e["dur"] / 1e3 / runs
    attention = [ms for op, ms in per_node.values() if op == "QAttention"]
    qkv = sum(ms for name, (_, ms) in per_node.items() if "/blocks.0/attn/" in name and name.split("/")[3] in "qkv")
    per_image = args.cut
    print(f"{args.model}, static int8 (ORT), {args.cut} images per run, ms per image and block:")
    print(f"  QAttention (fused blocks, {len(attention)}): median {statistics.median(attention) / per_image:.2f}")
    print(f"  block 0's q, k and v products (MatMulIntegerToFloat, unfused): {qkv / per_image:.2f}")
    total = sum(ms for _, ms in per_node.values())
    print(f"  whole model: {total / per_image:.2f} ms per image; QAttention {100 * sum(attention) / total:.1f} %")


def openvino_variants(args) -> None:
    """vitlab's OpenVINO int8 graph (`engine/openvino.py`) against changes to it, all run with the rest in bf16
    (`--rest f32`: fp32):
    symmetric activation ranges, the patch embedding in int8 too, Q K^T or also A V in int8 (the attention core),
    and NNCF's own quantization of the same export (SmoothQuant, int8 Q K^T) where nncf is installed."""
    import openvino as ov
    import openvino.opset13 as ops

    from vitlab.engine import openvino as vo

    model = perturbed(vitlab.create_model(args.model))
    rng = np.random.default_rng(0)
    calibration = [rng.standard_normal((16, 3, 224, 224), np.float32) for _ in range(4)]
    x = rng.standard_normal((args.batch, 3, 224, 224), np.float32)
    with torch.inference_mode():
        reference = model(torch.from_numpy(x)).numpy()

    def attention_matmuls(ov_model):
        """(Q K^T, A V) MatMuls: both inputs computed; A V's first input comes from the Softmax."""
        core = [op for op in ov_model.get_ordered_ops() if op.get_type_name() == "MatMul"
                and vo._constant(op.input_value(1)) is None]
        return ([op for op in core if op.input_value(0).get_node().get_type_name() != "Softmax"],
                [op for op in core if op.input_value(0).get_node().get_type_name() == "Softmax"])

    def variant(fp32_xml, symmetric=False, conv=False, core_ops=""):
        ov_model = vo.core().read_model(str(fp32_xml))
        layers = vo.linear_layers(ov_model)
        qk, av = attention_matmuls(ov_model)
        extra = qk + (av if core_ops == "qk+av" else []) if core_ops else []
        ports = [(op, 0) for op in layers] + [(op, i) for op in extra for i in (0, 1)]
        probe = {vo._source_key(op.input_value(i)): op.input_value(i) for op, i in ports}
        outputs = []
        for port in probe.values():
            axes = ops.constant(np.arange(len(port.get_partial_shape()), dtype=np.int64))
            outputs += [ops.reduce_min(port, axes, False).output(0), ops.reduce_max(port, axes, False).output(0)]
        compiled = vo.core().compile_model(ov.Model(outputs, ov_model.get_parameters()), "CPU",
                                           {"INFERENCE_PRECISION_HINT": "f32"})
        results = [compiled(b) for b in calibration]  # one run per batch, every min and max at once
        found = np.array([[float(r[i]) for i in range(len(outputs))] for r in results])
        ranges = dict(zip(probe, zip(found[:, 0::2].min(0), found[:, 1::2].max(0))))
        done = {}
        for op, i in ports:
            key = vo._source_key(op.input_value(i))
            if key not in done:
                lo, hi = min(ranges[key][0], 0.0), max(ranges[key][1], 0.0)
                if symmetric or op in extra:
                    lo, hi = -max(-lo, hi), max(-lo, hi)
                done[key] = vo._fake_quantize(op.input_value(i), lo, hi, 256)
            op.input(i).replace_source_output(done[key])
        for op in layers:
            limits = vo._weight_limits(op)
            op.input(1).replace_source_output(vo._fake_quantize(op.input_value(1), -limits, limits, 255))
        if conv:
            c = next(o for o in ov_model.get_ordered_ops() if o.get_type_name() == "Convolution")
            lo, hi = float(np.min(calibration)), float(np.max(calibration))
            if symmetric:
                lo, hi = -max(-lo, hi), max(-lo, hi)
            c.input(0).replace_source_output(vo._fake_quantize(c.input_value(0), lo, hi, 256))
            w = vo._constant(c.input_value(1)).get_data().astype(np.float32)
            limits = np.maximum(np.abs(w).max(axis=(1, 2, 3), keepdims=True), np.finfo(np.float32).tiny)
            c.input(1).replace_source_output(vo._fake_quantize(c.input_value(1), -limits, limits, 255))
        ov_model.validate_nodes_and_infer_types()
        return ov_model

    with tempfile.TemporaryDirectory() as tmp:
        fp32 = vo.build_fp32_ir(model, Path(tmp), tuple(model.config.image_size))
        models = {"as vitlab builds it": variant(fp32), "symmetric activations": variant(fp32, symmetric=True),
                  "patch embedding int8 too": variant(fp32, conv=True),
                  "both": variant(fp32, symmetric=True, conv=True), "Q K^T int8 too": variant(fp32, core_ops="qk"),
                  "Q K^T and A V int8 too": variant(fp32, core_ops="qk+av")}
        try:
            import nncf

            from vitlab.export import export_onnx

            portable = vo.core().read_model(str(export_onnx(model, Path(tmp) / "portable.onnx")))
            models["NNCF on the same export"] = nncf.quantize(portable, nncf.Dataset(calibration),
                                                              model_type=nncf.ModelType.TRANSFORMER,
                                                              subset_size=sum(map(len, calibration)))
        except ImportError:
            print("  (nncf not installed: its row is left out)")
        rows = {}
        for label, ov_model in models.items():
            compiled = vo.core().compile_model(ov_model, "CPU", {"INFERENCE_NUM_THREADS": args.threads,
                                                                  "PERFORMANCE_HINT": "LATENCY",
                                                                  "INFERENCE_PRECISION_HINT": args.rest})
            request = compiled.create_infer_request()
            rows[label] = lambda xs, r=request: np.array(r.infer({0: xs})[0], copy=True)
        print(f"{args.model}, batch {args.batch} in cuts of {args.cut}, rest in {args.rest}; "
              "max |logit - fp32| / max |logit|:")
        for label, fn in rows.items():
            out = np.concatenate(in_cuts(fn, x, args.cut))
            print(f"  {label:<40} {np.abs(out - reference).max() / np.abs(reference).max():.3f}")
        interleaved({label: (lambda fn=fn: in_cuts(fn, x, args.cut)) for label, fn in rows.items()}, args.batch,
                    args.rounds)


def main() -> None:
    parts = {"streams": streams, "torch-int8": torch_int8, "attention": attention, "hybrid": hybrid,
             "profile": profile, "openvino": openvino_variants}
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=sorted(parts))
    ap.add_argument("--model", default="vit-b/16", choices=["vit-ti/16", "vit-s/16", "vit-b/16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cut", type=int, default=8, help="the sub-batch every row runs in")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rest", default="bf16", choices=["bf16", "f32"],
                    help="openvino: the precision of what the int8 graphs leave in floating point")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    parts[args.part](args)


if __name__ == "__main__":
    main()
