"""benchmarks/cpu_rounding.py reuses the tests' own fixtures by name (test_weights_bit's BiT case, the attention and
GELU inputs, test_train_loop's tiny run): it keeps running, and prints its four figures, as those tests change."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cpu_rounding  # noqa: E402


def test_the_rounding_figures_are_printed(capsys, keep_torch_threads):
    cpu_rounding.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(("vitlab", "epoch"))]
    assert len(lines) == 5 and lines[0].startswith("torch ")
    for line, start in zip(lines[1:], ("BiT-R50x1 logits", "attention gradients", "tanh GELU gradient", "16 x 1")):
        assert line.startswith(start) and re.search(r"\d\.?\d*e-\d\d", line), line
