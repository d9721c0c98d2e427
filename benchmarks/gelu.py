"""The official tanh GELU on the CPU: torch's kernel against its erf GELU and vitlab's exact routes
(models/gelu.py), at the activation shapes of the Fashion-MNIST ViT and ViT-Ti/16; then whole MLP blocks (fc1, GELU,
fc2) forward + backward as a training step runs them, in interleaved rounds (glibc's allocator tuned as vitlab's
commands tune it).

    python benchmarks/gelu.py               # torch's default threads
    python benchmarks/gelu.py --threads 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from vitlab.models import gelu
from vitlab.models.fast_linear import onednn_linear_available
from vitlab.models.gelu import SlopeSavingTanhGelu
from vitlab.models.vit import Mlp
from vitlab.runtime import tune_cpu_allocator

SHAPES = {"Fashion-MNIST ViT (128 x 50 tokens, 64 -> 128)": (6400, 64, 128),
          "ViT-Ti/16 (16 x 197 tokens, 192 -> 768)": (3152, 192, 768)}
# MLP blocks as training runs them: (batch, tokens, width, hidden)
MLP_SHAPES = {"Fashion-MNIST ViT, batch 128": (128, 50, 64, 128), "ViT-Ti/16, batch 32": (32, 197, 192, 768),
              "ViT-S/16, batch 32": (32, 197, 384, 1536)}


def ms(fn, reps: int = 30) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def fwd_bwd(act, h, g):
    def run():
        x = h.detach().requires_grad_()
        torch.autograd.grad(act(x), x, g)
    return run


def tanh_gelu(t: torch.Tensor) -> torch.Tensor:
    return F.gelu(t, approximate="tanh")


def report(label: str, rows: int, d_in: int, d_out: int) -> None:
    x, w, b = torch.randn(rows, d_in), torch.randn(d_out, d_in) * 0.05, torch.randn(d_out) * 0.01
    h, g = F.linear(x, w, b), torch.randn(rows, d_out)
    inference = {"GELU alone: torch erf": lambda: F.gelu(h),
                 "GELU alone: torch tanh": lambda: tanh_gelu(h),
                 "fc1 + GELU, inference: torch tanh": lambda: tanh_gelu(F.linear(x, w, b))}
    if onednn_linear_available():
        inference["fc1 + GELU, inference: vitlab (oneDNN epilogue)"] = (
            lambda: torch.ops.mkldnn._linear_pointwise(x, w, b, "gelu", [], "tanh"))
    train = {"GELU forward + backward: torch erf": fwd_bwd(F.gelu, h, g),
             "GELU forward + backward: torch tanh": fwd_bwd(tanh_gelu, h, g),
             "GELU forward + backward: vitlab (saved slope)": fwd_bwd(SlopeSavingTanhGelu.apply, h, g)}
    print(label)
    with torch.no_grad():
        for name, fn in inference.items():
            print(f"  {name:50s} {sorted(ms(fn) for _ in range(3))[1]:7.2f}")
    for name, fn in train.items():
        print(f"  {name:50s} {sorted(ms(fn) for _ in range(3))[1]:7.2f}")


def mlp_rounds(label: str, shape: tuple[int, int, int, int], rounds: int) -> None:
    """ms per forward + backward of one MLP block: torch's erf GELU, torch's tanh GELU kernel, vitlab's route."""
    b, n, d, hidden = shape
    torch.manual_seed(0)
    block = Mlp(d, hidden)
    x, g = torch.randn(b, n, d, requires_grad=True), torch.randn(b, n, d)
    tanh_act, erf_act = block.act, torch.nn.GELU()
    settings = {"torch erf GELU (not the official function)": (erf_act, True),
                "torch tanh GELU kernel": (tanh_act, False), "vitlab (official tanh GELU)": (tanh_act, True)}

    def step() -> None:
        block(x).backward(g)

    times: dict[str, list[float]] = {name: [] for name in settings}
    order, rng = list(settings), random.Random(0)
    for r in range(rounds + 1):
        rng.shuffle(order)
        for name in order:
            block.act, gelu.FAST_CPU_GELU = settings[name]
            start = time.perf_counter()
            for _ in range(3):
                step()
            if r:  # the first round warms up
                times[name].append((time.perf_counter() - start) / 3 * 1e3)
    block.act, gelu.FAST_CPU_GELU = tanh_act, True
    print(f"MLP block forward + backward, {label} ({b * n} x {d} -> {hidden} -> {d}), median of {rounds} rounds")
    for name, ts in times.items():
        print(f"  {name:50s} {statistics.median(ts):7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds of the MLP block timings")
    args = ap.parse_args()
    tune_cpu_allocator()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call (median of 3 runs of 30)")
    for label, shape in SHAPES.items():
        report(label, *shape)
    for label, shape in MLP_SHAPES.items():
        mlp_rounds(label, shape, args.rounds)


if __name__ == "__main__":
    main()
