"""benchmarks/fmnist_profile.py: its shares are of the profiled time and its call timings are positive (the
numbers docs/benchmarks.md quotes from docs/results/fmnist_profile_b32.txt)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fmnist_profile  # noqa: E402
from direct_inference import model_and_images  # noqa: E402

from vitlab.engine.torch_engines import TorchEngine  # noqa: E402


def test_profile_shares_and_call_times():
    model, x = model_and_images("fmnist", 2)
    engine = TorchEngine(model)
    rows = fmnist_profile.shares(engine, x, calls=2)
    names = [name for name, _, _ in rows]
    assert any("linear" in name or "addmm" in name for name in names), names  # the products are profiled
    assert 0.5 < sum(share for _, share, _ in rows) <= 1.0 + 1e-9
    back, paused = fmnist_profile.call_times(engine, x, n=2)
    assert back > 0 and paused > 0
