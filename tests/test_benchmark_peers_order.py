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


def test_repeat_ratios_divide_each_of_our_fp32_rows_by_that_repeats_fastest_peer(capsys):
    rows = {"vitlab torch": ("ours", None), "vitlab int8": ("ours-int8", None),
            "timm torch": ("peer", None), "timm -> ORT": ("peer", None)}
    runs = [{"vitlab torch": 9.0, "vitlab int8": 50.0, "timm torch": 6.0, "timm -> ORT": 10.0},
            {"vitlab torch": 12.0, "vitlab int8": 50.0, "timm torch": 8.0, "timm -> ORT": 7.0}]
    out = peers.repeat_ratios("vit-ti/16", 1, rows, runs)
    assert out == [{"model": "vit-ti/16", "batch": 1, "engine": "vitlab torch", "vs_best_peer_each_repeat": [0.9, 1.5],
                    "images_per_s_each_repeat": [9.0, 12.0], "best_peer_images_per_s_each_repeat": [10.0, 8.0]}]
    assert "each repeat: 0.90 1.50  (median 1.20)" in capsys.readouterr().out


def test_each_repeat_lists_every_rows_images_per_second(capsys):
    runs = [{"vitlab torch": 47.4}, {"vitlab torch": 56.8}, {"vitlab torch": 50.0}]
    out = peers.each_repeat("vit-ti/16", 1, runs)
    assert out == [{"model": "vit-ti/16", "batch": 1, "engine": "vitlab torch",
                    "images_per_s_each_repeat": [47.4, 56.8, 50.0]}]
    assert "each repeat: 47.4 56.8 50.0  (median 50.0)" in capsys.readouterr().out
