"""Where eager vitlab's batch-1 time goes, against ONNX Runtime running the same model (issue 18, item 2: ViT-Ti/16
and S/16 stay below the fastest peer at batch 1). Everything in one process, rows interleaved in a new random order
each round. Runs where onnxruntime and onnx are installed (`pip install 'vitlab[onnx]'`, or the peers' environment
of docs/benchmarks.md):

    python benchmarks/batch1_gap.py                                # ViT-Ti/16 and S/16, every part
    python benchmarks/batch1_gap.py --models vit-ti/16 --parts pause,products

Parts (`--parts`):
- pause: the whole call, eager vitlab (TorchEngine) against ORT running vitlab's plain ONNX export of the same model
  (no graph fusions: the same operators and tanh GELU, as a peer's export runs), back to back and after a 50 ms
  pause (what benchmarks/peers.py waits before every call); the eager call also split into its blocks and the rest
  (patch embedding, final LayerNorm, head, the engine's own Python).
- products: the model's linear layers alone, in the model's order with weights of the model's sizes for every
  block (so they come from cache as in the model): oneDNN with packed weights, eager vitlab's route, against MLAS
  (one ORT graph of MatMul + Add per layer).
- attention: one block's attention core, torch's fused kernel against ORT's com.microsoft.Attention (the qkv
  projection and the core in one operator) minus the same projection alone, and against the core alone in ORT
  (com.microsoft.MultiHeadAttention on q, k and v: no subtraction of two noisy times).
- gelu: what the official tanh GELU costs against the exact erf GELU that timm's ViT computes: the whole call back
  to back with the same weights and either GELU, in eager vitlab and in ORT (plain exports; the two ORT sessions
  with their workers' spinning off, else each slows the other, so their times are not those of the other parts).
- unary: ns per element of torch's exp, tanh, erf and sigmoid on 1M floats, one thread: what a softmax or a GELU
  written in torch operators would cost.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime as ort
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

import vitlab
from vitlab.engine import choose
from vitlab.engine.torch_engines import TorchEngine
from vitlab.export import export_onnx
from vitlab.models import vit_direct
from vitlab.models.registry import build_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linear import block_shapes  # noqa: E402  (one block's linear layers as (rows, in, out))

PARTS = ("pause", "products", "attention", "gelu", "unary")


def ort_session(model_proto_or_path, threads: int, spinning: bool = True) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if not spinning:  # where two sessions live side by side, each one's spinning workers would slow the other
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    source = model_proto_or_path if isinstance(model_proto_or_path, str) else model_proto_or_path.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def graph_model(nodes, inputs, outputs, initializers, microsoft: bool = False):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if microsoft else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def interleaved_rounds(rows: dict, rounds: int, calls: int, pause_s: float = 0.0, after_timed=None
                       ) -> dict[str, list[float]]:
    """Each row's median ms over `calls` calls, per round; rows in a new random order each round. With a pause, every
    timed call follows `pause_s` of idle time, after an untimed call of the same row. `after_timed(name)` (optional)
    runs after each timed call."""
    rng = random.Random(0)
    for fn in rows.values():
        for _ in range(3):
            fn()
    per_round: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name in rng.sample(list(rows), len(rows)):
            times = []
            rows[name]()  # the row's own warm call: nothing of the previous row's threads is left to the timed one
            for _ in range(calls):
                if pause_s:
                    time.sleep(pause_s)
                start = time.perf_counter()
                rows[name]()
                times.append(time.perf_counter() - start)
                if after_timed is not None:
                    after_timed(name)
            per_round[name].append(1e3 * statistics.median(times))
    return per_round


def best_ms(rows: dict, rounds: int, calls: int) -> dict[str, float]:
    """Each row's fastest round (interleaved_rounds). For kernels, not medians: this VM has stretches of seconds in
    which one row runs up to 2x slower (often the other runtime's threads still spinning), and a kernel is never
    faster than it can be."""
    return {name: min(v) for name, v in interleaved_rounds(rows, rounds, calls).items()}


# ------------------------------------------------------------------------------------------------ pause
class BlockTimer:
    """Wraps vit_direct._block to add up the time the blocks take (`total`, seconds; the caller resets it)."""

    def __init__(self):
        self.total = 0.0
        self._block = vit_direct._block

    def __enter__(self):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = self._block(*args, **kwargs)
            self.total += time.perf_counter() - start
            return out

        vit_direct._block = timed
        return self

    def __exit__(self, *exc):
        vit_direct._block = self._block


def pause(model, threads: int, rounds: int, tmp: Path) -> None:
    x = torch.randn(1, model.config.in_chans, *model.config.image_size)
    engine = TorchEngine(model)
    path = export_onnx(model, tmp / "plain.onnx")
    session = ort_session(str(path), threads)
    feed = {session.get_inputs()[0].name: x.numpy()}
    timer = BlockTimer()

    def eager():
        timer.total = 0.0
        engine(x)

    def record_blocks(name: str) -> None:
        if name == "eager vitlab":
            blocks.append(1e3 * timer.total)

    rows = {"eager vitlab": eager, "ORT, same model": lambda: session.run(None, feed)}
    print("  whole call, ms, median of rounds [fastest round]; eager: blocks + the rest (medians)")
    with timer:
        pause_s = choose.PAUSE_S  # what benchmarks/peers.py waits before every call
        for label, gap, calls in (("back to back", 0.0, 5), (f"after {pause_s * 1e3:.0f} ms idle", pause_s, 3)):
            blocks: list[float] = []
            per_round = interleaved_rounds(rows, rounds, calls, gap, record_blocks)
            in_blocks = statistics.median(blocks)
            eager_ms, ort_ms = (statistics.median(per_round[r]) for r in rows)
            eager_best, ort_best = (min(per_round[r]) for r in rows)
            print(f"    {label:18s} eager {eager_ms:6.2f} [{eager_best:6.2f}] (blocks {in_blocks:6.2f}, rest "
                  f"{eager_ms - in_blocks:5.2f})   ORT {ort_ms:6.2f} [{ort_best:6.2f}]   eager/ORT speed "
                  f"{ort_ms / eager_ms:.3f} [{ort_best / eager_best:.3f}]")


# --------------------------------------------------------------------------------------------- products
def linear_rows(model, threads: int) -> tuple[dict, float]:
    """The model's linear layers at batch 1, in its order with weights of its sizes: {"oneDNN packed": fn, "MLAS":
    fn}, each returning the layers' outputs in that order, and their FLOPs."""
    rows_n = model.pos_embed.shape[1]  # tokens of one image, class token included
    shapes = block_shapes(rows_n, model.config.dim, model.config.mlp_dim)  # qkv, proj, fc1, fc2: (rows, in, out)
    layers = [(f"{name}{i}", k, n) for i in range(len(model.blocks))
              for name, (_, k, n) in zip(("qkv", "proj", "fc1", "fc2"), shapes)]
    gen = torch.Generator().manual_seed(0)
    weights = {name: (torch.randn(n, k, generator=gen) * 0.02, torch.randn(n, generator=gen) * 0.02)
               for name, k, n in layers}
    inputs = {k: torch.randn(1, rows_n, k, generator=gen) for k in {k for _, k, _ in layers}}
    packed = {name: torch.ops.mkldnn._reorder_linear_weight(w, rows_n) for name, (w, _) in weights.items()}
    nodes, inits, outs = [], [], []
    for name, k, _ in layers:
        w, b = weights[name]
        inits += [numpy_helper.from_array(w.t().contiguous().numpy(), f"{name}_w"),
                  numpy_helper.from_array(b.numpy(), f"{name}_b")]
        nodes += [helper.make_node("MatMul", [f"x{k}", f"{name}_w"], [f"{name}_m"]),
                  helper.make_node("Add", [f"{name}_m", f"{name}_b"], [name])]
        outs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    graph_inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, rows_n, k]) for k in inputs]
    session = ort_session(graph_model(nodes, graph_inputs, outs, inits), threads)
    feed = {f"x{k}": x.numpy() for k, x in inputs.items()}

    def onednn():
        return [torch.ops.mkldnn._linear_pointwise(inputs[k], packed[name], weights[name][1], "none", [], "")
                for name, k, _ in layers]

    flops = sum(2 * rows_n * k * n for _, k, n in layers)
    return {"oneDNN packed": onednn, "MLAS": lambda: session.run(None, feed)}, flops


