"""vitlab's ONNX Runtime graphs on one thread against all of the run's threads, for calls with little arithmetic
(docs/benchmarks.md, "ONNX Runtime: small calls on one thread").

The same graph (the fused fp32 graph `--engine onnxruntime` runs, and the dynamic int8 one) in two sessions, one
with `--threads` intra-op threads and one with a single thread, timed interleaved in a new random order each round,
at each batch size, two ways: back to back (one untimed call, then `--calls` calls timed together) and one call
after a 50 ms pause (ORT's workers have gone back to sleep). Prints images/s and the one-thread session's speed over
the other's, with the call's forward FLOPs (what `ort.ONE_THREAD_MAX_FLOPS` is compared with), and the largest
logit difference between the two sessions. `--openvino` adds vitlab's OpenVINO fp32 model, compiled for one thread
and for all.

    python benchmarks/ort_threads.py                                   # the Fashion-MNIST ViT, batch 1-8; Ti/16, batch 1
    python benchmarks/ort_threads.py --models fmnist --batches 1,2 --rounds 21
    /work/peers/bin/python benchmarks/ort_threads.py --openvino     # where OpenVINO is installed
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from direct_inference import model_and_images

from vitlab.engine.ort import OrtEngine, build_fp32, build_int8_dynamic, flops_per_image
from vitlab.runtime import tune_cpu_allocator

PAUSE_S = 0.05


def timed(engines: dict[str, OrtEngine], x: torch.Tensor, rounds: int, calls: int, paused: bool) -> dict[str, float]:
    """images/s per engine: each round in a new order, each engine after a 50 ms pause; back to back, one untimed
    call and then `calls` calls timed together, else one call right after the pause."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(engines)
        rng.shuffle(order)
        for name in order:
            engine = engines[name]
            time.sleep(PAUSE_S)
            n = 1 if paused else calls
            if not paused:
                engine(x)
            t = time.perf_counter()
            for _ in range(n):
                engine(x)
            times[name].append((time.perf_counter() - t) / n)
    return {name: x.shape[0] / statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="fmnist,vit-ti/16", help="fmnist (the 28 px Fashion-MNIST ViT) or named ViTs")
    ap.add_argument("--batches", default="", help="comma-separated (default: 1,2,4,8 for fmnist, 1 otherwise)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10, help="calls timed together back to back")
    ap.add_argument("--openvino", action="store_true",
                    help="also vitlab's OpenVINO fp32 model (`--engine openvino`; needs pip install openvino)")
    args = ap.parse_args()
    tune_cpu_allocator()
    import onnxruntime

    print(f"# python benchmarks/ort_threads.py {' '.join(sys.argv[1:])}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus; onnxruntime {onnxruntime.__version__}; threads {args.threads} against 1")
    for name in args.models.split(","):
        model, _ = model_and_images(name, 1)
        size = tuple(model.config.image_size)
        flops = flops_per_image(model, size)
        batches = [int(b) for b in args.batches.split(",") if b] or ([1, 2, 4, 8] if name == "fmnist" else [1])
        with tempfile.TemporaryDirectory() as tmp:
            fp32 = build_fp32(model, Path(tmp), size)
            int8 = build_int8_dynamic(fp32, Path(tmp) / "int8-dynamic.onnx")
            makers = {"fp32": functools.partial(OrtEngine, fp32), "int8": functools.partial(OrtEngine, int8)}
            if args.openvino:
                from vitlab.engine.openvino import OvEngine, build_fp32_ir

                ir = build_fp32_ir(model, Path(tmp), size)
                makers["openvino-fp32"] = functools.partial(OvEngine, ir)
            engines = {f"{kind} {n}t": make(n) for kind, make in makers.items() for n in (args.threads, 1)}
            for batch in batches:
                _, x = model_and_images(name, batch)
                for kind in makers:
                    diff = float((engines[f"{kind} 1t"](x) - engines[f"{kind} {args.threads}t"](x)).abs().max())
                    print(f"{name} batch {batch} {kind}: largest logit difference, 1 thread against "
                          f"{args.threads}: {diff:.2g}")
                for paused in (False, True):
                    speeds = timed(engines, x, args.rounds, args.calls, paused)
                    how = "after a 50 ms pause" if paused else f"back to back ({args.calls} calls)"
                    for kind in makers:
                        one, many = speeds[f"{kind} 1t"], speeds[f"{kind} {args.threads}t"]
                        print(f"{name:10s} batch {batch:2d} ({batch * flops / 1e6:7.1f} MFLOP) {kind} "
                              f"{how:26s} 1 thread {one:8.1f}  {args.threads} threads {many:8.1f} images/s  "
                              f"1 thread x{one / many:.2f}")


if __name__ == "__main__":
    main()
