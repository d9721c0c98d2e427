"""What one forward pass costs beyond its arithmetic: a ViT of a real model's depth and head count with 8-wide
layers and 2 tokens (all of its time is per-operator work: Python, the dispatcher, kernel launches, thread
wake-ups), in eager PyTorch (`--engine torch`) and in ONNX Runtime (`--engine onnxruntime`), against the same
engines running the real model at batch 1; then the same small model called after idle gaps of 0-50 ms (how
fast each engine's worker threads come back from sleep).

    python benchmarks/overhead.py                       # ViT-Ti/16's depth; torch's default threads
    python benchmarks/overhead.py --model vit-b/16 --threads 1
    python benchmarks/overhead.py --profile             # where eager PyTorch's per-call time goes (cProfile)
    python benchmarks/overhead.py --kernels             # the real model at batch 1: kernel time per operator
                                                        # in each engine, and its matrix products timed alone
    python benchmarks/overhead.py --idle-ops            # one op (an add of 1M floats) as the 1st..6th op after
                                                        # idle pauses, 1 and 2 threads: how long the slow-down lasts
    OMP_WAIT_POLICY=ACTIVE python benchmarks/overhead.py --idle-ops   # workers that spin instead of sleeping
    python benchmarks/overhead.py --small-calls         # TorchEngine's one-thread rule for small calls
                                                        # (ONE_THREAD_MAX_FLOPS): one thread against all, by FLOPs
    python benchmarks/overhead.py --cold-ops            # one thread: the 1st..4th small op, and a whole call in
                                                        # each engine, after 50 ms of sleep, of a busy Python loop,
                                                        # of numpy work, of tiny torch calls (is it the threads?)
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import vitlab
from vitlab.engine import torch_engines
from vitlab.engine.choose import PAUSE_S
from vitlab.engine.ort import OrtEngine, build_fp32
from vitlab.engine.torch_engines import TorchEngine
from vitlab.models.fast_linear import PackedWeights, linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_gemm import linear_graph, session  # noqa: E402  (one Linear as an ONNX graph; a CPU session)
from linear import FMNIST  # noqa: E402  (the Fashion-MNIST-size ViT's config)
from ort_variants import op_times  # noqa: E402  (ORT's per-operator kernel time)


def engines(model: torch.nn.Module, size: int, threads: int, tmp: Path) -> dict:
    return {"torch": TorchEngine(model), "onnxruntime": OrtEngine(build_fp32(model, tmp, (size, size)), threads)}


def ms_after_idle(engine, x: torch.Tensor, gap_s: float, calls: int) -> float:
    """Median ms of a call made after the engine sat idle for gap_s (0: back to back)."""
    times = []
    for _ in range(calls):
        if gap_s:
            time.sleep(gap_s)
        start = time.perf_counter()
        engine(x)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def us_of_ops_after_idle(gap_s: float, ops: int = 6, repeats: int = 30) -> list[float]:
    """Median microseconds of the 1st..`ops`th add of two 1M-float tensors after each idle gap: how many operators
    a call pays for the threads' return (every parallel region waits for a worker that is slow to come back)."""
    a, b = torch.randn(1 << 20), torch.randn(1 << 20)
    times: list[list[float]] = [[] for _ in range(ops)]
    for _ in range(repeats):
        time.sleep(gap_s)
        for i in range(ops):
            start = time.perf_counter()
            a.add(b)
            times[i].append(time.perf_counter() - start)
    return [1e6 * statistics.median(ts) for ts in times]


def idle_ops(thread_counts: list[int], gaps: tuple[float, ...] = (0.0, 0.02, 0.05, 0.1)) -> None:
    print(f"torch {torch.__version__}; microseconds of the 1st..6th add of 1M floats after the idle gap")
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for gap in gaps:
            us = us_of_ops_after_idle(gap)
            print(f"threads {threads}  gap {gap * 1e3:5.0f} ms: " + " ".join(f"{u:7.0f}" for u in us))


