"""What `--engine auto` picks on this machine, and what each candidate measured (fresh cache, so it times).

    python benchmarks/engines.py                                   # ViT-Ti/16, S/16, B/16 at batch 1 and 32
    python benchmarks/engines.py --models vit-s/16 --batches 32 --compiled   # also torch.compile (+ compile time)
    python benchmarks/engines.py --models vit-s/16,vit-b/16 --batches 32 --int8 dynamic   # what --int8 runs
    python benchmarks/engines.py --models vit-b/16 --batches 32 --int8 static   # calibrated on 64 random images:
                                   # ONNX Runtime's static int8 against OpenVINO's (where installed), as --int8 static
    python benchmarks/engines.py --batches 1 --default-allocator   # glibc's allocator as it comes

Like the CLI (`vitlab.runtime.setup_runtime`) it first raises glibc's mmap and trim thresholds
(`tune_cpu_allocator`), so eager PyTorch does not page-fault its activations in on every call;
`--default-allocator` leaves glibc as it comes.

At batches of 8 and more the line also says whether whole batches or sub-batches were kept, with their speeds
(`engine/sub_batch.py`).

`auto` compares eager PyTorch with the fused fp32 ONNX Runtime graph and, where installed, OpenVINO's fp32 model, all
exact; `--compiled` times
`--engine compiled` on its own (it is not an `auto` candidate: see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from contextlib import redirect_stderr

import torch
from peers import perturbed

import vitlab
from vitlab.engine import prepare_engine
from vitlab.engine.choose import interleaved_speeds
from vitlab.runtime import tune_cpu_allocator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="vit-ti/16,vit-s/16,vit-b/16")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--int8", choices=["dynamic", "auto", "static"], default=None,
                    help="what --int8 runs instead (auto and static calibrate on 64 random images; the logits of "
                         "random weights say nothing of accuracy: benchmarks/int8_accuracy.py does)")
    ap.add_argument("--default-allocator", action="store_true", help="leave glibc's allocator as it comes")
    args = ap.parse_args()
    tuned = False if args.default_allocator else tune_cpu_allocator()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"allocator {'tuned (freed memory kept)' if tuned else 'as it comes'}")
    calibration = None
    if args.int8 in ("auto", "static"):
        rng = torch.Generator().manual_seed(0)
        calibration = [torch.randn(16, 3, 224, 224, generator=rng).numpy() for _ in range(4)]
    for name in args.models.split(","):
        model = perturbed(vitlab.create_model(name))  # zero-initialised heads and biases quantize to nothing
        with tempfile.TemporaryDirectory() as tmp:
            for batch in (int(b) for b in args.batches.split(",")):
                err = io.StringIO()
                with redirect_stderr(err):
                    engine = prepare_engine(model, "auto", int8=args.int8, calibration=calibration,
                                            batch_size=batch, source=tmp, command="bench")
                print(f"{name:10s} batch {batch:3d}: picked {engine.name:12s} | {err.getvalue().strip()}")
                if args.compiled:
                    start = time.perf_counter()
                    compiled = prepare_engine(model, "compiled", source=tmp, quiet=True)
                    x = torch.randn(batch, 3, 224, 224)
                    compiled(x)
                    setup = time.perf_counter() - start
                    eager = prepare_engine(model, "torch", quiet=True)
                    speeds = interleaved_speeds({"compiled": compiled, "torch": eager}, x)
                    print(f"{'':10s} compiled: {speeds['compiled']:.2f} vs torch {speeds['torch']:.2f} images/s "
                          f"(x{speeds['compiled'] / speeds['torch']:.2f}), compile + first call {setup:.0f} s")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
