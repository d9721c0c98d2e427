"""The fast CPU routes of the official tanh GELU (vitlab.models.gelu) against torch's own GELU kernel, which is
the reference: forward within 1e-6, gradients within 1e-5, whole-model outputs and training steps unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vitlab
from vitlab.models import gelu
from vitlab.models.fast_linear import onednn_linear_available


def values(shape=(4096, 96), seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 4  # tails where tanh saturates


def test_onednn_epilogue_is_torchs_tanh_gelu_within_1e6():
    if not onednn_linear_available():
        pytest.skip("no oneDNN in this torch build")
    x = values()
    eye = torch.eye(x.shape[1])  # an identity matrix product is exact, so only the GELU differs
    fused = torch.ops.mkldnn._linear_pointwise(x, eye, torch.zeros(x.shape[1]), "gelu", [], "tanh")
    assert (fused - F.gelu(x, approximate="tanh")).abs().max() <= 1e-6


def test_slope_saving_form_forward_and_gradient_match_torch():
    x = values().requires_grad_()
    g = values(seed=1) / 4  # unit-scale incoming gradients
    ours = gelu.SlopeSavingTanhGelu.apply(x)
    ref = F.gelu(x, approximate="tanh")
    assert (ours - ref).abs().max() <= 1e-6
    (g_ours,) = torch.autograd.grad(ours, x, g)
    (g_ref,) = torch.autograd.grad(ref, x, g)
    assert (g_ours - g_ref).abs().max() <= 1e-5
    exact = torch.autograd.grad(F.gelu(x.double(), approximate="tanh"), x, g.double())[0]  # float64 truth
    # as close to the truth as torch's own gradient, give or take: 6.4e-6 at a largest gradient of 4.7 here, against
    # torch's 3.9e-6 with its vectorized kernels and 2.1e-6 with its scalar ones (ATEN_CPU_CAPABILITY=default)
    ref_error = float((g_ref.double() - exact).abs().max())
    assert (g_ours.double() - exact).abs().max() <= max(3 * ref_error, 2e-6 * float(exact.abs().max()))
    x64 = x.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(gelu.SlopeSavingTanhGelu.apply, (x64[:8, :8].clone().requires_grad_(),))


def mlp_layers(dim=24, hidden=96, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(dim, hidden), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(hidden, dim)


def test_training_mlp_route_matches_torchs_layers():
    """fc1 -> GELU -> fc2 with the GELU's backward in fc2's input-gradient product: output within 1e-6 and every
    gradient within 1e-5 of torch's own layers (F.linear and its tanh GELU kernel)."""
    if not onednn_linear_available():
        pytest.skip("no oneDNN in this torch build")
    fc1, act, fc2 = mlp_layers()
    x = (values((3, 41, 24), seed=3) / 4).requires_grad_()
    g = values((3, 41, 24), seed=4) / 4
    results = []
    for route in ("vitlab", "torch"):
        for p in (*fc1.parameters(), *fc2.parameters(), x):
            p.grad = None
        if route == "vitlab":
            out = gelu.mlp(x, fc1, act, torch.nn.Identity(), fc2)
            assert out.grad_fn.name().startswith("TanhGeluThenLinear")  # the fused route ran
        else:
            out = F.linear(F.gelu(F.linear(x, fc1.weight, fc1.bias), approximate="tanh"), fc2.weight, fc2.bias)
        out.backward(g)
        results.append((out.detach(), [t.grad.clone() for t in (x, *fc1.parameters(), *fc2.parameters())]))
    (out, grads), (ref, ref_grads) = results
    assert (out - ref).abs().max() <= 1e-6
    for ours, theirs in zip(grads, ref_grads):
        assert (ours - theirs).abs().max() <= 1e-5 * max(1.0, float(theirs.abs().max()))


