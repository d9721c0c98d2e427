"""What `vitlab train --products auto` measures on this machine (vitlab.train.products): the forward and
input-gradient products of each model's linear layers through oneDNN against torch's F.linear at the given
micro-batches, as oneDNN time / F.linear time (> 1: F.linear faster; auto takes it from TORCH_MIN_SPEEDUP on).
Times anew (VITLAB_RETIME=1), so the numbers are this run's.

    python benchmarks/train_products.py [--threads 2] > docs/results/train_products.txt
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

import vitlab
from vitlab.runtime import machine_key, tune_cpu_allocator
from vitlab.train import products

MODELS = {  # name -> (create_model arguments, micro-batches)
    "Fashion-MNIST ViT": (dict(image_size=28, in_chans=1, patch_size=4, dim=64, depth=6, heads=4, mlp_dim=128), (128,)),
    "ViT-Ti/16": (dict(image_size=224, patch_size=16, dim=192, depth=12, heads=3, mlp_dim=768), (1, 16, 32)),
    "ViT-S/16": (dict(image_size=224, patch_size=16, dim=384, depth=12, heads=6, mlp_dim=1536), (1, 32)),
    "ViT-B/16": (dict(image_size=224, patch_size=16, dim=768, depth=12, heads=12, mlp_dim=3072), (1, 32)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ["VITLAB_RETIME"] = "1"
    os.environ.pop("VITLAB_TORCH_PRODUCTS_SPEEDUP", None)
    tune_cpu_allocator()
    print(f"{machine_key()} ({platform.machine()}); oneDNN time / F.linear time, forward + input gradient of every linear layer; auto takes "
          f"F.linear from {products.TORCH_MIN_SPEEDUP}")
    for name, (shape, batches) in MODELS.items():
        model = vitlab.create_model("custom", num_classes=10, seed=0, **shape)
        for batch in batches:
            ratio = products.torch_products_speedup(model, batch)
            pick = "torch" if ratio >= products.TORCH_MIN_SPEEDUP else "onednn"
            print(f"  {name:18s} batch {batch:4d}: {ratio:.3f} -> {pick}", flush=True)


if __name__ == "__main__":
    main()
