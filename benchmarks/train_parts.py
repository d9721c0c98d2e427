"""Two parts of a training step timed on their own, each against the alternative vitlab did not choose.

1. Optimizer step of the Fashion-MNIST model (403k parameters): torch's AdamW default (per-tensor loop),
   `foreach=True` and `fused=True` (what `vitlab.train.optim.build_optimizer` uses).
2. The hybrid's patch projection (64 x 28 x 28 stem map -> 7 x 7 patches -> width 64), forward + backward:
   the strided convolution against `PatchEmbed._project_as_matmul` (what the hybrid uses).

Rounds alternate the candidates; medians are reported.

    python benchmarks/train_parts.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def fmnist_model():
    from vitlab.models.registry import create_model
    from vitlab.train.config import FMNIST_HYBRID

    return create_model("custom", num_classes=10, image_size=28, in_chans=1, seed=0, **FMNIST_HYBRID)


def median_ms(candidates: dict, rounds: int, calls: int) -> dict[str, float]:
    times = {k: [] for k in candidates}
    order = list(candidates)
    for r in range(rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            t = time.perf_counter()
            for _ in range(calls):
                candidates[k]()
            times[k].append((time.perf_counter() - t) / calls * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def optimizer_steps(rounds: int) -> dict[str, float]:
    from vitlab.train.optim import param_groups

    model = fmnist_model()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    steps = {}
    for name, kw in {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}.items():
        opt = torch.optim.AdamW(param_groups(model, 0.05), lr=1e-3, **kw)
        opt.step()
        steps[name] = opt.step
    return median_ms(steps, rounds, 20)


def patch_projection(rounds: int, batch: int) -> dict[str, float]:
    pe = fmnist_model().patch_embed
    feats = torch.randn(batch, 64, 28, 28, requires_grad=True)

    def conv():
        F.conv2d(feats, pe.proj.weight, pe.proj.bias, stride=pe.patch_size).sum().backward()

    def matmul():
        pe._project_as_matmul(feats)[0].sum().backward()

    for f in (conv, matmul):
        f()
    return median_ms({"convolution": conv, "matmul": matmul}, rounds, 5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32, help="images per patch-projection call")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, ms in optimizer_steps(args.rounds).items():
        print(f"AdamW step, {name:>8}: {ms:6.2f} ms")
    for name, ms in patch_projection(args.rounds, args.batch).items():
        print(f"patch projection fwd+bwd, {args.batch} images, {name:>11}: {ms:6.2f} ms")


if __name__ == "__main__":
    main()
