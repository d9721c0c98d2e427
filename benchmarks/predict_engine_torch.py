"""`vitlab.predict.predict(..., engine="torch")` (what `vitlab predict --engine torch` runs) on a folder of images,
timed in a fresh process per run: this checkout against another (`--src`, e.g. one where `--engine torch` called
the model itself instead of the eager engine that `--engine auto` times), interleaved, same files.

    .venv/bin/python benchmarks/predict_engine_torch.py --src /tmp/old/src
    .venv/bin/python benchmarks/predict_engine_torch.py --src /tmp/old/src --models fmnist --batches 1 --runs 7
    .venv/bin/python benchmarks/predict_engine_torch.py --stream-rule     # in one process: the model itself, the
                                  # eager engine, and the engine with its one-thread rule for small calls

`--stream-rule` is why predict's and evaluate's eager engine keeps both threads for small calls: in a stream of
batch-1 calls (predict over a folder) the second thread is awake, and TorchEngine's one-thread rule, made for calls
that come after idle time, only loses there.

The time is the `predict` call alone (loading the weights, reading and preprocessing the images, the model
calls), not Python's start or the imports. Models: the documented Fashion-MNIST ViT (docs/figures/
fmnist_vit_model) on Fashion-MNIST test images from the bundled set, and ViT-Ti/16 (random weights) on 224 px
JPEGs. Each run also prints a digest of the predicted labels, so the two checkouts can be seen to agree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FMNIST_MODEL = ROOT / "docs" / "figures" / "fmnist_vit_model"

RUN = """
import hashlib, sys, time
from pathlib import Path
import vitlab.predict as p
files = sorted(Path(sys.argv[2]).iterdir())
start = time.perf_counter()
preds = p.predict(sys.argv[1], files, batch_size=int(sys.argv[3]), engine="torch", top_k=1)
seconds = time.perf_counter() - start
print(seconds, hashlib.sha256(",".join(x.labels[0] for x in preds).encode()).hexdigest()[:12])
"""


def fmnist_files(work: Path, n: int) -> tuple[Path, Path]:
    from PIL import Image

    from vitlab.data import load_data

    folder = work / "fmnist_images"
    if not folder.exists():
        folder.mkdir(parents=True)
        test = load_data("bundled", progress=False, report=False).test
        for i in range(n):
            Image.fromarray(test[i][0][0].numpy()).save(folder / f"{i:04d}.png")
    return FMNIST_MODEL, folder


def ti16_files(work: Path, n: int) -> tuple[Path, Path]:
    import numpy as np
    from PIL import Image

    import vitlab

    model, folder = work / "vit-ti16", work / "ti16_images"
    if not model.exists():
        vitlab.save(vitlab.create_model("vit-ti/16", seed=0), model)
    if not folder.exists():
        folder.mkdir(parents=True)
        rng = np.random.default_rng(0)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)).save(folder / f"{i:03d}.jpg")
    return model, folder


def run(src: Path, model: Path, images: Path, batch: int) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run([sys.executable, "-c", RUN, str(model), str(images), str(batch)], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return float(out[0]), out[1]


def stream_rule(work: Path, rounds: int) -> None:
    """`predict_files` over the Fashion-MNIST images at batch 1 in this process, interleaved in a new random order
    each round: the model itself, TorchEngine without and with its one-thread rule for small calls."""
    import random
    import time

    import torch

    import vitlab
    from vitlab.engine.torch_engines import TorchEngine
    from vitlab.predict import predict_files

    model_dir, images = fmnist_files(work, 512)
    model, meta = vitlab.weights.load_with_meta(model_dir)
    files = sorted(images.iterdir())
    runners = {"the model itself": lambda: None,
               "eager engine, small calls on both threads": lambda: TorchEngine(model, small_calls_on_one_thread=False),
               "eager engine, small calls on one thread": lambda: TorchEngine(model)}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name in random.sample(list(runners), len(runners)):
            engine = runners[name]()
            start = time.perf_counter()
            predict_files(model, meta, files, top_k=1, batch_size=1, engine_factory=lambda e=engine: e)
            times[name].append(time.perf_counter() - start)
    print(f"predict_files, {len(files)} Fashion-MNIST images at batch 1, one process, {torch.get_num_threads()} "
          f"threads, median of {rounds} rounds:")
    base = statistics.median(times["the model itself"])
    for name, values in times.items():
        print(f"  {name:44s} {statistics.median(values):7.3f} s  x{base / statistics.median(values):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=Path, help="the other checkout's source tree (its src folder)")
    ap.add_argument("--stream-rule", action="store_true", help="the one-thread rule in a stream of calls, in-process")
    ap.add_argument("--models", default="fmnist,vit-ti/16")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/vitlab-predict-engine-torch"))
    args = ap.parse_args()
    if args.stream_rule:
        stream_rule(args.work, args.runs)
        return
    if args.src is None:
        ap.error("--src is needed to compare two checkouts")
    trees = {"this checkout": ROOT / "src", f"{args.src}": args.src}
    print(f"predict(engine='torch'), seconds for the call, median of {args.runs} runs (fresh process each, "
          "interleaved); images/s; label digest")
    for name in args.models.split(","):
        model, images = fmnist_files(args.work, 512) if name == "fmnist" else ti16_files(args.work, 64)
        n = len(list(images.iterdir()))
        for batch in map(int, args.batches.split(",")):
            times: dict[str, list[float]] = {t: [] for t in trees}
            digests: dict[str, set[str]] = {t: set() for t in trees}
            for _ in range(args.runs):
                for tree, src in trees.items():
                    seconds, digest = run(src, model, images, batch)
                    times[tree].append(seconds)
                    digests[tree].add(digest)
            medians = {t: statistics.median(v) for t, v in times.items()}
            other = medians[str(args.src)]
            for tree, seconds in medians.items():
                print(f"  {name:10s} {n:4d} images, batch {batch:3d}  {tree:28s} {seconds:7.3f} s  "
                      f"{n / seconds:8.1f} images/s  x{other / seconds:.2f}  {','.join(sorted(digests[tree]))}")


if __name__ == "__main__":
    main()
