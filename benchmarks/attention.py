"""The attention core (softmax(q k^T / sqrt(d)) v) by torch's fused kernel against the explicit form, from the
fused qkv projection's output exactly as `vitlab.models.vit.Attention` cuts it, forward (inference) and
forward + backward (training), over a range of token counts and head sizes. `vitlab.models.attention_core`
uses the explicit form up to EXPLICIT_MAX_TOKENS tokens on the CPU; this is where that number comes from.

    python benchmarks/attention.py                      # 2 threads, median of 15 interleaved rounds
    python benchmarks/attention.py --threads 1 --rounds 25
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from vitlab.models.attention_core import explicit_attention

# (label, batch, tokens, heads, head size): the models' own shapes first, then a sweep of token counts
SHAPES = [
    ("Fashion-MNIST ViT, 128 images", 128, 50, 4, 16),
    ("CIFAR-size ViT (32 px / 4), 128 images", 128, 65, 4, 16),
    ("ViT-B/32 at 224 px, 16 images", 16, 50, 12, 64),
    ("ViT-B/32 at 384 px, 8 images", 8, 145, 12, 64),
    ("ViT-Ti/16 at 224 px, 16 images", 16, 197, 3, 64),
    ("ViT-B/16 at 224 px, 1 image", 1, 197, 12, 64),
] + [("sweep, 64 images, 4 x 16", 64, n, 4, 16) for n in (17, 33, 65, 101, 129, 145, 197)] + [
    ("sweep, 16 images, 6 x 64", 16, n, 6, 64) for n in (33, 65, 101, 129, 145, 197)]


def cut(qkv: torch.Tensor, heads: int) -> list[torch.Tensor]:
    b, n, three_d = qkv.shape
    return [t.reshape(b, n, heads, three_d // 3 // heads).transpose(1, 2) for t in qkv.chunk(3, dim=-1)]


def fused(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def explicit(q, k, v):
    return explicit_attention(q, k, v)[0]


def timed(fn, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure(batch: int, tokens: int, heads: int, head_size: int, rounds: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(batch, tokens, 3 * heads * head_size, generator=gen, requires_grad=True)
    grad = torch.randn(batch, heads, tokens, head_size, generator=gen)
    cases = {}
    for name, core in (("fused", fused), ("explicit", explicit)):
        def forward(core=core):
            with torch.inference_mode():
                core(*cut(qkv, heads))

        def train(core=core):
            core(*cut(qkv, heads)).backward(grad)
            qkv.grad = None

        cases[f"{name} fwd"], cases[f"{name} fwd+bwd"] = forward, train
    for fn in cases.values():  # warm-up
        fn()
    times = {key: [] for key in cases}
    for r in range(rounds):  # interleaved, the order turning every round
        keys = list(cases)[r % len(cases):] + list(cases)[:r % len(cases)]
        for key in keys:
            times[key] += timed(cases[key], 1)
    return {key: statistics.median(t) * 1e3 for key, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.rounds} rounds, ms")
    print(f"{'shape':42s} {'tokens':>6s} {'heads':>7s} | {'fused':>7s} {'explicit':>8s} {'ratio':>6s} | "
          f"{'fused':>7s} {'explicit':>8s} {'ratio':>6s}")
    print(f"{'':42s} {'':>6s} {'':>7s} | {'forward':^24s} | {'forward + backward':^24s}")
    for label, batch, tokens, heads, head_size in SHAPES:
        t = measure(batch, tokens, heads, head_size, args.rounds)
        fwd = t["fused fwd"] / t["explicit fwd"]
        train = t["fused fwd+bwd"] / t["explicit fwd+bwd"]
        print(f"{label:42s} {tokens:6d} {heads:3d} x{head_size:3d} | {t['fused fwd']:7.2f} {t['explicit fwd']:8.2f} "
              f"{fwd:5.2f}x | {t['fused fwd+bwd']:7.2f} {t['explicit fwd+bwd']:8.2f} {train:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
