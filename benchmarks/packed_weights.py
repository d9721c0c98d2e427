"""The torch inference engine with its weights packed once into oneDNN's layout (models/fast_linear.PackedWeights,
what `--engine torch` and the torch candidate of `--engine auto` run) against the same model called plainly under
`inference_mode` (oneDNN reorders each weight inside every call), timed as `--engine auto` times its candidates
(`engine.choose.interleaved_speeds`: interleaved, a pause before each call, median of the rounds); also the largest
logit difference between the two.

    python benchmarks/packed_weights.py                       # torch's default threads
    python benchmarks/packed_weights.py --threads 1
"""

from __future__ import annotations

import argparse

import torch

import vitlab
from vitlab.engine import choose
from vitlab.engine.torch_engines import TorchEngine


def compare(name: str, batch: int, rounds: int) -> tuple[float, float, float]:
    """images/s plain, images/s packed, max |logit difference|."""
    torch.manual_seed(0)
    model = vitlab.create_model(name).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)  # the official init zeroes the head, which would hide any difference
    x = torch.randn(batch, 3, 224, 224)
    engine = TorchEngine(model)

    def plain(images: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(images)

    diff = float((engine(x) - plain(x)).abs().max())
    speeds = choose.interleaved_speeds({"plain": plain, "packed": engine}, x, rounds)  # what `auto` times with
    return speeds["plain"], speeds["packed"], diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--models", default="vit-ti/16,vit-s/16,vit-b/16,vit-b/32")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--pause-ms", type=float, default=50)
    args = ap.parse_args()
    choose.PAUSE_S = args.pause_ms / 1e3
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.rounds} rounds, images/s")
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            plain, packed, diff = compare(name, batch, args.rounds)
            print(f"  {name:10s} batch {batch:3d}: plain {plain:8.2f}  packed {packed:8.2f}  (x{packed / plain:.3f})"
                  f"  max |logit difference| {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
