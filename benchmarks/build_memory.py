"""The memory and time it takes to build ONNX Runtime's fused fp32 graph of a model, as a user meets it: `vitlab export
MODEL OUT --engine onnxruntime` in a fresh process (the model loaded, the graph exported, fused by ORT's transformer
optimizer, checked against eager PyTorch, written).

The peak is the largest sum of the resident memory of the command and every process under it, sampled every 10
ms (vitlab may fuse the graph in a process of its own: engine/vit_fusion.py, whose memory the machine must hold
beside the command's). With `--src` the same runs for another checkout of vitlab (PYTHONPATH), and the digests of
the written graphs say whether both wrote the same bytes. Random weights (memory and graph do not depend on the
values); the built files go to a scratch folder and its own VITLAB_CACHE.

    python benchmarks/build_memory.py                                   # ViT-B/16 and ViT-L/16
    python benchmarks/build_memory.py --models vit-h/14 --src /tmp/old/src
    python benchmarks/build_memory.py --int8 dynamic                    # the int8 graph (built from the fp32 one)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every process under it (0 for one that is gone)."""
    total, pending = 0, [pid]
    while pending:
        p = pending.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    pending.extend(int(c) for c in f.read().split())
        except (OSError, StopIteration, ValueError):
            continue
    return total


def build(source: Path, out: Path, env: dict, flags: list[str]) -> tuple[int, float, int, str]:
    """(exit code, seconds, peak resident bytes of the process tree, last output line) of one export."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "vitlab", "export", str(source), str(out), *flags, "--quiet"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = 0
    while child.poll() is None:
        peak = max(peak, tree_rss(child.pid))
        time.sleep(0.01)
    text = child.stdout.read().strip()
    return child.returncode, time.perf_counter() - start, peak, text.splitlines()[-1] if text else ""


def calibration_images(folder: Path, n: int = 16) -> Path:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.RandomState(0)
    for i in range(n):
        Image.fromarray(rng.randint(0, 256, (224, 224, 3), dtype=np.uint8)).save(folder / f"{i:02d}.png")
    return folder


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="vit-b/16,vit-l/16")
    ap.add_argument("--src", type=Path, help="also build with vitlab from this source tree (an older checkout)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/vitlab-build-memory"))
    ap.add_argument("--int8", choices=("dynamic", "static"), help="build the int8 graph instead (static calibrates on "
                                                                   "16 random images)")
    args = ap.parse_args()
    import torch

    import vitlab

    shutil.rmtree(args.work, ignore_errors=True)
    flags = ["--engine", "onnxruntime"] if args.int8 is None else ["--int8", args.int8]
    if args.int8 == "static":
        flags += ["--calibration", str(calibration_images(args.work / "calibration"))]
    versions = [("this checkout", {})] + ([(str(args.src), {"PYTHONPATH": str(args.src.resolve())})] if args.src else [])
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; vitlab export {' '.join(flags[:2])}; peak: the resident "
          "memory of the export command and the processes under it, summed")
    for name in args.models.split(","):
        model = vitlab.create_model(name, num_classes=10, seed=0)
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        source = args.work / name.replace("/", "") / "model"
        vitlab.save(model, source)
        del model
        for label, extra in versions:
            out = args.work / name.replace("/", "") / f"out-{len(extra)}" / "m.onnx"
            env = dict(os.environ, VITLAB_CACHE=str(out.parent.parent / f"cache-{len(extra)}"), **extra)
            code, seconds, peak, last = build(source, out, env, flags)
            result = f"graph {digest(out.parent)}" if code == 0 else f"FAILED rc {code}: {last}"
            print(f"  {name:9s} ({weights / 2**30:.2f} GiB of weights) {label}: {seconds:6.1f} s, peak "
                  f"{peak / 2**30:5.2f} GiB ({peak / weights:4.1f}x the weights); {result}", flush=True)
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
