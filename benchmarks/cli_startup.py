"""How long the `vitlab` command takes to start: `--help`, `models`, `models --pretrained` and `train --help`.

    .venv/bin/python benchmarks/cli_startup.py            # median of 5 runs each
    .venv/bin/python benchmarks/cli_startup.py --runs 9

Each run is a fresh `python -m vitlab ...` subprocess with the current interpreter (the `vitlab` script
does the same), output discarded. None of them imports torch: `models` prints the committed table of
commands/models.py (checked against the built models by tests/test_models_table.py), `models --pretrained`
the registry of weights/pretrained.py. Target (issue 18 item 5): `models` under 0.5 s on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = [["--help"], ["models"], ["models", "--pretrained"], ["train", "--help"]]


def time_command(args: list[str], runs: int) -> float:
    """The median wall time of `runs` fresh processes, in seconds."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "vitlab", *args], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per command (default 5)")
    args = parser.parse_args()
    print(f"{'command':<28} median of {args.runs}")
    for cmd in COMMANDS:
        print(f"{'vitlab ' + ' '.join(cmd):<28} {time_command(cmd, args.runs):.2f} s")


if __name__ == "__main__":
    main()
