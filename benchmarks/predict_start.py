"""How long `vitlab predict MODEL IMAGE` takes for one image, from a fresh process: the cold start a script or a
server pays (imports, loading the weights, finding and checking the cached engine, the first prediction).

    .venv/bin/python benchmarks/predict_start.py                          # ViT-B/16, this checkout
    .venv/bin/python benchmarks/predict_start.py --src /tmp/old/src       # another checkout's vitlab, same files
    .venv/bin/python benchmarks/predict_start.py --model vit-ti/16 --runs 9 --engine torch

A model folder (random weights) and a 384x288 JPEG are written once into --work; a first, untimed run builds and
times the engines (`--engine auto` keeps its choice beside the model), then each timed run is a new
`python -m vitlab predict` with the output discarded. With --src the runs import vitlab from that source tree
(PYTHONPATH), so two versions can be timed on the same files one after the other; each keeps its own engines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def make_files(work: Path, model: str) -> tuple[Path, Path]:
    import numpy as np
    from PIL import Image

    import vitlab

    folder, image = work / model.replace("/", ""), work / "image.jpg"
    if not folder.exists():
        vitlab.save(vitlab.create_model(model, seed=0), folder)
    if not image.exists():
        pixels = np.random.default_rng(0).integers(0, 256, (288, 384, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(image, quality=90)
    return folder, image


def engine_line(command: list[str], env: dict) -> str:
    """What the command says of its engine (run once untimed: it builds and times the engines the first time)."""
    done = subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = [line for line in done.stderr.splitlines() if "engine:" in line]
    return lines[-1].strip() if lines else "(no engine line)"


def timed_runs(command: list[str], env: dict, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit-b/16")
    parser.add_argument("--engine", default="auto", help="predict's --engine (default auto)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--src", type=Path, help="import vitlab from this source tree instead")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vitlab-predict-start"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    folder, image = make_files(args.work, args.model)
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as users run it: compiled modules cached after the first run
    if args.src is not None:
        env["PYTHONPATH"] = str(args.src.resolve())
    command = [sys.executable, "-m", "vitlab", "predict", str(folder), str(image), "--engine", args.engine]
    engine_line(command, env)  # the first run builds and times the engines
    said = engine_line(command, env)
    times = timed_runs(command, env, args.runs)
    source = args.src or "this checkout"
    print(f"vitlab predict {args.model} (one image, --engine {args.engine}), vitlab from {source}: median "
          f"{statistics.median(times):.2f} s, range {min(times):.2f}-{max(times):.2f} s over {args.runs} fresh runs\n"
          f"  {said}")


if __name__ == "__main__":
    main()