def test_training_mlp_route_only_where_it_is_exact():
    """Dropout between GELU and fc2, a hook on fc2 or the GELU, bf16 autocast: the plain route (or the modules);
    with fc1 and the input frozen no gradient reaches the GELU, so fc1 + GELU take the fused inference product."""
    fc1, act, fc2 = mlp_layers()
    x = values((2, 9, 24), seed=5) / 4

    def route(drop=torch.nn.Identity(), inp=x):
        out = gelu.mlp(inp, fc1, act, drop, fc2)
        return out.grad_fn.name() if out.grad_fn is not None else None

    assert route().startswith("TanhGeluThenLinear") == onednn_linear_available()
    assert not route(torch.nn.Dropout(0.1)).startswith("TanhGeluThenLinear")  # the mask needs the plain route
    for layer in (fc2, act):
        handle = layer.register_forward_hook(lambda *a: None)
        assert not route().startswith("TanhGeluThenLinear")
        handle.remove()
    for p in fc1.parameters():
        p.requires_grad_(False)
    fused_calls = []
    real = gelu.linear_act
    gelu.linear_act = lambda *a: fused_calls.append(1) or real(*a)
    try:
        assert route() is not None and not route().startswith("TanhGeluThenLinear")  # only fc2 needs a gradient
        assert not fused_calls  # 18 rows: too small a product for the fused call (small_gelu_product)
        big = values((8, 40, 24), seed=6) / 4  # 320 x 24 -> 96: above the small-product limit
        assert not route(inp=big).startswith("TanhGeluThenLinear")
    finally:
        gelu.linear_act = real
    assert bool(fused_calls) == onednn_linear_available()
    with torch.no_grad():
        assert route() is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not route(inp=x.requires_grad_()).startswith("TanhGeluThenLinear")


def tiny(act: str = "tanh") -> torch.nn.Module:
    torch.manual_seed(0)
    model = vitlab.create_model("custom", image_size=16, patch_size=4, dim=32, depth=2, heads=4, mlp_dim=64,
                                num_classes=5, gelu=act)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_inference_and_training_step_unchanged(monkeypatch):
    x = torch.randn(6, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    y = torch.arange(6) % 5
    results = {}
    for fast in (True, False):
        monkeypatch.setattr(gelu, "FAST_CPU_GELU", fast)
        model = tiny()
        with torch.inference_mode():
            logits = model(x)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        results[fast] = (logits, loss.detach(), [p.grad.clone() for p in model.parameters()])
    (l1, loss1, g1), (l0, loss0, g0) = results[True], results[False]
    assert (l1 - l0).abs().max() < 1e-5 and abs(loss1 - loss0) < 1e-6
    assert max(float((a - b).abs().max()) for a, b in zip(g1, g0)) < 1e-5


def test_routes_apply_only_where_they_are_exact():
    act, erf, fc = torch.nn.GELU(approximate="tanh"), torch.nn.GELU(), torch.nn.Linear(64, 128)
    x = torch.randn(100, 64)  # 0.82 M multiply-accumulates: above the smallest products
    assert not gelu.fused_cpu_gelu_applies(x, act, fc)  # grad enabled: training takes the autograd route
    with torch.no_grad():
        assert gelu.fused_cpu_gelu_applies(x, act, fc) == onednn_linear_available()
        # the smallest products (the Fashion-MNIST ViT's fc1 at batch 1): F.linear and torch's GELU
        assert not gelu.fused_cpu_gelu_applies(x[:50], act, fc)
        wide = torch.nn.Linear(384, 1536)  # one row: up to 0.2 M multiply-accumulates
        assert not gelu.fused_cpu_gelu_applies(torch.randn(1, 192), act, torch.nn.Linear(192, 768))
        assert gelu.fused_cpu_gelu_applies(torch.randn(1, 384), act, wide) == onednn_linear_available()
        assert not gelu.fused_cpu_gelu_applies(x, erf, fc)  # erf GELU: torch's kernel is already fast
        assert not gelu.fused_cpu_gelu_applies(x.double(), act, fc)
        assert not gelu.fused_cpu_gelu_applies(x, torch.nn.ReLU(), fc)  # a replaced activation runs as itself
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not gelu.fused_cpu_gelu_applies(x, act, fc)


def test_hooked_or_replaced_layers_run_as_their_modules():
    """The direct routes call fc1's and the GELU's operators; a hook on either, or a layer with a forward of its own,
    must see (and change) what the module would."""
    torch.manual_seed(0)
    fc, act = torch.nn.Linear(6, 5), torch.nn.GELU(approximate="tanh")
    x = torch.randn(2, 6)
    seen = []
    handles = [m.register_forward_hook(lambda mod, i, o: seen.append(type(mod).__name__)) for m in (fc, act)]
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            out = gelu.linear_gelu(x, fc, act)
        assert seen == ["Linear", "GELU"]
        assert float((out - act(fc(x))).detach().abs().max()) < 1e-6
        seen.clear()
    for h in handles:
        h.remove()
    with torch.no_grad():
        assert float((gelu.linear_gelu(x, fc, torch.nn.ReLU()) - torch.relu(fc(x))).abs().max()) < 1e-6


def test_onnx_export_traces_the_plain_gelu(tmp_path):
    onnx = pytest.importorskip("onnx")
    from vitlab.export import export_onnx

    path = export_onnx(tiny().eval(), tmp_path / "m.onnx")
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert "Tanh" in ops and not any("Python" in op or "mkldnn" in op.lower() for op in ops)