def products(model, threads: int, rounds: int) -> None:
    rows, flops = linear_rows(model, threads)
    with torch.inference_mode():
        ms = best_ms(rows, rounds, 3)
    print(f"  the model's {4 * len(model.blocks)} linear layers at {model.pos_embed.shape[1]} rows, one after another "
          "(fastest round: ms, GFLOP/s):")
    for name, t in ms.items():
        print(f"    {name:14s} {t:7.2f}  {flops / t / 1e6:6.1f}")
    print(f"    oneDNN / MLAS speed {ms['MLAS'] / ms['oneDNN packed']:.3f}")


# -------------------------------------------------------------------------------------------- attention
def attention_rows(model, threads: int) -> dict:
    """One block's attention at batch 1: {"torch fused kernel": (B, H, N, d) from the q, k, v views the blocks pass,
    "ORT Attention": qkv projection + core as (B, N, D), "ORT projection": the projection alone}."""
    cfg = model.config
    tokens, width, heads = model.pos_embed.shape[1], cfg.dim, cfg.heads
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, width, generator=gen)
    w, b = torch.randn(3 * width, width, generator=gen) * 0.05, torch.randn(3 * width, generator=gen) * 0.05
    inits = [numpy_helper.from_array(w.t().contiguous().numpy(), "w"), numpy_helper.from_array(b.numpy(), "b")]
    io = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, tokens, width])]
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    fused = ort_session(graph_model([helper.make_node("Attention", ["x", "w", "b"], ["y"], domain="com.microsoft",
                                                      num_heads=heads)], io, out, inits, microsoft=True), threads)
    projection = ort_session(graph_model([helper.make_node("MatMul", ["x", "w"], ["m"]),
                                          helper.make_node("Add", ["m", "b"], ["y"])], io, out, inits), threads)
    qkv = F.linear(x, w, b).view(1, tokens, 3, heads, width // heads)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    feed = {"x": x.numpy()}
    # the core alone: com.microsoft.MultiHeadAttention on q, k, v as (B, N, D), no projection to subtract
    core_io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, tokens, width]) for name in "qkv"]
    core = ort_session(graph_model([helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["y"],
                                                     domain="com.microsoft", num_heads=heads)],
                                   core_io, out, [], microsoft=True), threads)
    core_feed = {name: t.contiguous().numpy() for name, t in zip("qkv", F.linear(x, w, b).chunk(3, dim=-1))}
    return {"torch fused kernel": lambda: F.scaled_dot_product_attention(q, k, v),
            "ORT Attention": lambda: fused.run(None, feed)[0], "ORT projection": lambda: projection.run(None, feed),
            "ORT MultiHeadAttention": lambda: core.run(None, core_feed)[0]}


