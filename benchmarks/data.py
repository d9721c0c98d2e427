"""Data pipeline throughput: alone, and next to a ViT training step (is the pipeline the bottleneck?).

    python benchmarks/data.py                 # default: ~2-3 minutes on a 2-core CPU
    python benchmarks/data.py --quick         # a few seconds, smoke test
    python benchmarks/data.py --device cuda   # augmentation and model on the GPU
    python benchmarks/data.py --threads 1     # on a busy shared CPU (see docs/benchmarks.md)

Workloads:
  A. Fashion-MNIST in memory (60k x 1 x 28 x 28 uint8): tensor-slicing loader, + train transform
     (inception crop + flip, [-1, 1]) on the training device; models: the small Fashion-MNIST ViT
     (dim 64, depth 6, patch 4) and a ViT-Ti-sized one (dim 192, depth 12, 3 heads, patch 4) at 28 px.
  B. A folder of JPEGs made here from Fashion-MNIST (RGB, 256 px, as photos would be stored):
     decoding once into memory, and streaming through DataLoader workers + transform to 224 px;
     model: ViT-Ti/16 at 224 px.
"Data share" = the time a training step spends waiting for data / its total time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vitlab.data import load_data, make_loader
from vitlab.data.transforms import TransformConfig, build_train_transform
from vitlab.models import create_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_batches(batches, limit_s: float, device: torch.device, step=None, transform=None, warmup: int = 2):
    """Iterate (images, labels); optional transform + step; returns (images/s, data seconds, step seconds)."""
    n = seen = 0
    data_s = step_s = 0.0
    start = None
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if transform is not None:
            x = transform(x)
        _sync(device)
        t1 = time.perf_counter()
        if step is not None:
            step(x, y)
            _sync(device)
        t2 = time.perf_counter()
        n += 1
        if n <= warmup:
            continue
        if start is None:
            start = t0
        seen += len(y)
        data_s += t1 - t0
        step_s += t2 - t1
        if t2 - start > limit_s:
            break
    total = data_s + step_s
    return (seen / total if total else float("nan")), data_s, step_s


def cycle(make, epochs: int = 1000):
    for e in range(epochs):
        yield from make(e)


def make_step(model: torch.nn.Module, device: torch.device):
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return step


def jpeg_folder(root: Path, images: torch.Tensor, labels: torch.Tensor, names: list[str], size: int) -> Path:
    """Write Fashion-MNIST images as coloured RGB JPEGs of size x size, one folder per class."""
    palette = np.array([[255, 80, 80], [80, 255, 80], [80, 80, 255], [255, 255, 80], [255, 80, 255],
                        [80, 255, 255], [200, 150, 100], [100, 150, 200], [150, 200, 100], [220, 220, 220]])
    for i, (img, lab) in enumerate(zip(images, labels.tolist())):
        folder = root / names[lab].replace("/", "-")
        folder.mkdir(parents=True, exist_ok=True)
        grey = Image.fromarray(img[0].numpy()).resize((size, size), Image.BILINEAR)
        rgb = (np.asarray(grey, dtype=np.float32)[..., None] / 255.0 * palette[lab]).astype(np.uint8)
        Image.fromarray(rgb).save(folder / f"{i:05d}.jpg", quality=90)
    return root


def row(table, workload, what, ips, data_s=None, step_s=None):
    share = f"{100 * data_s / (data_s + step_s):.1f}%" if data_s is not None and step_s else ""
    table.append((workload, what, f"{ips:,.0f}", share))
    print(f"  {workload:<34} {what:<46} {ips:>10,.0f} img/s  {share}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seconds", type=float, default=6.0, help="time per measurement (default 6)")
    ap.add_argument("--jpegs", type=int, default=1000, help="JPEGs in the folder workload (default 1000)")
    ap.add_argument("--quick", action="store_true", help="1 s per measurement, 300 JPEGs, no ViT-Ti/16 at 224")
    ap.add_argument("--batch", type=int, default=256, help="batch size at 28 px (default 256)")
    ap.add_argument("--batch-224", type=int, default=32, help="batch size at 224 px (default 32)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice); 1 avoids OpenMP "
                                                "spin-waiting on a CPU shared with other jobs")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.seconds, args.jpegs = 1.0, 300
    device = torch.device(args.device)
    limit = args.seconds
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} cpus, load average {load:.1f}", flush=True)
    table: list[tuple] = []
    torch.manual_seed(0)

    # ---- A. Fashion-MNIST in memory --------------------------------------------------------------
    t = time.perf_counter()
    splits = load_data("fashion-mnist", val_fraction=0.0)
    print(f"A. Fashion-MNIST loaded in {time.perf_counter() - t:.1f} s: {splits.summary()}", flush=True)
    train = splits.train
    bs = args.batch
    tf = build_train_transform(TransformConfig(image_size=28, channels=1)).to(device)
    wl = "Fashion-MNIST, in memory, 28 px"

    def loader(e):
        return make_loader(train, bs, shuffle=True, seed=0, epoch=e, drop_last=True)

    ips, _, _ = time_batches(cycle(loader), limit, device)
    row(table, wl, f"loader (batch {bs})", ips)
    ips, _, _ = time_batches(cycle(loader), limit, device, transform=tf)
    row(table, wl, "loader + inception crop + flip", ips)
    import kornia.augmentation as K  # the library version of the same crop + flip, for comparison

    kornia_tf = torch.nn.Sequential(
        K.RandomResizedCrop((28, 28), scale=(0.05, 1.0), ratio=(3 / 4, 4 / 3)), K.RandomHorizontalFlip()
    ).to(device)
    ips, _, _ = time_batches(cycle(loader), limit, device, transform=lambda x: kornia_tf(x.float() / 255) * 2 - 1)
    row(table, wl, "loader + kornia RandomResizedCrop + flip", ips)
    models = {
        "small ViT (d64, L6, p4)": dict(dim=64, depth=6, heads=4, mlp_dim=128),
        "ViT-Ti-sized (d192, L12, h3, p4)": dict(dim=192, depth=12, heads=3, mlp_dim=768),
    }
    for label, kw in models.items():
        model = create_model("custom", patch_size=4, image_size=28, in_chans=1, num_classes=10, seed=0, **kw)
        step = make_step(model, device)
        fixed = tf(next(iter(loader(0)))[0].to(device))
        fixed_y = torch.randint(0, 10, (bs,), device=device)
        ips_model, _, _ = time_batches(((fixed, fixed_y) for _ in range(10**6)), limit, device, step=step, warmup=1)
        row(table, wl, f"{label}: train step only", ips_model)
        ips, d, s = time_batches(cycle(loader), limit, device, step=step, transform=tf, warmup=1)
        row(table, wl, f"{label}: loader + transform + step", ips, d, s)

    # ---- B. folder of JPEGs ----------------------------------------------------------------------
    with tempfile.TemporaryDirectory(prefix="vitlab-bench-") as tmp:
        n = args.jpegs
        idx = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:n]
        t = time.perf_counter()
        root = jpeg_folder(Path(tmp) / "jpegs", train.images[idx], train.labels[idx], splits.class_names, 256)
        mb = sum(p.stat().st_size for p in root.rglob("*.jpg")) / 1e6
        print(f"B. wrote {n} JPEGs (256x256 RGB, {mb:.1f} MB) in {time.perf_counter() - t:.1f} s", flush=True)
        wl = f"{n} JPEGs 256 px -> 224 px"
        t = time.perf_counter()
        mem = load_data(str(root), val_fraction=0.0, test_fraction=0.0, in_memory=True, progress=False)
        dt = time.perf_counter() - t
        row(table, wl, "scan + decode once into memory (threads)", len(mem.train) / dt)
        disk = load_data(str(root), val_fraction=0.0, test_fraction=0.0, in_memory=False, progress=False)
        b224 = args.batch_224
        tf224 = build_train_transform(TransformConfig(image_size=224, channels=3)).to(device)
        for workers in sorted({1, max(1, (os.cpu_count() or 2) // 2)}):
            def stream(e, w=workers):
                return make_loader(disk.train, b224, shuffle=True, seed=0, epoch=e, num_workers=w, drop_last=True)

            ips, _, _ = time_batches(cycle(stream), limit, device, transform=tf224)
            row(table, wl, f"stream ({workers} worker) + crop/flip to 224", ips)

        def memloader(e):
            return make_loader(mem.train, b224, shuffle=True, seed=0, epoch=e, drop_last=True)

        ips, _, _ = time_batches(cycle(memloader), limit, device, transform=tf224)
        row(table, wl, "in memory + crop/flip to 224", ips)
        if not args.quick:
            model = create_model("vit-ti/16", num_classes=10, image_size=224, seed=0)
            step = make_step(model, device)
            fixed = tf224(next(iter(memloader(0)))[0].to(device))
            fixed_y = torch.randint(0, 10, (b224,), device=device)
            ips_model, _, _ = time_batches(((fixed, fixed_y) for _ in range(10**6)), limit * 2, device, step=step,
                                           warmup=1)
            row(table, wl, "ViT-Ti/16: train step only", ips_model)

            def stream1(e):
                return make_loader(disk.train, b224, shuffle=True, seed=0, epoch=e, num_workers=1, drop_last=True)

            ips, d, s = time_batches(cycle(stream1), limit * 2, device, step=step, transform=tf224, warmup=1)
            row(table, wl, "ViT-Ti/16: stream (1 worker) + transform + step", ips, d, s)

    print("\n| workload | measurement | images/s | data share of step time |")
    print("|---|---|---:|---:|")
    for r in table:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
