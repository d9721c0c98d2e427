"""`analytic_macs` against torch's own FlopCounterMode (convolutions and matmuls, counted as they run).

FlopCounterMode does not see the fused attention on CPU, so the attention matmuls (2 * N^2 * D per
block) are added by hand; everything else must agree exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vitlab.models.registry import analytic_macs, build_model, get_config


def _counted_macs(cfg, monkeypatch) -> float:
    """The whole model's MACs: the class-token-only last block (models/vit.py) is off, as in the paper's count."""
    import vitlab.models.vit as vit_module

    monkeypatch.setattr(vit_module, "CLASS_TOKEN_ONLY", False)
    model = build_model(cfg).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, cfg.in_chans, *cfg.image_size))
    return counter.get_total_flops() / 2


@pytest.mark.parametrize("name,overrides", [
    ("custom", dict(patch_size=4, dim=64, depth=2, heads=4, mlp_dim=128, image_size=28, in_chans=1)),
    ("custom", dict(conv_stem=[48, 96, 192], patch_size=1, classifier="gap", posemb="sincos2d", dim=64, depth=2,
                    heads=4, mlp_dim=128, image_size=28, in_chans=1)),  # conv stem (padded, 28 -> 4)
    ("custom", dict(conv_stem=[16, 32], patch_size=2, dim=32, depth=1, heads=2, mlp_dim=64, image_size=30)),
    ("resnet-50-small", dict(base_width=8, image_size=28, in_chans=1, num_classes=7)),
    ("resnet-18", dict(image_size=64)),
    ("bit-r26x1", dict(image_size=64)),
])
def test_analytic_macs_match_flop_counter(name, overrides, monkeypatch):
    cfg = get_config(name, **overrides)
    attention = 0
    if cfg.arch == "vit":
        n = cfg.grid_size[0] * cfg.grid_size[1] + cfg.num_prefix_tokens
        attention = cfg.depth * 2 * n * n * cfg.dim
    assert analytic_macs(cfg) - attention == pytest.approx(_counted_macs(cfg, monkeypatch), rel=1e-9)
