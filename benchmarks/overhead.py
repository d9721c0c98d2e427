"""What one forward pass costs beyond its arithmetic: a ViT of a real model's depth and head count with 8-wide
layers and 2 tokens (all of its time is per-operator work: Python, the dispatcher, kernel launches, thread
wake-ups), in eager PyTorch (`--engine torch`) and in ONNX Runtime (`--engine onnxruntime`), against the same
engines running the real model at batch 1; then the same small model called after idle gaps of 0-50 ms (how
fast each engine's worker threads come back from sleep).

    python benchmarks/overhead.py                       # ViT-Ti/16's depth; torch's default threads
    python benchmarks/overhead.py --model vit-b/16 --threads 1
    python benchmarks/overhead.py --profile             # where eager PyTorch's per-call time goes (cProfile)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import vitlab
from vitlab.engine.ort import OrtEngine, build_fp32
from vitlab.engine.torch_engines import TorchEngine


def engines(model: torch.nn.Module, size: int, threads: int, tmp: Path) -> dict:
    return {"torch": TorchEngine(model), "onnxruntime": OrtEngine(build_fp32(model, tmp, (size, size)), threads)}


def ms_after_idle(engine, x: torch.Tensor, gap_s: float, calls: int) -> float:
    """Median ms of a call made after the engine sat idle for gap_s (0: back to back)."""
    times = []
    for _ in range(calls):
        if gap_s:
            time.sleep(gap_s)
        start = time.perf_counter()
        engine(x)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def ms_per_call(model: torch.nn.Module, size: int, threads: int, calls: int,
                gaps: tuple[float, ...] = (0.0,)) -> dict[str, list[float]]:
    """Per engine, the median ms of a batch-1 call after each idle gap (0: back to back), each engine warmed up."""
    with tempfile.TemporaryDirectory() as tmp:
        x = torch.randn(1, model.config.in_chans, size, size)
        out = {}
        for name, engine in engines(model.eval(), size, threads, Path(tmp)).items():
            for _ in range(20):
                engine(x)
            out[name] = [ms_after_idle(engine, x, gap, calls) for gap in gaps]
        return out


def profile_eager(model: torch.nn.Module, calls: int = 200, top: int = 15) -> None:
    """cProfile of the small model in the torch engine: Python functions and the C++ operators they call."""
    import cProfile
    import pstats

    engine, x = TorchEngine(model.eval()), torch.randn(1, model.config.in_chans, 16, 16)
    for _ in range(20):
        engine(x)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        engine(x)
    profiler.disable()
    print(f"  cProfile of {calls} eager calls of the 8-wide model (the profiler itself adds to every Python call):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit-ti/16")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--profile", action="store_true", help="profile the small model's eager calls instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    real = vitlab.create_model(args.model)
    cfg = real.config
    # Same depth, heads and classes; 8-wide heads, a 16 px image cut into one patch: 2 tokens.
    tiny = vitlab.create_model("custom", depth=cfg.depth, heads=cfg.heads, dim=8 * cfg.heads, mlp_dim=32 * cfg.heads,
                               patch_size=16, image_size=16, num_classes=cfg.num_classes)
    if args.profile:
        profile_eager(tiny)
        return
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.rounds} calls back to back, batch 1, "
          "ms per image")
    gaps = (0.0, 0.001, 0.005, 0.05)
    small = ms_per_call(tiny, 16, args.threads, args.rounds, gaps)
    whole = ms_per_call(real, cfg.image_size[0], args.threads, max(args.rounds // 4, 5))
    for name, (overhead, *_) in small.items():
        print(f"  {name:12s} {args.model} {whole[name][0]:7.2f}   same depth, 8-wide, 2 tokens {overhead:6.2f}"
              f"   ({100 * overhead / whole[name][0]:.0f} % of the real model's time)")
    print("  the 8-wide model after an idle gap of " + ", ".join(f"{g * 1e3:g} ms" for g in gaps) + " (ms per call):")
    for name, times in small.items():
        print(f"  {name:12s} " + "  ".join(f"{ms:7.2f}" for ms in times))


if __name__ == "__main__":
    main()