def attention(model, threads: int, rounds: int) -> None:
    with torch.inference_mode():
        ms = best_ms(attention_rows(model, threads), rounds, 10)
    core = ms["ORT Attention"] - ms["ORT projection"]
    print(f"  one block's attention core, {model.config.heads} heads x {model.pos_embed.shape[1]} tokens (fastest "
          f"round, us): torch fused kernel {1e3 * ms['torch fused kernel']:.1f}, ORT Attention "
          f"{1e3 * ms['ORT Attention']:.1f} - projection {1e3 * ms['ORT projection']:.1f} = {1e3 * core:.1f};  "
          f"x {len(model.blocks)} blocks: {len(model.blocks) * (ms['torch fused kernel'] - core):+.2f} ms for torch; "
          f"the core alone in ORT (MultiHeadAttention on q, k, v) {1e3 * ms['ORT MultiHeadAttention']:.1f}, "
          f"torch / ORT {ms['torch fused kernel'] / ms['ORT MultiHeadAttention']:.2f}")


# ------------------------------------------------------------------------------------------------- gelu
def gelu_rows(model, threads: int, tmp: Path) -> dict:
    """The whole call at batch 1 with the model's weights and each GELU, in eager vitlab and in ORT."""
    x = torch.randn(1, model.config.in_chans, *model.config.image_size)
    rows = {}
    for gelu in ("tanh", "exact"):
        twin = build_model(model.config.replace(gelu=gelu)).eval()
        twin.load_state_dict(model.state_dict())
        engine = TorchEngine(twin)
        session = ort_session(str(export_onnx(twin, tmp / f"{gelu}.onnx")), threads, spinning=False)
        feed = {session.get_inputs()[0].name: x.numpy()}
        rows[f"eager, {gelu} GELU"] = lambda engine=engine: engine(x)
        rows[f"ORT, {gelu} GELU"] = lambda session=session, feed=feed: session.run(None, feed)
    return rows


def gelu(model, threads: int, rounds: int, tmp: Path) -> None:
    ms = best_ms(gelu_rows(model, threads, tmp), rounds, 5)
    print("  whole call back to back with each GELU, same weights (fastest round, ms): "
          + ", ".join(f"{name} {t:.2f}" for name, t in ms.items()))
    for engine in ("eager", "ORT"):
        print(f"    {engine}: tanh costs {ms[f'{engine}, tanh GELU'] - ms[f'{engine}, exact GELU']:+.2f} ms against erf")


# ------------------------------------------------------------------------------------------------ unary
def unary(rounds: int) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(1 << 20)
        ops = {name: (lambda f=getattr(torch, name): f(x)) for name in ("exp", "tanh", "erf", "sigmoid")}
        ms = best_ms(ops, rounds, 3)
    finally:
        torch.set_num_threads(threads)
    print("  torch, one thread, 1M floats (fastest round, ns per element): "
          + ", ".join(f"{name} {t * 1e6 / (1 << 20):.2f}" for name, t in ms.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="vit-ti/16,vit-s/16")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch and ORT threads (default: torch's)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__}, {threads} threads, batch 1, "
          f"median of {args.rounds} interleaved rounds")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = vitlab.create_model(name).eval()
            print(name)
            if "pause" in parts:
                pause(model, threads, args.rounds, Path(tmp))
            if "products" in parts:
                products(model, threads, args.rounds)
            if "attention" in parts:
                attention(model, threads, args.rounds)
            if "gelu" in parts:
                gelu(model, threads, args.rounds, Path(tmp))
    if "unary" in parts:
        unary(args.rounds)


if __name__ == "__main__":
    main()
