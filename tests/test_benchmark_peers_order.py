"""benchmarks/peers.py times every row once per round, in an order that changes what each row follows (a row right
after an ONNX Runtime row runs slower on the VMs measured here; the old turning order kept every row behind the
same neighbour)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import peers  # noqa: E402


def test_every_row_once_per_round_and_behind_many_neighbours():
    labels = ["vitlab torch", "timm torch", "HF torch", "vitlab onnxruntime", "timm -> ORT", "timm -> ORT optimized"]
    order = peers.round_orders(labels, rounds=9)
    rounds = [order[i:i + len(labels)] for i in range(0, len(order), len(labels))]
    assert len(rounds) == 9 and all(sorted(r) == sorted(labels) for r in rounds)
    behind = Counter(order[i - 1] for i in range(1, len(order)) if order[i] == "vitlab torch")
    assert len(behind) >= 3 and max(behind.values()) <= 5  # the turning order gave one neighbour 8 times of 8
    assert peers.round_orders(labels, rounds=9) == order  # seeded: a rerun times the same order
