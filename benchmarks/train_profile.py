"""Where a training step's time goes, vitlab against Hugging Face's (or timm's) ViT of the same size:
torch.profiler's operator table over 5 steps of the loop benchmarks/peers.py times (AdamW, cross-entropy,
clipping, fp32). Runs in the peers' environment (docs/benchmarks.md, "Against every peer"):

    /work/peers/bin/python benchmarks/train_profile.py --size fmnist --threads 2
    /work/peers/bin/python benchmarks/train_profile.py --size ti16 --threads 2 --peer timm
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (the same models and step as the side-by-side benchmark)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="fmnist", choices=sorted(peers.TRAIN_SIZES))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=22)
    ap.add_argument("--peer", default="HF", choices=["HF", "timm"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    size = peers.TRAIN_SIZES[args.size]
    img, ch, batch = size[0], size[1], size[7]
    torch.manual_seed(0)
    x, y = torch.randn(batch, ch, img, img), torch.randint(0, 10, (batch,))
    models = peers.train_models(size)
    for name in ("vitlab", args.peer):
        step = peers.train_step(models[name], x, y)
        for _ in range(args.steps):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
        print(f"===== {name}: {args.steps} steps, batch {batch}, {args.threads} threads")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=40))


if __name__ == "__main__":
    main()
