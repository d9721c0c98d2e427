"""How far the whole eager call is from ONNX Runtime when Python is taken out of it: the Fashion-MNIST-size ViT (the
model of issue 18 item 2 that eager PyTorch loses to ORT) at batch 1, on one thread as `--engine torch` runs it
(`engine.torch_engines.ONE_THREAD_MAX_FLOPS`), timed three ways in a new random order each round:

- `torch engine`: what `--engine torch` runs (direct operator calls, weights packed for oneDNN);
- `torchscript`: the model traced and frozen (`torch.jit.trace` + `torch.jit.freeze`), the same ATen operators
  called from TorchScript's C++ interpreter instead of Python: about what a C++ extension of our own could reach
  without kernels of its own (torch.jit is deprecated in torch 2.13 and warns, so it is no route to ship);
- `onnxruntime`: vitlab's fused ORT graph (`--engine onnxruntime`, 2 threads as the runtime picks).

Each after no pause, 5 ms and 50 ms of idle time (the pause `peers.py` leaves before every call), median ms.

    python benchmarks/torchscript_call.py [--rounds 40] > docs/results/torchscript_call.txt
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from direct_inference import model_and_images

from vitlab.engine.ort import OrtEngine, build_fp32
from vitlab.engine.torch_engines import TorchEngine, one_thread


def engines(model: torch.nn.Module, x: torch.Tensor, folder: Path) -> dict:
    eager = TorchEngine(model)
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # deprecation and tracer warnings
        scripted = torch.jit.freeze(torch.jit.trace(model, x))

    def torchscript(images):
        with torch.inference_mode(), one_thread():
            return scripted(images)

    ort = OrtEngine(build_fp32(model, folder, tuple(x.shape[-2:])), torch.get_num_threads())
    with torch.inference_mode():
        ref = eager(x)
        for name, run in (("torchscript", torchscript), ("onnxruntime", ort)):
            print(f"# {name}: max |logit - torch engine| {float((run(x) - ref).abs().max()):.1e}")
    return {"torch engine": eager, "torchscript": torchscript, "onnxruntime": ort}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    print(f"# {platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    model, x = model_and_images("fmnist", 1)
    with tempfile.TemporaryDirectory() as tmp:
        rows = engines(model.eval(), x, Path(tmp))
        for _ in range(50):  # warm-up
            for run in rows.values():
                run(x)
        rng = random.Random(0)
        print(f"{'pause':>8} " + " ".join(f"{name:>14}" for name in rows) + "   (median ms a call)")
        for pause in (0.0, 0.005, 0.05):
            times = {name: [] for name in rows}
            for _ in range(args.rounds):
                order = list(rows)
                rng.shuffle(order)
                for name in order:
                    time.sleep(pause)
                    start = time.perf_counter()
                    rows[name](x)
                    times[name].append(time.perf_counter() - start)
            print(f"{pause * 1e3:6.0f}ms " + " ".join(f"{1e3 * statistics.median(t):14.3f}" for t in times.values()))


if __name__ == "__main__":
    main()
