"""The patch embedding in inference: oneDNN's strided convolution against the same projection as a product of
patches (`PatchEmbed._inference_product`: cut into patches, then `fast_linear.product`, oneDNN with the packed
weight or F.linear for the smallest), first the projection alone, then whole models in `--engine torch` with the
product route off and on, timed as `--engine auto` times its candidates (interleaved, a pause before each call,
median of the rounds).

    python benchmarks/patch_embed.py                  # torch's default threads
    python benchmarks/patch_embed.py --threads 1 --rounds 25
    python benchmarks/patch_embed.py --models r50+vit-b/16 --batches 1   # a hybrid: its projection on the CNN's
                                                                          # features, F.linear / product
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import vitlab
from vitlab.engine import choose
from vitlab.engine.torch_engines import TorchEngine
from vitlab.models import vit
from vitlab.runtime import tune_cpu_allocator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linear import FMNIST  # noqa: E402  (the Fashion-MNIST-size ViT's config)

MODELS = {"vit-ti/16": {}, "vit-s/16": {}, "vit-b/16": {}, "vit-b/32": {}, "fmnist": FMNIST}
DEFAULT_MODELS = ",".join(MODELS)


def model_and_images(name: str, batch: int) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = vitlab.create_model("custom", **MODELS[name]) if MODELS.get(name) else vitlab.create_model(name)
    cfg = model.config
    return model.eval(), torch.randn(batch, cfg.in_chans, *cfg.image_size)


def with_route(fn, on: bool):
    def run(*args):
        vit.PATCH_PRODUCT = on
        try:
            return fn(*args)
        finally:
            vit.PATCH_PRODUCT = True
    return run


def projection_alone(name: str, batch: int, rounds: int) -> tuple[float, float, float]:
    """us per call of the patch embedding (convolution, product) under an engine's packed weights, and the largest
    token difference relative to the largest token."""
    model, x = model_and_images(name, batch)
    engine = TorchEngine(model)
    embed = model.patch_embed
    if embed.cnn is not None:  # a hybrid: the projection alone, on its CNN's feature map (F.linear without the route)
        with torch.inference_mode():
            x = embed.cnn(x)

    def call(images):
        with torch.inference_mode(), engine.packed.active():
            return embed._project_as_matmul(images)[0] if embed.cnn is not None else embed(images)[0]

    conv, product = with_route(call, False), with_route(call, True)
    ref, new = conv(x), product(x)
    for fn in (conv, product):
        fn(x)
    times = {conv: [], product: []}
    for _ in range(rounds):
        for fn in (conv, product):
            start = time.perf_counter()
            for _ in range(5):
                fn(x)
            times[fn].append((time.perf_counter() - start) / 5)
    med = {fn: 1e6 * statistics.median(t) for fn, t in times.items()}
    return med[conv], med[product], float((new - ref).abs().max() / ref.abs().max())


def whole_model(name: str, batch: int, rounds: int) -> tuple[float, float]:
    model, x = model_and_images(name, batch)
    engine = TorchEngine(model)
    speeds = choose.interleaved_speeds({"conv": with_route(engine, False), "product": with_route(engine, True)},
                                       x, rounds)
    return speeds["conv"], speeds["product"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--models", default=DEFAULT_MODELS, help="also hybrids, e.g. r50+vit-b/16")
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tune_cpu_allocator()  # as every vitlab command on the CPU runs
    names, batches = args.models.split(","), [int(b) for b in args.batches.split(",")]
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.rounds} rounds")
    print("the patch embedding alone, us per call: convolution / product (ratio); largest token difference / "
          "largest token")
    for name in names:
        for batch in batches:
            conv, product, diff = projection_alone(name, batch, args.rounds)
            print(f"  {name:10s} batch {batch:3d}: {conv:9.1f} / {product:9.1f}  (x{conv / product:.2f})  {diff:.1e}",
                  flush=True)
    print("whole model, --engine torch, images/s: convolution / product (ratio)")
    for name in names:
        for batch in batches:
            conv, product = whole_model(name, batch, args.rounds)
            print(f"  {name:10s} batch {batch:3d}: {conv:8.2f} / {product:8.2f}  (x{product / conv:.3f})", flush=True)


if __name__ == "__main__":
    main()
