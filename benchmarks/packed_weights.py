"""The torch inference engine with its weights packed once into oneDNN's layout (models/fast_linear.PackedWeights,
what `--engine torch` and the torch candidate of `--engine auto` run) against the same model called plainly under
`inference_mode` (oneDNN reorders each weight inside every call), timed as `--engine auto` times its candidates
(`engine.choose.interleaved_speeds`: interleaved, a pause before each call, median of the rounds); also the largest
logit difference between the two.

    python benchmarks/packed_weights.py                       # torch's default threads
    python benchmarks/packed_weights.py --threads 1
    python benchmarks/packed_weights.py --packed-only          # the engine with and without its plain weights

`--packed-only` times instead two packed engines on copies of one model, one of them released
(engine.release.release_model: it keeps only the packed copies of the large weights, as `vitlab serve` and
`vitlab predict` do), and prints how many MB of weights that freed.
"""

from __future__ import annotations

import argparse
import copy

import torch

import vitlab
from vitlab.engine import choose
from vitlab.engine.release import release_model
from vitlab.engine.torch_engines import TorchEngine


def model_and_images(name: str, batch: int) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = vitlab.create_model(name).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)  # the official init zeroes the head, which would hide any difference
    return model, torch.randn(batch, 3, 224, 224)


def compare_packed_only(name: str, batch: int, rounds: int) -> tuple[float, float, float, float]:
    """images/s of the packed engine keeping the plain weights, then of one released, max |logit difference|,
    MB freed."""
    model, x = model_and_images(name, batch)
    released_model = copy.deepcopy(model)
    kept, released = TorchEngine(model), TorchEngine(released_model)
    released(x)  # packs the weights
    plain_bytes = sum(p.numel() * p.element_size() for p in released_model.parameters())
    release_model(released_model, released)
    released(x)  # frees the plain copies
    left = sum(p.numel() * p.element_size() for p in released_model.parameters() if not p.is_meta)
    diff = float((kept(x) - released(x)).abs().max())
    speeds = choose.interleaved_speeds({"kept": kept, "released": released}, x, rounds)
    return speeds["kept"], speeds["released"], diff, (plain_bytes - left) / 2**20


def compare(name: str, batch: int, rounds: int) -> tuple[float, float, float]:
    """images/s plain, images/s packed, max |logit difference|."""
    model, x = model_and_images(name, batch)
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
    ap.add_argument("--packed-only", action="store_true", help="a released engine against one keeping its weights")
    args = ap.parse_args()
    choose.PAUSE_S = args.pause_ms / 1e3
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.rounds} rounds, images/s")
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            if args.packed_only:
                kept, released, diff, freed = compare_packed_only(name, batch, args.rounds)
                print(f"  {name:10s} batch {batch:3d}: plain weights kept {kept:8.2f}  freed {released:8.2f}  "
                      f"(x{released / kept:.3f})  max |logit difference| {diff:.1e}  {freed:.0f} MB freed", flush=True)
                continue
            plain, packed, diff = compare(name, batch, args.rounds)
            print(f"  {name:10s} batch {batch:3d}: plain {plain:8.2f}  packed {packed:8.2f}  (x{packed / plain:.3f})"
                  f"  max |logit difference| {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
