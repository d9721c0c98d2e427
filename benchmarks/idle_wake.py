"""What an idle pause costs torch's CPU threads on this machine: the same elementwise op (an add of two 1M-float
tensors) timed as the 1st..6th op after sleeping `pause` seconds, with 1 and 2 threads. benchmarks/peers.py and
`--engine auto` wait 50 ms before every timed call (so that ONNX Runtime's spinning threads never slow the next
row); where a pause makes the next ops slow, short calls of every torch row pay it (docs/benchmarks.md).

    python benchmarks/idle_wake.py
    OMP_WAIT_POLICY=ACTIVE python benchmarks/idle_wake.py      # workers that spin instead of sleeping
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def after_pause(pause: float, ops: int = 6, repeats: int = 30) -> list[float]:
    """Median microseconds of the 1st..`ops`th add after each pause."""
    a, b = torch.randn(1 << 20), torch.randn(1 << 20)
    times: list[list[float]] = [[] for _ in range(ops)]
    for _ in range(repeats):
        time.sleep(pause)
        for i in range(ops):
            t = time.perf_counter()
            a.add(b)
            times[i].append(time.perf_counter() - t)
    return [statistics.median(ts) * 1e6 for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pauses", default="0,0.02,0.05,0.1")
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    print(f"torch {torch.__version__}; microseconds of the 1st..6th add of 1M floats after the pause")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for pause in (float(p) for p in args.pauses.split(",")):
            us = after_pause(pause)
            print(f"threads {threads}  pause {pause * 1e3:5.0f} ms: " + " ".join(f"{u:7.0f}" for u in us))


if __name__ == "__main__":
    main()
