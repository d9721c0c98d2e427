"""`--products auto|onednn|torch`: the route of CPU fp32 training's matrix products, timed once per machine and
model shapes, recorded in the run and restored on resume (vitlab.train.products)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import yaml

from test_train_lifecycle import tiny_cfg
from test_train_loop import tiny_data
from vitlab.errors import VitlabError
from vitlab.models import fast_linear
from vitlab.models.registry import create_model
from vitlab.runtime import machine_cache_file
from vitlab.train import products, resolve_config, train
from vitlab.train.resume import restore_numerics

pytestmark = pytest.mark.usefixtures("keep_torch_threads")  # tests/conftest.py


@pytest.fixture(autouse=True)
def default_after():
    yield
    fast_linear.set_training_products("auto")
    fast_linear.use_auto_route("onednn")


def small_vit(seed=0):
    return create_model("custom", image_size=16, patch_size=4, dim=32, depth=2, heads=4, mlp_dim=64, num_classes=5,
                        seed=seed)


def test_explicit_choices_pass_and_auto_applies_only_to_cpu_fp32(monkeypatch):
    model, cpu = small_vit(), torch.device("cpu")
    for choice in ("onednn", "torch"):
        assert products.resolve_products(choice, cpu, "fp32", model, 8) == choice
    monkeypatch.setenv("VITLAB_TORCH_PRODUCTS_SPEEDUP", "2.0")  # F.linear measured twice as fast
    assert products.resolve_products("auto", cpu, "fp32", model, 8) == ("torch" if fast_linear.onednn_linear_available()
                                                                        else "onednn")
    assert products.resolve_products("auto", cpu, "bf16", model, 8) == "onednn"  # autocast: F.linear anyway
    assert products.resolve_products("auto", torch.device("cuda"), "fp32", model, 8) == "onednn"
    monkeypatch.setenv("VITLAB_TORCH_PRODUCTS_SPEEDUP", "1.02")  # within the margin: oneDNN stays
    assert products.resolve_products("auto", cpu, "fp32", model, 8) == "onednn"


def test_the_timing_runs_once_then_comes_from_the_cache(monkeypatch):
    if not fast_linear.onednn_linear_available():
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.delenv("VITLAB_TORCH_PRODUCTS_SPEEDUP", raising=False)
    monkeypatch.delenv("VITLAB_RETIME", raising=False)
    model = small_vit()
    assert products.product_shapes(model) == {(32, 96): 2, (32, 32): 2, (32, 64): 2, (64, 32): 2, (32, 5): 1}
    assert products.tokens_per_image(model) == 17  # 16 patches and the class token
    first = products.torch_products_speedup(model, 4)
    assert first > 0
    monkeypatch.setattr(products, "measure_torch_speedup", lambda *a, **k: pytest.fail("timed twice"))
    assert products.torch_products_speedup(model, 4) == first
    kept = json.loads(machine_cache_file(products.CACHE_NAME).read_text())
    assert any("68 rows" in key and "32x96*2" in key for key in kept)  # 4 images x 17 tokens; shapes in the key


def test_the_torch_route_computes_the_same_training_step():
    x = torch.randn(6, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    y = torch.arange(6) % 5
    grads, kinds = {}, {}
    for route in ("onednn", "torch"):
        fast_linear.set_training_products(route)
        model = small_vit()
        logits = model(x)
        kinds[route] = {n.name() for n in _graph_nodes(logits.grad_fn)}
        F.cross_entropy(logits, y).backward()
        grads[route] = [p.grad for p in model.parameters()]
    if fast_linear.onednn_linear_available():
        assert "OneDnnLinearBackward" in kinds["onednn"] and "TanhGeluThenLinearBackward" in kinds["onednn"]
    assert not any("OneDnn" in k or "TanhGeluThenLinear" in k for k in kinds["torch"])
    assert max(float((a - b).abs().max()) for a, b in zip(grads["onednn"], grads["torch"])) < 1e-5
    with pytest.raises(ValueError):
        fast_linear.set_training_products("mkl")


def _graph_nodes(fn, seen=None):
    seen = set() if seen is None else seen
    if fn is None or fn in seen:
        return seen
    seen.add(fn)
    for nxt, _ in fn.next_functions:
        _graph_nodes(nxt, seen)
    return seen


def test_config_refuses_an_unknown_route_and_resume_restores_the_record():
    with pytest.raises(VitlabError, match="products must be auto, onednn or torch"):
        resolve_config("small-data", overrides=dict(products="mkl"))
    cfg = resolve_config("small-data", overrides=dict(products="auto"))
    restore_numerics(cfg, (), {"products": "torch"})
    assert cfg.products == "torch"  # not given: the run's own
    cfg = resolve_config("small-data", overrides=dict(products="onednn"))
    with pytest.raises(VitlabError, match="recorded with products torch"):
        restore_numerics(cfg, (), {"products": "torch"})
    assert restore_numerics(cfg, ("products",), {"products": "torch"}) == {"products": ("torch", "onednn")}


def test_a_run_records_its_route_and_trains_with_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_TORCH_PRODUCTS_SPEEDUP", "3.0")
    seen = []
    real = fast_linear.set_training_products
    monkeypatch.setattr(fast_linear, "set_training_products", lambda route: seen.append(route) or real(route))
    train(tiny_cfg(tmp_path, epochs=1, name="fast-torch"), data=tiny_data())
    recorded = yaml.safe_load((tmp_path / "fast-torch" / "config.yaml").read_text())["products"]
    assert recorded == ("torch" if fast_linear.onednn_linear_available() else "onednn")
    assert seen == [recorded, "auto"]  # set for the run, and the caller's route is back after it
    assert fast_linear.TRAINING_PRODUCTS == "auto"


def one_training_step(model, x) -> set[str]:
    """A training forward and backward; the autograd nodes it ran."""
    model.train()
    logits = model(x)
    kinds = {n.name() for n in _graph_nodes(logits.grad_fn)}
    logits.sum().backward()
    return kinds


def onednn_nodes(kinds: set[str]) -> bool:
    return any("OneDnn" in k or "TanhGeluThenLinear" in k for k in kinds)


def test_a_users_own_loop_takes_the_measured_route_once_per_model(monkeypatch):
    """Outside `vitlab train` ("auto", the default) a ViT takes, at its first CPU fp32 training forward, the route
    measured for its shapes, and keeps it: a later batch of another size does not time again."""
    x = torch.randn(3, 3, 16, 16)
    monkeypatch.setenv("VITLAB_TORCH_PRODUCTS_SPEEDUP", "2.0")  # F.linear measured twice as fast
    asked = []
    real = products.torch_products_speedup
    monkeypatch.setattr(products, "torch_products_speedup", lambda *a: asked.append(a[1]) or real(*a))
    model = small_vit()
    first = one_training_step(model, x)
    one_training_step(model, x[:2])
    onednn = fast_linear.onednn_linear_available()
    assert model.__dict__["_products_route"] == ("torch" if onednn else "onednn")
    assert asked == ([3] if onednn else [])  # timed once, at the first micro-batch
    assert not onednn_nodes(first)  # every product through F.linear
    monkeypatch.setenv("VITLAB_TORCH_PRODUCTS_SPEEDUP", "1.0")  # another model, measured even: oneDNN
    other = small_vit(seed=1)
    assert onednn_nodes(one_training_step(other, x)) == onednn
    assert other.__dict__["_products_route"] == "onednn"
    assert not onednn_nodes(one_training_step(model, x))  # each model its own route while it trains


def test_the_auto_route_leaves_inference_frozen_models_and_explicit_routes_alone(monkeypatch):
    monkeypatch.setenv("VITLAB_TORCH_PRODUCTS_SPEEDUP", "2.0")
    model, x = small_vit(), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        model.train()
        model(x)  # training mode without autograd: nothing to choose
    model.eval()
    model(x)
    assert "_products_route" not in model.__dict__
    fast_linear.set_training_products("onednn")  # an explicit route (vitlab train's) is not overridden
    kinds = one_training_step(model, x)
    assert "_products_route" not in model.__dict__
    assert onednn_nodes(kinds) == fast_linear.onednn_linear_available()
