"""The oneDNN route of the model's linear layers (vitlab.models.fast_linear) against torch's F.linear, the
reference: outputs and all three gradients equal up to fp32 summation order, and the route stays out of the way
wherever it would not compute the same thing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import vitlab
from vitlab.models import fast_linear

pytestmark = pytest.mark.skipif(not fast_linear.onednn_linear_available(), reason="no oneDNN in this torch build")


def layer(bias: bool = True, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(48, 80, bias=bias)


def inputs(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return float((a - b).abs().max()) <= rel * float(b.abs().max())


@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_inference_equals_f_linear(shape, bias):
    fc, x = layer(bias), inputs(*shape)
    with torch.no_grad():
        assert close(fast_linear.linear(x, fc), F.linear(x, fc.weight, fc.bias))


@pytest.mark.parametrize("bias", [True, False])
def test_gradients_equal_f_linear_and_the_float64_truth(bias):
    fc = layer(bias)
    x = inputs(3, 5, 48).requires_grad_()
    g = inputs(3, 5, 80, seed=2)
    params = [x, fc.weight] + ([fc.bias] if bias else [])
    ours = torch.autograd.grad(fast_linear.linear(x, fc), params, g)
    ref = torch.autograd.grad(F.linear(x, fc.weight, fc.bias), params, g)
    truth = torch.autograd.grad(F.linear(x.double(), fc.weight.double(), None if fc.bias is None else fc.bias.double()),
                                params, g.double())
    for a, b, t in zip(ours, ref, truth):
        assert close(a, b)
        assert float((a.double() - t).abs().max()) <= 4 * float((b.double() - t).abs().max()) + 1e-6


def test_only_the_gradients_asked_for_are_computed():
    fc = layer()
    fc.weight.requires_grad_(False)
    x = inputs(4, 48).requires_grad_()
    out = fast_linear.linear(x, fc)
    out.sum().backward()
    assert fc.weight.grad is None and fc.bias.grad is not None and x.grad is not None
    assert close(x.grad, torch.ones(4, 80) @ fc.weight)


def test_route_applies_only_to_plain_cpu_fp32():
    fc, x = layer(), inputs(4, 48)
    assert fast_linear.onednn_linear_applies(x, fc.weight)
    assert not fast_linear.onednn_linear_applies(x.double(), fc.weight.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fast_linear.onednn_linear_applies(x, fc.weight)
    with FlopCounterMode(display=False) as counter:  # dispatch modes see torch's own aten ops
        fast_linear.linear(x, fc)
    assert counter.get_total_flops() == 2 * 4 * 48 * 80


def small_vit(image_size: int = 32, patch_size: int = 8, dim: int = 48, mlp_dim: int = 96) -> torch.nn.Module:
    torch.manual_seed(0)
    model = vitlab.create_model("custom", image_size=image_size, patch_size=patch_size, dim=dim, depth=2, heads=4,
                                mlp_dim=mlp_dim, num_classes=5).eval()
    with torch.no_grad():
        for p in model.parameters():  # the official init zeroes the head: logits of 0 would hide any change
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_whole_model_step_unchanged(monkeypatch):
    model = small_vit(image_size=16, patch_size=4, dim=32, mlp_dim=64).train()
    x, y = inputs(6, 3, 16, 16, seed=3), torch.arange(6) % 5
    results = {}
    for route in (True, False):
        monkeypatch.setattr(fast_linear, "ONEDNN_LINEAR", route)
        model.zero_grad()
        with torch.inference_mode():
            logits = model(x)
        F.cross_entropy(model(x), y).backward()
        results[route] = (logits, [p.grad.clone() for p in model.parameters()])
    (l1, g1), (l0, g0) = results[True], results[False]
    assert (l1 - l0).abs().max() < 1e-5
    assert max(float((a - b).abs().max()) for a, b in zip(g1, g0)) < 1e-5


needs_packing = pytest.mark.skipif(not fast_linear.packing_available(), reason="no weight packing in this build")


@needs_packing
def test_torch_engine_packs_block_weights_once_and_gives_the_same_logits():
    from vitlab.engine.torch_engines import TorchEngine

    model, x = small_vit(), inputs(5, 3, 32, 32, seed=4)
    with torch.inference_mode():
        plain = model(x)
    engine = TorchEngine(model)
    assert close(engine(x), plain, rel=1e-6)
    assert len(engine.packed._packs) == 4 * 2  # qkv, proj, fc1, fc2 of both blocks; the head stays F.linear
    packed = [entry[1] for entry in engine.packed._packs.values()]
    assert close(engine(x[:2]), plain[:2], rel=1e-6)  # a smaller (last) batch reuses the same copies
    assert all(a is b for a, b in zip(packed, (entry[1] for entry in engine.packed._packs.values())))
    with torch.inference_mode():
        model(x)  # outside the engine the plain weights are used and nothing is packed
    assert len(engine.packed._packs) == 8


@needs_packing
@pytest.mark.parametrize("change", ["in place", "load_state_dict", "new parameter", "optimizer step"])
def test_packed_copies_follow_weights_that_change(change):
    from vitlab.engine.torch_engines import TorchEngine

    model, x = small_vit(), inputs(3, 3, 32, 32, seed=5)
    engine = TorchEngine(model)
    before = engine(x)
    fc1 = model.blocks[0].mlp.fc1
    if change == "in place":
        with torch.no_grad():
            fc1.weight.mul_(-1.5)
    elif change == "load_state_dict":
        state = {k: v * 0.5 for k, v in model.state_dict().items()}
        model.load_state_dict(state)
    elif change == "new parameter":
        fc1.weight = torch.nn.Parameter(torch.randn_like(fc1.weight))
    else:
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model(x).square().sum().backward()
        opt.step()
        model.eval()
    with torch.inference_mode():
        plain = model(x)
    after = engine(x)
    assert not close(after, before, rel=1e-3)
    assert close(after, plain, rel=1e-6)


@needs_packing
def test_no_packed_copies_where_memory_is_short(monkeypatch):
    from vitlab.engine.torch_engines import TorchEngine

    model, x = small_vit(), inputs(2, 3, 32, 32, seed=6)
    weights = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    monkeypatch.setattr(fast_linear, "available_memory_bytes", lambda: 4 * weights - 1)
    assert not fast_linear.packing_fits(model)
    engine = TorchEngine(model)
    assert engine.packed is None
    with torch.inference_mode():
        assert torch.equal(engine(x), model(x))
    monkeypatch.setattr(fast_linear, "available_memory_bytes", lambda: 4 * weights)
    assert fast_linear.packing_fits(model) and TorchEngine(model).packed is not None
    monkeypatch.setattr(fast_linear, "available_memory_bytes", lambda: None)  # an OS that cannot say
    assert fast_linear.packing_fits(model)


@pytest.mark.parametrize("rows, in_f, out_f, small", [
    (50, 64, 192, True),  # the Fashion-MNIST ViT's qkv at batch 1
    (197, 192, 576, False),  # ViT-Ti/16's qkv at batch 1
    (1, 192, 192, True),  # a class-token-only proj at ViT-Ti/16 size
    (1, 384, 1536, False),  # ... and fc1 at ViT-S/16 size: oneDNN's packed weights are faster for one row
])
def test_the_smallest_inference_products_take_f_linear(rows, in_f, out_f, small, monkeypatch):
    """F.linear (MKL) for the smallest inference products, oneDNN above; the module route decides by shape."""
    fc = torch.nn.Linear(in_f, out_f)
    assert fast_linear.small_product(rows, fc.weight) is small
    onednn_calls = []
    real = fast_linear.onednn_product
    monkeypatch.setattr(fast_linear, "onednn_product", lambda *a: onednn_calls.append(1) or real(*a))
    x = torch.randn(1, rows, in_f)
    with torch.inference_mode():
        out = fast_linear.linear(x, fc)
        reference = F.linear(x, fc.weight, fc.bias)
    assert bool(onednn_calls) is not small
    if small:
        assert torch.equal(out, reference)
    else:
        assert close(out, reference, rel=1e-5)
