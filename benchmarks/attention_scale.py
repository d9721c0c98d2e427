"""The explicit attention route's scale, `--engine torch`: (q * scale) @ k^T as its own multiply and then the
product (the form before), against the product with the scale as its alpha (`attention_core._scaled_scores`, kept
where the scale is a power of two). Whole calls of the models whose blocks take the explicit route (up to 80
tokens), both forms timed interleaved in one process as `--engine auto` times its candidates
(`engine.choose.interleaved_speeds`: a new order each round, median), after the 50 ms pause `peers.py` leaves and
back to back; with the largest logit difference between the two (0: the same bits).

    python benchmarks/attention_scale.py [--models fmnist,vit-b/32] [--batches 1,32] [--rounds 31]
"""

from __future__ import annotations

import argparse

import torch
from direct_inference import engine_with, model_and_images

from vitlab.engine import choose
from vitlab.engine.torch_engines import TorchEngine
from vitlab.models import attention_core
from vitlab.runtime import tune_cpu_allocator


def compare(name: str, batch: int, rounds: int) -> str:
    model, x = model_and_images(name, batch)
    engine = TorchEngine(model)
    runs = {form: engine_with(engine, attention_core, "SCALE_IN_PRODUCT", form == "alpha", True)
            for form in ("multiply", "alpha")}
    diff = float((runs["alpha"](x) - runs["multiply"](x)).abs().max())
    cells = []
    for pause in (0.05, 0.0):
        choose.PAUSE_S = pause
        speeds = choose.interleaved_speeds(runs, x, rounds)
        cells.append(f"pause {pause * 1e3:2.0f} ms: multiply {speeds['multiply']:8.2f}  alpha {speeds['alpha']:8.2f}"
                     f"  (x{speeds['alpha'] / speeds['multiply']:.3f})")
    return f"  {name:9s} batch {batch:3d}: " + "   ".join(cells) + f"   max |logit difference| {diff:.1e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="fmnist,vit-b/32")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--rounds", type=int, default=31)
    args = ap.parse_args()
    tune_cpu_allocator()  # as every vitlab command on the CPU runs
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, --engine torch, median of {args.rounds} "
          "rounds, images/s")
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            print(compare(name, batch, args.rounds), flush=True)


if __name__ == "__main__":
    main()