def ms_per_call(model: torch.nn.Module, size: int, threads: int, calls: int,
                gaps: tuple[float, ...] = (0.0,)) -> dict[str, list[float]]:
    """Per engine, the median ms of a batch-1 call after each idle gap (0: back to back), each engine warmed up."""
    with tempfile.TemporaryDirectory() as tmp:
        x = torch.randn(1, model.config.in_chans, size, size)
        out = {}
        for name, engine in engines(model.eval(), size, threads, Path(tmp)).items():
            for _ in range(20):
                engine(x)
            out[name] = [ms_after_idle(engine, x, gap, calls) for gap in gaps]
        return out


def profile_eager(model: torch.nn.Module, calls: int = 200, top: int = 15) -> None:
    """cProfile of the small model in the torch engine: Python functions and the C++ operators they call."""
    import cProfile
    import pstats

    engine, x = TorchEngine(model.eval()), torch.randn(1, model.config.in_chans, 16, 16)
    for _ in range(20):
        engine(x)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        engine(x)
    profiler.disable()
    print(f"  cProfile of {calls} eager calls of the 8-wide model (the profiler itself adds to every Python call):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def eager_op_times(model: torch.nn.Module, x: torch.Tensor, calls: int) -> collections.Counter:
    """torch.profiler: ms of self CPU time per operator and call of the torch engine (after warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    engine = TorchEngine(model)
    for _ in range(10):
        engine(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            engine(x)
    return collections.Counter({e.key: e.self_cpu_time_total / 1e3 / calls for e in prof.key_averages()})


def ms_back_to_back(fn, calls: int = 100) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def block_products_alone(model: torch.nn.Module, tokens: int, threads: int, tmp: Path) -> dict[str, tuple[float, float]]:
    """Each linear layer of the first block on (tokens, in) alone, back to back: ms through vitlab's eager route
    (oneDNN, weights packed once) and through ORT's MatMul + Add."""
    out = {}
    packs = PackedWeights()
    block = model.blocks[0]
    for name, fc in (("qkv", block.attn.qkv), ("proj", block.attn.proj), ("fc1", block.mlp.fc1), ("fc2", block.mlp.fc2)):
        x = torch.randn(1, tokens, fc.in_features)
        with torch.inference_mode(), packs.active():
            eager = ms_back_to_back(lambda fc=fc, x=x: linear(x, fc))
        path = tmp / f"{name}.onnx"
        linear_graph(fc.in_features, fc.out_features, path)
        s, xn = session(path, threads), x[0].numpy()
        out[f"{name} {fc.in_features}->{fc.out_features}"] = (eager, ms_back_to_back(lambda s=s, xn=xn: s.run(None, {"x": xn})))
    return out


def kernels(model: torch.nn.Module, size: int, threads: int, calls: int = 20, top: int = 8) -> None:
    """Where the real model's batch-1 time goes in each engine, and whether its matrix products alone differ."""
    model = model.eval()
    x = torch.randn(1, model.config.in_chans, size, size)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        wall = ms_per_call(model, size, threads, calls)
        per_engine = {"torch (torch.profiler, self CPU time)": eager_op_times(model, x, calls),
                      "onnxruntime (ORT's profiler, kernel time)": op_times(
                          build_fp32(model, tmp / "graph", (size, size)), x.numpy(), threads, calls)}
        for (label, ops), name in zip(per_engine.items(), wall):
            print(f"  {label}: wall {wall[name][0]:.2f} ms per image, operators {sum(ops.values()):.2f} ms:")
            print("    " + ", ".join(f"{op} {ms:.2f}" for op, ms in ops.most_common(top)))
        tokens = model.pos_embed.shape[1]  # the trained grid's tokens, class token included
        alone = block_products_alone(model, tokens, threads, tmp)
        print(f"  one block's matrix products alone, {tokens} tokens, back to back (ms; torch oneDNN packed / ORT):")
        for name, (eager, ort_ms) in alone.items():
            print(f"    {name:16s} {eager:7.3f} / {ort_ms:7.3f}")
        eager_sum, ort_sum = (sum(v[i] for v in alone.values()) for i in (0, 1))
        print(f"    sum x {len(model.blocks)} blocks  {eager_sum * len(model.blocks):7.2f} / {ort_sum * len(model.blocks):7.2f}"
              "   (the last block computes the class token alone in both engines: a little less in the model)")


class ThreadRule:
    """The torch engine with its one-thread limit set to `max_flops` for its calls (0: always all threads)."""

    def __init__(self, engine: TorchEngine, max_flops: float):
        self.engine, self.max_flops = engine, max_flops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        saved = torch_engines.ONE_THREAD_MAX_FLOPS
        torch_engines.ONE_THREAD_MAX_FLOPS = self.max_flops
        try:
            return self.engine(x)
        finally:
            torch_engines.ONE_THREAD_MAX_FLOPS = saved


def small_calls(threads: int, rounds: int, cases: list[tuple[str, int]],
                gaps: tuple[float, ...] = (0.0, 0.005, 0.02, PAUSE_S)) -> None:
    """Per (model, batch) and idle gap before each call: images/s of the torch engine on one thread and on all,
    interleaved in a new random order each round (benchmarks/peers.py waits PAUSE_S before each call), and what
    the engine's rule (one thread up to ONE_THREAD_MAX_FLOPS) picks."""
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {threads} threads, median of {rounds} interleaved rounds; images/s; "
          f"rule: one thread up to {torch_engines.ONE_THREAD_MAX_FLOPS / 1e6:g} MFLOP")
    models = {name: vitlab.create_model("custom", **FMNIST) if name == "fmnist" else vitlab.create_model(name)
              for name in dict(cases)}
    rng = random.Random(0)
    one, all_ = "1 thread", f"{threads} threads"
    for name, batch in cases:
        engine = TorchEngine(models[name])
        cfg = engine.model.config
        x = torch.randn(batch, cfg.in_chans, *cfg.image_size)
        rows = {one: ThreadRule(engine, float("inf")), all_: ThreadRule(engine, 0.0)}
        for _ in range(max(3, 20 // batch)):
            for row in rows.values():
                row(x)
        for gap in gaps:
            times = {label: [] for label in rows}
            for _ in range(rounds):
                for label in rng.sample(list(rows), len(rows)):
                    time.sleep(gap)
                    start = time.perf_counter()
                    rows[label](x)
                    times[label].append(time.perf_counter() - start)
            speeds = {label: batch / statistics.median(ts) for label, ts in times.items()}
            print(f"  {name:10s} batch {batch:3d} {engine.flops(x) / 1e6:7.1f} MFLOP  after {gap * 1e3:2g} ms idle:  "
                  f"{one} {speeds[one]:7.1f}  {all_} {speeds[all_]:7.1f}  (x{speeds[one] / speeds[all_]:.2f})"
                  f"   rule picks: {one if engine.small(x) else all_}")


# What the caller does for 50 ms before the timed op: nothing, sleep, or keep the core busy with other work
WAITS = {
    "back to back": None,
    "sleep": lambda: time.sleep(0.05),
    "busy Python loop": lambda: _busy(lambda: None),
    "busy with numpy": lambda: _busy(lambda a=np.ones(6400, np.float32): a + a),
    "busy with 0-element torch adds": lambda: _busy(lambda e=torch.empty(0): e + e),
}


def _busy(work, seconds: float = 0.05) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        work()


def cold_ops(repeats: int = 30) -> None:
    """On one thread (no worker to wake), the 1st..4th call of a small op, and a whole batch-1 call of the
    Fashion-MNIST ViT in each engine, after each of WAITS: whether a pause costs the next calls because threads
    sleep or because the core ran other code meanwhile."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _cold_ops(repeats)
    finally:
        torch.set_num_threads(threads)


def _cold_ops(repeats: int) -> None:
    h, a, w, b = torch.randn(50, 128), torch.randn(50, 64), torch.randn(64, 192), torch.randn(192)
    ops = {"add of 50 x 128": lambda: h + h, "addmm 50 x 64 x 192": lambda: torch.addmm(b, a, w)}
    torch.manual_seed(0)
    model = vitlab.create_model("custom", **FMNIST).eval()
    x = torch.randn(1, 1, 28, 28)
    with tempfile.TemporaryDirectory() as tmp:
        calls = engines(model, 28, 1, Path(tmp))
        print(f"torch {torch.__version__}, 1 thread; median of {repeats} over waits of 50 ms")
        print("microseconds of the 1st..4th op after the wait:")
        for wait_name, wait in WAITS.items():
            for op_name, op in ops.items():
                times: list[list[float]] = [[] for _ in range(4)]
                for _ in range(repeats):
                    if wait:
                        wait()
                    for i in range(4):
                        start = time.perf_counter()
                        op()
                        times[i].append(time.perf_counter() - start)
                print(f"  {wait_name:32s} {op_name:20s} " + " ".join(f"{1e6 * statistics.median(t):7.1f}"
                                                                    for t in times))
        print("ms of a Fashion-MNIST ViT call at batch 1 after the wait (engines on one thread):")
        for wait_name, wait in WAITS.items():
            ms = {name: [] for name in calls}
            for _ in range(repeats):
                for name in random.sample(list(calls), len(calls)):
                    if wait:
                        wait()
                    start = time.perf_counter()
                    calls[name](x)
                    ms[name].append(1e3 * (time.perf_counter() - start))
            print(f"  {wait_name:32s} " + "  ".join(f"{name} {statistics.median(t):6.3f}" for name, t in ms.items()))
        print("(back to back: the calls of the two engines interleave in a random order, so the other engine's call "
              "may come right before)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit-ti/16")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--profile", action="store_true", help="profile the small model's eager calls instead")
    ap.add_argument("--kernels", action="store_true",
                    help="the real model's kernel time per operator in each engine, and its products alone")
    ap.add_argument("--idle-ops", action="store_true",
                    help="one op timed as the 1st..6th after idle gaps, with 1 and with --threads threads")
    ap.add_argument("--small-calls", action="store_true",
                    help="the torch engine on one thread against --threads threads, Fashion-MNIST ViT batches 1-32 "
                         "and ViT-Ti/16 batch 1, and what its one-thread rule picks")
    ap.add_argument("--cold-ops", action="store_true",
                    help="one thread: small ops and a whole call after 50 ms of sleep or of other work")
    args = ap.parse_args()
    if args.cold_ops:
        cold_ops()
        return
    if args.small_calls:
        small_calls(args.threads, args.rounds, [("fmnist", b) for b in (1, 2, 4, 8, 16, 32)] + [("vit-ti/16", 1)])
        return
    if args.idle_ops:
        idle_ops(sorted({1, args.threads}))
        return
    torch.set_num_threads(args.threads)
    real = vitlab.create_model(args.model)
    cfg = real.config
    # Same depth, heads and classes; 8-wide heads, a 16 px image cut into one patch: 2 tokens.
    tiny = vitlab.create_model("custom", depth=cfg.depth, heads=cfg.heads, dim=8 * cfg.heads, mlp_dim=32 * cfg.heads,
                               patch_size=16, image_size=16, num_classes=cfg.num_classes)
    if args.profile:
        profile_eager(tiny)
        return
    if args.kernels:
        print(f"torch {torch.__version__}, {args.threads} threads, {args.model}, batch 1")
        kernels(real, cfg.image_size[0], args.threads)
        return
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.rounds} calls back to back, batch 1, "
          "ms per image")
    gaps = (0.0, 0.001, 0.005, 0.05)
    small = ms_per_call(tiny, 16, args.threads, args.rounds, gaps)
    whole = ms_per_call(real, cfg.image_size[0], args.threads, max(args.rounds // 4, 5))
    for name, (overhead, *_) in small.items():
        print(f"  {name:12s} {args.model} {whole[name][0]:7.2f}   same depth, 8-wide, 2 tokens {overhead:6.2f}"
              f"   ({100 * overhead / whole[name][0]:.0f} % of the real model's time)")
    print("  the 8-wide model after an idle gap of " + ", ".join(f"{g * 1e3:g} ms" for g in gaps) + " (ms per call):")
    for name, times in small.items():
        print(f"  {name:12s} " + "  ".join(f"{ms:7.2f}" for ms in times))


if __name__ == "__main__":
    main()
