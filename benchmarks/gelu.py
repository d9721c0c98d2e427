"""The official tanh GELU on the CPU: torch's kernel against its erf GELU and vitlab's two exact routes
(models/gelu.py), at the activation shapes of the Fashion-MNIST ViT and ViT-Ti/16.

    python benchmarks/gelu.py               # torch's default threads
    python benchmarks/gelu.py --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from vitlab.models.fast_linear import onednn_linear_available
from vitlab.models.gelu import SigmoidFormTanhGelu

SHAPES = {"Fashion-MNIST ViT (128 x 50 tokens, 64 -> 128)": (6400, 64, 128),
          "ViT-Ti/16 (16 x 197 tokens, 192 -> 768)": (3152, 192, 768)}


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
             "GELU forward + backward: vitlab (x * sigmoid(2u))": fwd_bwd(SigmoidFormTanhGelu.apply, h, g)}
    print(label)
    with torch.no_grad():
        for name, fn in inference.items():
            print(f"  {name:50s} {sorted(ms(fn) for _ in range(3))[1]:7.2f}")
    for name, fn in train.items():
        print(f"  {name:50s} {sorted(ms(fn) for _ in range(3))[1]:7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call (median of 3 runs of 30)")
    for label, shape in SHAPES.items():
        report(label, *shape)


if __name__ == "__main__":
    main()
