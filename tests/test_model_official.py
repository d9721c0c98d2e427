"""vitlab against outputs of the official Flax implementation (shared/fixtures/official)."""

from pathlib import Path

import numpy as np
import pytest
import torch

import vitlab

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "official"
CASES = ["tiny_token_linen", "tiny_token_prelinen"]
pytestmark = pytest.mark.skipif(not FIXTURES.exists(), reason="shared/fixtures/official not present")


def _max_diff(model, io):
    with torch.no_grad():
        out = model(torch.from_numpy(io["input_nchw"]).float())
    return np.abs(out.double().numpy() - io["logits"]).max()


@pytest.mark.parametrize("case", CASES)
def test_official_logits(case):
    model = vitlab.load(FIXTURES / f"{case}.npz")
    cfg = model.config
    assert (cfg.patch_size, cfg.dim, cfg.depth, cfg.heads, cfg.mlp_dim) == (8, 64, 2, 4, 128)
    assert cfg.classifier == "token" and cfg.num_classes == 10 and cfg.image_size == (32, 32)
    assert _max_diff(model, np.load(FIXTURES / f"{case}.io.npz")) <= 1e-5


@pytest.mark.parametrize("case", CASES)
def test_official_logits_after_posemb_resize(case):
    io = np.load(FIXTURES / f"{case}.resized.io.npz")
    size = io["input_nchw"].shape[-1]
    model = vitlab.load(FIXTURES / f"{case}.npz", image_size=size)
    assert model.config.image_size == (size, size)
    assert _max_diff(model, io) <= 1e-5
    # The same resampling happens on the fly for an input of another size.
    assert _max_diff(vitlab.load(FIXTURES / f"{case}.npz"), io) <= 1e-5


def test_attention_maps_on_official_weights_match_fused_logits():
    io = np.load(FIXTURES / "tiny_token_linen.io.npz")
    model = vitlab.load(FIXTURES / "tiny_token_linen.npz")
    with torch.no_grad():
        logits, attn = model(torch.from_numpy(io["input_nchw"]).float(), return_attention=True)
    assert np.abs(logits.double().numpy() - io["logits"]).max() <= 1e-5
    assert [a.shape for a in attn] == [(2, 4, 17, 17)] * 2


def test_finetune_surgery_on_official_weights():
    model = vitlab.load(FIXTURES / "tiny_token_linen.npz", num_classes=3, image_size=48)
    assert model.config.num_classes == 3 and model.pos_embed.shape == (1, 1 + 36, 64)
    assert torch.count_nonzero(model.head.weight) == 0
