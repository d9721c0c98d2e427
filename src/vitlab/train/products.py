"""Which route a CPU fp32 training run's matrix products take: `--products auto|onednn|torch`.

The forward and input-gradient products of the linear layers run through oneDNN (`models/fast_linear.py`) or
torch's F.linear (MKL); the weight gradients always through `mm`. Which is faster depends on the CPU, not its
flags: on the 2-core AMD EPYC VM oneDNN was ahead (ViT-Ti/16 input gradient 24.2 against 39.9 ms a block), on the
2-core Intel Xeon VM MKL (ViT-B/16, batch 32: 331 against 447 ms a block; docs/benchmarks.md). So `auto` times
both routes on the model's own product shapes at the run's micro-batch, once per machine, torch version, thread
count and shapes, keeps the ratio in the user's cache (as precision `auto` keeps its bf16 probe), and takes
F.linear only where it measured at least TORCH_MIN_SPEEDUP faster: a small difference is within a VM's noise and
the oneDNN route also fuses the GELU's backward into fc2's product. The choice is recorded in the run and
restored on resume, since exact resume needs the same kernels. VITLAB_TORCH_PRODUCTS_SPEEDUP=X skips the
timing (tests, or to pin a decision); VITLAB_RETIME=1 times again.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.models import fast_linear
from vitlab.runtime import machine_key, measured_once, timing_input

TORCH_MIN_SPEEDUP = 1.05
MAX_TIMED_ROWS = 8192  # larger micro-batches are timed at this many rows: the choice, not the exact speed, matters
CACHE_NAME = "training_products"  # ~/.cache/vitlab/machine/training_products.json


def product_shapes(model: nn.Module) -> Counter:
    """(in, out) of every trainable plain linear layer, with how many layers have it."""
    return Counter((m.in_features, m.out_features) for m in model.modules()
                   if type(m) is nn.Linear and m.weight.requires_grad)


def tokens_per_image(model: nn.Module) -> int:
    """Rows each image gives a block's products: the ViT's position embedding length, else one (a head)."""
    pos = getattr(model, "pos_embed", None)
    return int(pos.shape[1]) if isinstance(pos, torch.Tensor) and pos.dim() == 3 else 1


def _route_seconds(route: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> float:
    start = time.perf_counter()
    if route == "onednn":
        fast_linear.onednn_product(x, w, b)
        fast_linear.onednn_product(g, w.t(), None)
    else:
        F.linear(x, w, b)
        g.mm(w)
    return time.perf_counter() - start


def measure_torch_speedup(shapes: Counter, rows: int, rounds: int = 5) -> float:
    """Time of the oneDNN route / time of F.linear for forward + input gradient of every shape (> 1: F.linear
    faster), each layer counted; routes alternate, the best of `rounds` each after a warm-up."""
    with torch.no_grad():
        best = {"onednn": 0.0, "torch": 0.0}
        for (d_in, d_out), count in shapes.items():
            x, g = timing_input(rows, d_in), timing_input(rows, d_out)
            w, b = timing_input(d_out, d_in) * d_in ** -0.5, torch.zeros(d_out)
            for route in best:
                _route_seconds(route, x, w, b, g)
            times = {route: [] for route in best}
            for _ in range(rounds):
                for route in best:
                    times[route].append(_route_seconds(route, x, w, b, g))
            for route in best:
                best[route] += count * min(times[route])
    return best["onednn"] / best["torch"]


def torch_products_speedup(model: nn.Module, micro_batch: int) -> float:
    """measure_torch_speedup for this model at this micro-batch, from the user's cache where measured before."""
    forced = os.environ.get("VITLAB_TORCH_PRODUCTS_SPEEDUP")
    if forced:
        return float(forced)
    shapes = product_shapes(model)
    rows = min(micro_batch * tokens_per_image(model), MAX_TIMED_ROWS)
    key = f"{machine_key()} | {rows} rows | " + " ".join(f"{i}x{o}*{n}" for (i, o), n in sorted(shapes.items()))

    def measure() -> float:
        print(f"vitlab: timing the training products both ways on this machine ({rows} rows; once, then cached)",
              file=sys.stderr, flush=True)
        return measure_torch_speedup(shapes, rows)

    return measured_once(CACHE_NAME, key, measure)


def resolve_products(choice: str, device: torch.device, precision: str, model: nn.Module, micro_batch: int) -> str:
    """The route a run's training products take: `choice` itself unless it is "auto" (module docstring). Off the
    CPU, in other precisions or without oneDNN the route does not apply; "onednn" is recorded, as before."""
    if choice != "auto":
        return choice
    if (device.type != "cpu" or precision != "fp32" or not fast_linear.onednn_linear_available()
            or not product_shapes(model)):
        return "onednn"
    return "torch" if torch_products_speedup(model, micro_batch) >= TORCH_MIN_SPEEDUP else "onednn"
