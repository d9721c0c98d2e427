"""The class-token-only last block (models/vit.py, CLASS_TOKEN_ONLY): same logits and gradients as the full
block, less work, and the full tokens wherever someone looks at them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import vitlab
import vitlab.models.vit as vit_module

SMALL = dict(dim=32, depth=3, heads=4, mlp_dim=64, patch_size=4, image_size=16)


def perturbed(seed: int = 0, name: str = "custom", **kw) -> torch.nn.Module:
    """A ViT (a small custom one unless named) with random non-zero weights everywhere (the zero-initialised head
    would hide any difference)."""
    args = dict(SMALL if name == "custom" else {}, num_classes=7, seed=seed)
    args.update(kw)
    model = vitlab.create_model(name, **args)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def images(n: int = 5, size: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def logits_both_ways(model, x, monkeypatch, **kwargs):
    monkeypatch.setattr(vit_module, "CLASS_TOKEN_ONLY", False)
    full = model(x, **kwargs)
    monkeypatch.setattr(vit_module, "CLASS_TOKEN_ONLY", True)
    return full, model(x, **kwargs)


@pytest.mark.parametrize("grad", [False, True])
def test_same_logits_as_the_full_last_block(grad, monkeypatch):
    model, x = perturbed().eval(), images()
    with torch.set_grad_enabled(grad):
        full, short = logits_both_ways(model, x, monkeypatch)
    assert full.abs().max() > 0.5
    torch.testing.assert_close(short, full, rtol=0, atol=1e-5 * full.abs().max().item())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_same_gradients_in_training(checkpointing, monkeypatch):
    model, x = perturbed(seed=2).train(), images(seed=3)
    model.set_grad_checkpointing(checkpointing)
    y = torch.tensor([0, 1, 2, 3, 4])

    def grads(short: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(vit_module, "CLASS_TOKEN_ONLY", short)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        return [p.grad.clone() for p in model.parameters()]

    for full, short in zip(grads(False), grads(True)):
        torch.testing.assert_close(short, full, rtol=1e-5, atol=1e-6 * max(full.abs().max().item(), 1.0))


class MatmulMacs(TorchDispatchMode):
    """MACs of the matrix products as they run. Not FlopCounterMode: its module hooks count as someone watching,
    which keeps the full last block (so FLOP counts stay the paper's)."""

    def __init__(self):
        super().__init__()
        self.macs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            a, b = args[-2], args[-1]
            self.macs += a.numel() * b.shape[-1]
        return out


def counted_macs(model, x) -> int:
    with MatmulMacs() as counter, torch.no_grad():
        model(x)
    return counter.macs


def test_the_last_block_computes_one_token(monkeypatch):
    """The last block saves the projection and the MLP of every token but the class token (the attention core's
    saving is not counted: on the CPU it runs as one fused kernel)."""
    model, x = perturbed(depth=2).eval(), images(n=2)
    cfg = model.config
    n = cfg.grid_size[0] * cfg.grid_size[1] + 1
    monkeypatch.setattr(vit_module, "CLASS_TOKEN_ONLY", False)
    full = counted_macs(model, x)
    monkeypatch.setattr(vit_module, "CLASS_TOKEN_ONLY", True)
    saved = x.shape[0] * (n - 1) * (cfg.dim * cfg.dim + 2 * cfg.dim * cfg.mlp_dim)
    assert full - counted_macs(model, x) == saved


def test_flop_counters_see_the_whole_model():
    from torch.utils.flop_counter import FlopCounterMode

    model = perturbed().eval()
    with FlopCounterMode(display=False):
        assert not model._class_token_only(False)


def test_hooks_see_the_full_tokens(monkeypatch):
    model, x = perturbed().eval(), images(n=2)
    n = model.config.grid_size[0] * model.config.grid_size[1] + 1
    seen = []
    handle = model.blocks[-1].mlp.register_forward_hook(lambda m, i, out: seen.append(out.shape))
    full, short = logits_both_ways(model, x, monkeypatch)
    handle.remove()
    assert seen == [(2, n, 32), (2, n, 32)]
    torch.testing.assert_close(short, full, rtol=0, atol=0)

    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, out: seen.append(tuple(out.shape)) if m is model.norm else None)
    try:
        model(x)
    finally:
        handle.remove()
    assert seen[-1] == (2, n, 32)
    assert model._class_token_only(False)  # every hook removed: the short route is back


def test_module_tree_is_every_module_once():
    from vitlab.models.fast_linear import module_tree

    model = perturbed()
    block = model.blocks[-1]
    block.attn.register_module("shared", block.mlp.fc1)  # one layer under two names: listed once
    block.mlp.register_module("nothing", None)  # an empty slot: not a module
    tree = module_tree(block, model.norm)
    assert len(tree) == len({id(m) for m in tree})
    assert {id(m) for m in tree} == {id(m) for m in [*block.modules(), *model.norm.modules()]}


@pytest.mark.parametrize("where", ["fc1", "act", "drop2", "norm"])
def test_a_hook_deep_in_the_last_block_or_on_the_final_norm_keeps_the_full_tokens(where):
    model = perturbed().eval()
    layer = model.norm if where == "norm" else getattr(model.blocks[-1].mlp, where)
    handle = layer.register_forward_pre_hook(lambda m, args: None)
    assert not model._class_token_only(False)
    handle.remove()
    assert model._class_token_only(False)


def test_attention_maps_and_features_stay_whole():
    model, x = perturbed().eval(), images(n=2)
    n = model.config.grid_size[0] * model.config.grid_size[1] + 1
    logits, attentions = model(x, return_attention=True)
    assert [a.shape for a in attentions] == [(2, 4, n, n)] * 3
    torch.testing.assert_close(logits, model(x), rtol=0, atol=1e-5)
    assert model.forward_features(x).shape == (2, n, 32)


@pytest.mark.parametrize("classifier", ["gap", "map"])
def test_pooled_heads_keep_every_token(classifier):
    model = perturbed(classifier=classifier)
    assert not model._class_token_only(False)


def test_fusable_onnx_copy_computes_the_same_logits():
    from vitlab.engine.onnx_graph import fusable_copy

    model, x = perturbed().eval(), images()
    with torch.no_grad():
        torch.testing.assert_close(fusable_copy(model)(x), model(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name,overrides", [
    ("r+vit-ti/16", dict(image_size=64)),  # hybrid: ResNet body, then the blocks
    ("custom", dict(conv_stem=[16, 32], patch_size=2, dim=32, depth=2, heads=2, mlp_dim=64, image_size=32)),
    ("vit-ti/16", dict(image_size=32, patch_size=8, depth=2, representation_size=48)),  # pre-logits layer
])
def test_same_logits_for_hybrids_and_heads_with_a_representation_layer(name, overrides, monkeypatch):
    model = perturbed(name=name, **overrides).eval()
    x = images(n=2, size=model.config.image_size[0])
    assert model._class_token_only(False)
    with torch.no_grad():
        full, short = logits_both_ways(model, x, monkeypatch)
    torch.testing.assert_close(short, full, rtol=0, atol=1e-5 * full.abs().max().item())
