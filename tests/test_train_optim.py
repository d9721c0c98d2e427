"""Optimiser and schedule: the official warm-up + linear/cosine formula, the paper's weight-decay mask,
decoupled decay (AdamW) checked by hand."""

import math

import pytest
import torch

from vitlab.models.registry import create_model
from vitlab.train.optim import build_optimizer, build_scheduler, decay_mask, lr_factor, param_groups


def tiny_vit():
    return create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=2, image_size=8, in_chans=1,
                        num_classes=3, seed=0)


def test_cosine_schedule_matches_hand_computed_values():
    # total 100, warm-up 10, base 1: step 5 -> 0.5 (warm-up), step 10 -> 1, step 55 -> cos(pi/2) -> 0.5, step 100 -> 0
    assert lr_factor(0, 100, 10, "cosine") == 0.0
    assert lr_factor(5, 100, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(10, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_factor(55, 100, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(100, 100, 10, "cosine") == pytest.approx(0.0, abs=1e-12)
    # progress 0.25 -> 0.5 (1 + cos(pi/4))
    assert lr_factor(32.5, 100, 10, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_linear_schedule_ends_at_linear_end():
    base, end = 1e-3, 1e-5
    assert lr_factor(10, 110, 10, "linear", base, end) * base == pytest.approx(base)
    assert lr_factor(60, 110, 10, "linear", base, end) * base == pytest.approx(end + (base - end) * 0.5)
    assert lr_factor(110, 110, 10, "linear", base, end) * base == pytest.approx(end)
    # warm-up multiplies the decayed value, as vit_jax does
    assert lr_factor(4, 110, 10, "linear", base, end) * base == pytest.approx(base * 0.4)


def test_scheduler_steps_lr_of_optimizer():
    model = tiny_vit()
    opt = build_optimizer(model, "sgd", lr=0.1)
    sched = build_scheduler(opt, total_steps=20, warmup_steps=4, decay="cosine", base_lr=0.1)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:5] == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1])


def test_decay_mask_is_weight_matrices_only():
    model = tiny_vit()
    mask = decay_mask(model)
    decayed = {n for n, d in mask.items() if d}
    assert decayed == {
        "patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight",
        "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight", "head.weight",
    }
    for name in ("cls_token", "pos_embed", "norm.weight", "norm.bias", "blocks.0.norm1.weight", "head.bias"):
        assert mask[name] is False
    groups = param_groups(model, 0.1)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_adamw_decay_is_decoupled_and_masked():
    """With a zero gradient Adam's update is 0, so only decay acts: w <- w (1 - lr wd) on matrices, biases untouched."""
    model = tiny_vit()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, "adamw", lr=0.01, weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = dict(model.named_parameters())
    torch.testing.assert_close(after["blocks.0.mlp.fc1.weight"], before["blocks.0.mlp.fc1.weight"] * (1 - 0.01 * 0.1))
    torch.testing.assert_close(after["pos_embed"], before["pos_embed"])
    torch.testing.assert_close(after["blocks.0.mlp.fc1.bias"], before["blocks.0.mlp.fc1.bias"])


def test_sgd_is_heavy_ball_momentum():
    """m = 0.9 m + g; w -= lr m (the official momentum optimiser), no decay."""
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = build_optimizer([{"params": [p], "weight_decay": 0.0}], "sgd", lr=0.1, momentum=0.9)
    for _ in range(2):
        p.grad = torch.tensor([1.0])
        opt.step()
    # step 1: m = 1, w = 0.9; step 2: m = 1.9, w = 0.9 - 0.19 = 0.71
    assert float(p.detach()) == pytest.approx(0.71)
