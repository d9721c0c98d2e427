"""The model's linear layers through oneDNN (models/fast_linear.py) against torch's F.linear: each matrix product
of a ViT block alone, then whole models (inference and training steps) with the route on and off, interleaved in
one process (50 ms pause before each timed call), median of the rounds.

    python benchmarks/linear.py                 # torch's default threads
    python benchmarks/linear.py --threads 1 --skip-products
    python benchmarks/linear.py --threads 1 --skip-products --models vit-ti/16 --no-training --pause-ms 0
    python benchmarks/linear.py --small         # the smallest inference products: oneDNN (packed) against F.linear,
                                                # and whole models with fast_linear's small-product rule on and off;
                                                # then fc1 + tanh GELU likewise (gelu.py's small-product rule)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

import vitlab
from vitlab.models import fast_linear, gelu

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


# (rows, in, out): the Fashion-MNIST ViT's products at batch 1-16 (50 tokens a image), one-row products of a
# class-token-only last block (ViT-Ti/16, S/16, B/16 sizes), ViT-Ti/16's at batch 1
SMALL_PRODUCTS = ([(r, 64, 192) for r in (50, 100, 200, 400, 800)] + [(r, 128, 64) for r in (50, 100, 200, 400, 800)]
                  + [(1, 192, 192), (1, 192, 768), (1, 768, 192), (1, 384, 1536), (1, 1536, 384), (1, 768, 3072),
                     (1, 3072, 768), (197, 192, 192), (197, 192, 576)])


# (rows, in, out) of fc1 + GELU: the Fashion-MNIST ViT's at batch 1-16, one-row products of a class-token-only last
# block (Ti/16, S/16, B/16), a few rows of B/16 width, ViT-Ti/16's at batch 1
SMALL_GELU_PRODUCTS = ([(r, 64, 128) for r in (50, 100, 200, 400, 800)]
                       + [(1, 192, 768), (1, 384, 1536), (1, 768, 3072), (2, 768, 3072), (4, 768, 3072),
                          (197, 192, 768)])


def _product_routes(m: int, k: int, n: int, act: str) -> tuple[dict, torch.Tensor]:
    """oneDNN with the weight packed (what --engine torch runs) and F.linear (then torch's tanh GELU for "gelu"),
    and the (out, in) weight they multiply by."""
    x, w, b = torch.randn(1, m, k), torch.randn(n, k) * k ** -0.5, torch.randn(n)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
    if act == "gelu":
        return {"oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "gelu", [], "tanh"),
                "F.linear": lambda: F.gelu(F.linear(x, w, b), approximate="tanh")}, w
    return {"oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""),
            "F.linear": lambda: F.linear(x, w, b)}, w


def small_products(rounds: int, calls: int = 20, act: str = "none") -> None:
    """Microseconds per inference product, back to back (`calls` in a row, interleaved in a random order each round):
    oneDNN with the weight packed against F.linear (with act "gelu": fc1 + tanh GELU, fused in oneDNN against
    F.linear and torch's GELU); and the route the rule picks."""
    what = "fc1 + tanh GELU" if act == "gelu" else "inference products"
    print(f"small {what}, us per product back to back: oneDNN packed / F.linear (ratio), rule picks")
    rng = random.Random(0)
    for m, k, n in SMALL_GELU_PRODUCTS if act == "gelu" else SMALL_PRODUCTS:
        routes, w = _product_routes(m, k, n, act)
        times = {label: [] for label in routes}
        with torch.inference_mode():
            for run in routes.values():
                for _ in range(calls):
                    run()
            for _ in range(rounds):
                for label in rng.sample(list(routes), len(routes)):
                    start = time.perf_counter()
                    for _ in range(calls):
                        routes[label]()
                    times[label].append((time.perf_counter() - start) / calls)
        us = {label: 1e6 * statistics.median(ts) for label, ts in times.items()}
        small = gelu.small_gelu_product(m, w) if act == "gelu" else fast_linear.small_product(m, w)
        print(f"  {m:4d} x {k:4d} -> {n:4d} {m * k * n / 1e6:6.2f} M MAC:  {us['oneDNN']:7.1f} / {us['F.linear']:7.1f}"
              f" (x{us['F.linear'] / us['oneDNN']:.2f})   {'F.linear' if small else 'oneDNN'}")


def small_rule_models(rounds: int, rule: str = "products") -> None:
    """Whole models in --engine torch with a small-product rule as shipped and off (every product, or with rule
    "gelu" every fc1 + GELU, through oneDNN), interleaved, after PAUSE_S idle and back to back: images/s."""
    from vitlab.engine.torch_engines import TorchEngine

    print(f"whole models (--engine torch), images/s: small-{'GELU-' if rule == 'gelu' else ''}product rule off / on"
          " (ratio)")
    module = gelu if rule == "gelu" else fast_linear
    limits = (("SMALL_GELU_PRODUCT_MACS", "SMALL_FEW_ROW_GELU_PRODUCT_MACS") if rule == "gelu"
              else ("SMALL_PRODUCT_MACS", "SMALL_FEW_ROW_PRODUCT_MACS"))
    shipped = [getattr(module, name) for name in limits]
    rng = random.Random(0)
    fmnist = vitlab.create_model("custom", **FMNIST)
    for label, model, batch in [("Fashion-MNIST ViT", fmnist, b) for b in (1, 2, 8, 32)] + [
            ("vit-ti/16", vitlab.create_model("vit-ti/16"), 1)]:
        engine, cfg = TorchEngine(model), model.config
        x = torch.randn(batch, cfg.in_chans, *cfg.image_size)
        out = []
        for pause in (PAUSE_S, 0.0):
            times = {False: [], True: []}
            for _ in range(rounds):
                for on in rng.sample([False, True], 2):
                    for name, value in zip(limits, shipped if on else (0, 0)):
                        setattr(module, name, value)
                    engine(x)  # a call of its own with the route set: the first after a change is not timed
                    time.sleep(pause)
                    start = time.perf_counter()
                    engine(x)
                    times[on].append(time.perf_counter() - start)
            for name, value in zip(limits, shipped):
                setattr(module, name, value)
            off, on = (batch / statistics.median(times[k]) for k in (False, True))
            out.append(f"after {pause * 1e3:g} ms idle {off:8.1f} / {on:8.1f} (x{on / off:.2f})")
        print(f"  {label:18s} batch {batch:3d}:  " + "   ".join(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--skip-products", action="store_true")
    ap.add_argument("--models", default="vit-ti/16,vit-s/16,vit-b/16", help="inference models, comma-separated")
    ap.add_argument("--no-training", action="store_true", help="leave out the training-step rows")
    ap.add_argument("--pause-ms", type=float, default=50, help="idle time before each timed call")
    ap.add_argument("--small", action="store_true",
                    help="the smallest inference products and the small-product rule on whole models instead")
    args = ap.parse_args()
    global PAUSE_S
    PAUSE_S = args.pause_ms / 1e3
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.pause_ms:g} ms pause before each timed call")
    if args.small:
        small_products(max(args.rounds, 11))
        small_rule_models(max(args.rounds, 21))
        small_products(max(args.rounds, 11), act="gelu")
        small_rule_models(max(args.rounds, 21), rule="gelu")
        return
    if not args.skip_products:
        products(args.rounds)
    models(args.rounds, args.models.split(","), not args.no_training)


if __name__ == "__main__":
    main()
