"""Eager PyTorch with glibc's allocator as it comes against the tuned one (`vitlab.runtime.tune_cpu_allocator`:
freed memory kept in the heap), in inference and in a training step: images/s, page faults per call and the
process's peak memory (what keeping freed memory costs).

The setting is process-wide and cannot be undone within a process (glibc's adaptive threshold does not come
back), so each measurement runs in a fresh child process, the two settings alternating (A B A B ...) so slow
drifts of a shared machine hit both alike; the result is the median over the pairs.

    python benchmarks/allocator.py                                  # ViT-Ti/16 and S/16 at batch 1, B/16 at 32
    python benchmarks/allocator.py --cases vit-s/16:1,train:fmnist --pairs 5
    python benchmarks/allocator.py --cases ort:vit-ti/16:1,ort:vit-s/16:1      # ONNX Runtime (its own arena)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

# (image size, channels, patch, width, depth, heads, MLP, batch): the side-by-side training sizes of peers.py
TRAIN_SIZES = {"fmnist": (28, 1, 4, 64, 6, 4, 128, 128), "ti16": (224, 3, 16, 192, 12, 3, 768, 16)}


def inference_call(name: str, batch: int):
    import torch

    import vitlab
    from vitlab.engine.torch_engines import TorchEngine

    engine = TorchEngine(vitlab.create_model(name).eval())
    x = torch.randn(batch, 3, 224, 224)
    return lambda: engine(x), batch


def ort_call(name: str, batch: int, folder: str):
    """vitlab's fp32 ONNX Runtime engine (its own arena: the control)."""
    from pathlib import Path

    import torch

    import vitlab
    from vitlab.engine.ort import OrtEngine, build_fp32

    model = vitlab.create_model(name).eval()
    engine = OrtEngine(build_fp32(model, Path(folder), (224, 224)), torch.get_num_threads())
    x = torch.randn(batch, 3, 224, 224)
    return lambda: engine(x), batch


def training_step(size: str):
    import torch
    import torch.nn.functional as F

    import vitlab

    img, ch, patch, dim, depth, heads, mlp, batch = TRAIN_SIZES[size]
    model = vitlab.create_model("custom", num_classes=10, image_size=img, in_chans=ch, patch_size=patch, dim=dim,
                                depth=depth, heads=heads, mlp_dim=mlp, seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch, ch, img, img), torch.randint(0, 10, (batch,))

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step, batch


def child(case: str, tuned: bool, calls: int) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    from vitlab.runtime import tune_cpu_allocator

    if tuned and not tune_cpu_allocator():
        raise SystemExit("the allocator could not be tuned here (not Linux/glibc, or VITLAB_NO_MALLOPT is set)")
    import tempfile

    kind, *args = case.split(":")
    folder = tempfile.mkdtemp()
    if kind == "train":
        fn, images = training_step(args[0])
    elif kind == "ort":
        fn, images = ort_call(args[0], int(args[1]), folder)
    else:
        fn, images = inference_call(kind, int(args[0]))
    for _ in range(3):
        fn()
    times, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    print(json.dumps({"images_per_s": images / statistics.median(times), "faults": faults / calls, "peak_mb": peak_mb}))


def measure(case: str, tuned: bool, calls: int) -> dict:
    cmd = [sys.executable, __file__, "--child", case, "--calls", str(calls)] + (["--tuned"] if tuned else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="vit-ti/16:1,vit-s/16:1,vit-b/16:32,train:fmnist,train:ti16",
                    help="MODEL:BATCH (eager inference), ort:MODEL:BATCH (ONNX Runtime fp32) or "
                         "train:fmnist|ti16 (a training step), comma-separated")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--calls", type=int, default=0, help="timed calls per process (default: by case)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tuned", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.tuned, args.calls)
        return
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.pairs} alternating pairs of "
          "fresh processes, median images/s and page faults per call")
    print(f"  {'case':18s} {'as it comes (faults, peak)':>32s} {'tuned':>32s} {'ratio':>6s}  per-pair ratios")
    for case in args.cases.split(","):
        calls = args.calls or (4 if case.endswith(":32") or case == "train:ti16" else 20)
        runs = {False: [], True: []}
        for i in range(args.pairs):
            for tuned in ((False, True) if i % 2 == 0 else (True, False)):
                runs[tuned].append(measure(case, tuned, calls))
        speed, faults, peak = ({k: statistics.median(r[key] for r in v) for k, v in runs.items()}
                               for key in ("images_per_s", "faults", "peak_mb"))
        pairs = [b["images_per_s"] / a["images_per_s"] for a, b in zip(runs[False], runs[True])]
        cells = [f"{speed[k]:8.2f} ({faults[k]:7.0f} pf, {peak[k]:5.0f} MB)" for k in (False, True)]
        print(f"  {case:18s} {cells[0]:>32s} {cells[1]:>32s} {speed[True] / speed[False]:5.2f}x  "
              + " ".join(f"{p:.2f}" for p in pairs), flush=True)


if __name__ == "__main__":
    main()
