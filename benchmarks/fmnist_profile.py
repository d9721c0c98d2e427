"""Where the Fashion-MNIST-size ViT's eager call goes (`--engine torch`, batch 32 by default), and the two kernel
timings that decide what an exact change could win there (docs/benchmarks.md, "Batch 32 with a row order per
setting"):

- the torch profiler's self-time shares by operator over `--calls` calls;
- the call back to back and after a 50 ms pause, in `--repeats` repeats (this VM drifts from one to the next);
- torch's `exp` against `exp2` and `softmax` on the attention scores' shape (exp2 is faster, but a softmax through
  it would not give the same bits, so it is not a route the exact path can take), and that softmax through exp2
  written out in torch's operators, with its largest difference from `torch.softmax`.

    python benchmarks/fmnist_profile.py > docs/results/fmnist_profile_b32.txt
"""

from __future__ import annotations

import argparse
import time

import torch
from direct_inference import FMNIST, model_and_images

from vitlab.engine.torch_engines import TorchEngine
from vitlab.runtime import tune_cpu_allocator


def shares(engine: TorchEngine, x: torch.Tensor, calls: int) -> list[tuple[str, float, int]]:
    """(operator, share of the profiled self time, calls) for the operators above 1 %."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            engine(x)
    rows = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()]
    total = sum(t for _, t, _ in rows)
    return [(k, t / total, n) for k, t, n in sorted(rows, key=lambda r: -r[1]) if t / total >= 0.01]


def call_times(engine: TorchEngine, x: torch.Tensor, n: int = 50) -> tuple[float, float]:
    """(ms a call back to back, ms a call after a 50 ms pause)."""
    t = time.perf_counter()
    for _ in range(n):
        engine(x)
    back = (time.perf_counter() - t) / n
    paused = []
    for _ in range(20):
        time.sleep(0.05)
        t = time.perf_counter()
        engine(x)
        paused.append(time.perf_counter() - t)
    return 1e3 * back, 1e3 * sorted(paused)[len(paused) // 2]


def softmax_through_exp2(s: torch.Tensor) -> torch.Tensor:
    """softmax(s) as exp2(s * log2(e) - max) / sum: the same function, each step a kernel of its own."""
    t = s * 1.4426950408889634
    e = torch.exp2(t - t.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def kernel_us(fn, n: int = 300) -> float:
    """Fastest of 5 rounds, microseconds a call."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return 1e6 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tune_cpu_allocator()
    model, x = model_and_images("fmnist", args.batch)
    engine = TorchEngine(model)
    for _ in range(30):
        engine(x)
    print(f"# python benchmarks/fmnist_profile.py --batch {args.batch}; torch {torch.__version__}, "
          f"{args.threads} threads; the Fashion-MNIST ViT {FMNIST}")
    print(f"profiler self-time shares over {args.calls} calls (operators above 1 %):")
    for name, share, count in shares(engine, x, args.calls):
        print(f"  {name:32s} {100 * share:5.1f} %  {count // args.calls:3d} calls a forward")
    for r in range(args.repeats):
        back, paused = call_times(engine, x)
        print(f"repeat {r}: {back:.2f} ms a call back to back, {paused:.2f} ms after a 50 ms pause (median of 20)")
    heads, tokens = FMNIST["heads"], FMNIST["image_size"] ** 2 // FMNIST["patch_size"] ** 2 + 1
    scores = torch.randn(args.batch * heads, tokens, tokens)
    with torch.inference_mode():
        for name, fn in (("exp", torch.exp), ("exp2", torch.exp2), ("softmax", lambda s: torch.softmax(s, -1)),
                         ("softmax through exp2, written out", softmax_through_exp2)):
            print(f"{name:8s} on {tuple(scores.shape)}: {kernel_us(lambda fn=fn: fn(scores)):.1f} us")
        gap = (softmax_through_exp2(scores) - torch.softmax(scores, -1)).abs().max().item()
        print(f"softmax through exp2 against torch.softmax: largest difference {gap:.1e}")


if __name__ == "__main__":
    main()
