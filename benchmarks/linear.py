"""The model's linear layers through oneDNN (models/fast_linear.py) against torch's F.linear: each matrix product
of a ViT block alone, then whole models (inference and training steps) with the route on and off, interleaved in
one process (50 ms pause before each timed call), median of the rounds.

    python benchmarks/linear.py                 # torch's default threads
    python benchmarks/linear.py --threads 1 --skip-products
    python benchmarks/linear.py --threads 1 --skip-products --models vit-ti/16 --no-training --pause-ms 0
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import vitlab
from vitlab.models import fast_linear

# (tokens, in, out) of each block's products: qkv, proj, fc1, fc2
PRODUCTS = {
    "ViT-B/16 batch 1": (197, 768, 3072),
    "ViT-B/16 batch 32": (6304, 768, 3072),
    "ViT-Ti/16 batch 16 (training)": (3152, 192, 768),
    "Fashion-MNIST ViT batch 128 (training)": (6400, 64, 128),
}
FMNIST = dict(image_size=28, patch_size=4, dim=64, depth=6, heads=4, mlp_dim=128, num_classes=10, in_chans=1)


PAUSE_S = 0.05  # before each timed call, as benchmarks/peers.py does (--pause-ms)


def timed(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        time.sleep(PAUSE_S)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def block_shapes(tokens: int, dim: int, hidden: int) -> list[tuple[int, int, int]]:
    return [(tokens, dim, 3 * dim), (tokens, dim, dim), (tokens, dim, hidden), (tokens, hidden, dim)]


def product_times(m: int, k: int, n: int, rounds: int) -> dict[str, tuple[float, float]]:
    """ms of each product of one linear layer (tokens m, in k, out n): torch's route / oneDNN's."""
    mk = torch.ops.mkldnn._linear_pointwise
    x, w, b, g = torch.randn(m, k), torch.randn(n, k), torch.randn(n), torch.randn(m, n)
    pairs = {"forward": (lambda: F.linear(x, w, b), lambda: mk(x, w, b, "none", [], "")),
             "input grad": (lambda: g.mm(w), lambda: mk(g, w.t(), None, "none", [], "")),
             "weight grad": (lambda: g.t().mm(x), lambda: mk(g.t(), x.t(), None, "none", [], ""))}
    return {name: (timed(ref, rounds) * 1e3, timed(ours, rounds) * 1e3) for name, (ref, ours) in pairs.items()}


def products(rounds: int) -> None:
    """ms per block for each product, summed over the block's four linear layers."""
    print("product times per block (ms, summed over qkv, proj, fc1, fc2): torch / oneDNN")
    for label, (tokens, dim, hidden) in PRODUCTS.items():
        sums = {k: [0.0, 0.0] for k in ("forward", "input grad", "weight grad")}
        for shape in block_shapes(tokens, dim, hidden):
            for name, (ref, ours) in product_times(*shape, rounds).items():
                sums[name][0] += ref
                sums[name][1] += ours
        print(f"  {label:40s} " + "  ".join(f"{k} {a:.2f} / {b:.2f}" for k, (a, b) in sums.items()))


def interleaved(fn, rounds: int) -> tuple[float, float]:
    """Seconds per call with the route off and on, the order turning every round."""
    times = {False: [], True: []}
    for r in range(rounds):
        for route in ((False, True) if r % 2 else (True, False)):
            fast_linear.ONEDNN_LINEAR = route
            times[route].append(timed(fn, 1))
    fast_linear.ONEDNN_LINEAR = True
    return statistics.median(times[False]), statistics.median(times[True])


def inference(name: str, batch: int, rounds: int) -> tuple[float, float]:
    model = vitlab.create_model(name).eval()
    x = torch.randn(batch, 3, 224, 224)
    with torch.inference_mode():
        return interleaved(lambda: model(x), rounds)


def training(name: str, kw: dict, batch: int, shape: tuple[int, ...], rounds: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = vitlab.create_model(name, **kw).train()
    opt = torch.optim.AdamW(model.parameters(), 1e-4)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return interleaved(step, rounds)


def models(rounds: int, names: list[str], train: bool) -> None:
    print("whole models, images/s: F.linear / oneDNN (ratio)")
    for name in names:
        for batch in (1, 32):
            off, on = inference(name, batch, rounds)
            print(f"  {name} inference, batch {batch:3d}: {batch / off:8.2f} / {batch / on:8.2f} (x{off / on:.3f})")
    for label, name, kw, batch, shape in (("Fashion-MNIST ViT", "custom", FMNIST, 128, (1, 28, 28)),
                                          ("vit-ti/16", "vit-ti/16", {}, 16, (3, 224, 224)))[:2 if train else 0]:
        off, on = training(name, kw, batch, shape, rounds)
        print(f"  {label} training step, batch {batch:3d}: {batch / off:8.2f} / {batch / on:8.2f} (x{off / on:.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--skip-products", action="store_true")
    ap.add_argument("--models", default="vit-ti/16,vit-s/16,vit-b/16", help="inference models, comma-separated")
    ap.add_argument("--no-training", action="store_true", help="leave out the training-step rows")
    ap.add_argument("--pause-ms", type=float, default=50, help="idle time before each timed call")
    args = ap.parse_args()
    global PAUSE_S
    PAUSE_S = args.pause_ms / 1e3
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.pause_ms:g} ms pause before each timed call")
    if not args.skip_products:
        products(args.rounds)
    models(args.rounds, args.models.split(","), not args.no_training)


if __name__ == "__main__":
    main()
