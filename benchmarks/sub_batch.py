"""Whole batches against sub-batches, per model and engine: the measurement behind `engine/sub_batch.py` (what
`--engine auto` and `--int8` time once before they choose), with every size run on the whole batch.

    python benchmarks/sub_batch.py > docs/results/sub_batches.txt
    python benchmarks/sub_batch.py --models vit-b/16 --engines int8 --sizes 32,16,8 --rounds 15

For each engine the batch runs whole and cut into sub-batches of each size (`SubBatched`), interleaved, 50 ms pause
before each call, median of `--rounds`; images/s, the ratio to the whole batch, and the largest difference of a
logit from the whole batch's. Random weights (perturbed so no range is degenerate): speeds only.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

import vitlab
from vitlab.engine.choose import interleaved_speeds
from vitlab.engine.sub_batch import SubBatched

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import perturbed  # noqa: E402  (non-degenerate random weights, as in the peers benchmark)


def engines(model: torch.nn.Module, wanted: list[str], folder: Path, threads: int) -> dict:
    from vitlab.engine.ort import OrtEngine, build_fp32, build_int8_dynamic
    from vitlab.engine.torch_engines import TorchEngine

    out = {}
    if "torch" in wanted:
        out["torch"] = TorchEngine(model)
    if {"onnxruntime", "int8"} & set(wanted):
        fp32 = build_fp32(model, folder, tuple(model.config.image_size))
        if "onnxruntime" in wanted:
            out["onnxruntime"] = OrtEngine(fp32, threads)
        if "int8" in wanted:
            out["int8 dynamic"] = OrtEngine(build_int8_dynamic(fp32, folder / "int8.onnx"), threads, exact=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="vit-ti/16,vit-s/16,vit-b/16")
    ap.add_argument("--engines", default="torch,onnxruntime,int8")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--sizes", default="16,8,4", help="sub-batch sizes to time against the whole batch")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import onnxruntime

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, threads {args.threads}; "
          f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}; batch {args.batch}, "
          f"{args.rounds} rounds; load average {os.getloadavg()[0]:.2f}", flush=True)
    sizes = [int(s) for s in args.sizes.split(",") if int(s) < args.batch]
    x = torch.randn(args.batch, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    for name in args.models.split(","):
        model = perturbed(vitlab.create_model(name, num_classes=1000))
        with tempfile.TemporaryDirectory() as tmp:
            for label, engine in engines(model, args.engines.split(","), Path(tmp), args.threads).items():
                runs = {"whole": engine, **{f"sub-batches of {s}": SubBatched(engine, s) for s in sizes}}
                speeds = interleaved_speeds(runs, x, args.rounds)
                whole = engine(x)
                parts = "   ".join(
                    f"{k} {v:.2f} (x{v / speeds['whole']:.2f}, max diff "
                    f"{float((runs[k](x) - whole).abs().max()):.1e})" if k != "whole" else f"whole {v:.2f}"
                    for k, v in speeds.items())
                print(f"{name:9s} {label:13s} images/s: {parts}", flush=True)


if __name__ == "__main__":
    main()
