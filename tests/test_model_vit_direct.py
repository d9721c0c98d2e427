"""ViT inference as direct operator calls (vitlab.models.vit_direct, used by `--engine torch`) against the module
route, the reference: the same logits to the last bit for every kind of ViT, and the module route wherever the
direct one would not compute or show the same thing (hooks, replaced or wrapped layers, training, autograd,
other dtypes), also after the model changed under it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import vitlab
from vitlab.engine.torch_engines import TorchEngine
from vitlab.models import fast_linear, gelu, vit_direct
from vitlab.models.vit_direct import DirectInference

pytestmark = pytest.mark.skipif(not fast_linear.onednn_linear_available(), reason="no oneDNN in this torch build")

SMALL = dict(dim=32, depth=3, heads=4, mlp_dim=64, patch_size=4, image_size=16, num_classes=7)


def perturbed(seed: int = 0, **kw) -> nn.Module:
    """A small custom ViT with random non-zero weights everywhere (zero-initialised heads would hide differences)."""
    model = vitlab.create_model("custom", **{**SMALL, "seed": seed, **kw})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def images(n: int = 3, size: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


class Counting(DirectInference):
    """Counts the calls that ran the direct plan (not the module route)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.direct_calls = 0

    def _current(self, x, class_token_only):
        plan = super()._current(x, class_token_only)
        self.direct_calls += bool(plan)
        return plan


def engine(model: nn.Module) -> TorchEngine:
    eng = TorchEngine(model)
    eng.direct = Counting(model, eng.packed)
    return eng


def module_route(eng: TorchEngine, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    monkeypatch.setattr(vit_direct, "DIRECT_INFERENCE", False)
    try:
        return eng(x)
    finally:
        monkeypatch.setattr(vit_direct, "DIRECT_INFERENCE", True)


KINDS = {
    "class token": {},
    "global average pool": dict(classifier="gap"),
    "MAP head": dict(classifier="map"),
    "representation layer": dict(representation_size=24),
    "no qkv bias, erf GELU": dict(qkv_bias=False, gelu="exact"),
    "conv-stem hybrid": dict(conv_stem=[8, 16], patch_size=2, image_size=16),
    "fixed sin-cos position embeddings": dict(posemb="sincos2d", classifier="gap"),
    "long sequence (fused attention kernel)": dict(patch_size=1, image_size=12),  # 145 tokens
}


# (SMALL_PRODUCT_MACS, SMALL_FEW_ROW_PRODUCT_MACS): which products run through F.linear instead of oneDNN
PRODUCT_ROUTES = {"as shipped": None, "all through oneDNN": (0, 0), "all through F.linear": (10**12, 10**12),
                  "mixed": (100_000, 10_000)}  # at 3 images: qkv over the limit, proj under it; class token rows too


# (SMALL_GELU_PRODUCT_MACS, SMALL_FEW_ROW_GELU_PRODUCT_MACS): where fc1 + tanh GELU is one oneDNN call (as shipped
# these small models' fc1 is under the limit: F.linear and torch's GELU)
GELU_ROUTES = {"as shipped": None, "fc1 + GELU fused at any size": (0, 0),
               "mixed": (200_000, 1_000)}  # full blocks unfused, a class-token-only last block fused


@pytest.mark.parametrize("gelu_routes", list(GELU_ROUTES))
@pytest.mark.parametrize("routes", list(PRODUCT_ROUTES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_same_logits_as_the_module_route_to_the_last_bit(kind, routes, gelu_routes, monkeypatch, keep_torch_threads):
    torch.set_num_threads(2)  # short sequences take the explicit attention route (attention_core) on 2 threads
    if PRODUCT_ROUTES[routes] is not None:
        many, few = PRODUCT_ROUTES[routes]
        monkeypatch.setattr(fast_linear, "SMALL_PRODUCT_MACS", many)
        monkeypatch.setattr(fast_linear, "SMALL_FEW_ROW_PRODUCT_MACS", few)
    if GELU_ROUTES[gelu_routes] is not None:
        many, few = GELU_ROUTES[gelu_routes]
        monkeypatch.setattr(gelu, "SMALL_GELU_PRODUCT_MACS", many)
        monkeypatch.setattr(gelu, "SMALL_FEW_ROW_GELU_PRODUCT_MACS", few)
    model = perturbed(**KINDS[kind])
    size = model.config.image_size[0] if isinstance(model.config.image_size, tuple) else model.config.image_size
    eng = engine(model)
    for n in (1, 3):
        x = images(n, size)
        direct = eng(x)
        assert torch.equal(direct, module_route(eng, x, monkeypatch))
        with torch.inference_mode():
            plain = model(x)  # the model alone: no packed weights
        torch.testing.assert_close(direct, plain, rtol=0, atol=1e-5 * plain.abs().max().item())
    assert eng.direct.direct_calls == 2


def test_without_packed_weights_and_at_another_image_size(monkeypatch):
    model = perturbed()
    direct = DirectInference(model)
    x = images(2, size=24)  # 6 x 6 patches: the position embeddings are resampled
    with torch.inference_mode():
        out = direct(x)
        monkeypatch.setattr(vit_direct, "DIRECT_INFERENCE", False)
        assert direct(x) is None
        assert torch.equal(out, model(x))


def test_full_last_block_when_the_class_token_shortcut_is_off(monkeypatch):
    import vitlab.models.vit as vit_module

    monkeypatch.setattr(vit_module, "CLASS_TOKEN_ONLY", False)
    model, x = perturbed(seed=3), images()
    eng = engine(model)
    assert torch.equal(eng(x), module_route(eng, x, monkeypatch))
    assert eng.direct.direct_calls == 1


@pytest.mark.parametrize("where", ["block", "norm1", "attn", "qkv", "proj", "norm2", "mlp", "fc1", "act", "fc2"])
def test_a_hook_anywhere_in_a_block_sees_the_module_route(where, monkeypatch):
    model, x = perturbed(), images()
    eng = engine(model)
    reference = eng(x)
    block = model.blocks[1]
    layer = {"block": block, "norm1": block.norm1, "attn": block.attn, "qkv": block.attn.qkv,
             "proj": block.attn.proj, "norm2": block.norm2, "mlp": block.mlp, "fc1": block.mlp.fc1,
             "act": block.mlp.act, "fc2": block.mlp.fc2}[where]
    seen = []
    handle = layer.register_forward_hook(lambda mod, args, out: seen.append(out))
    out = eng(x)
    handle.remove()
    assert len(seen) == 1 and eng.direct.direct_calls == 1  # only the call before the hook ran directly
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-6 * reference.abs().max().item())
    assert eng(x) is not None and eng.direct.direct_calls == 2  # hook removed: direct again


@pytest.mark.parametrize("where", ["drop_path1", "proj_drop", "drop1", "drop2", "act"])
def test_a_pre_hook_or_training_mode_on_a_layer_without_weights_sees_the_module_route(where, monkeypatch):
    """The plan runs no module, so a forward pre-hook on any layer the module route calls, even an identity or a
    dropout, or one such layer left in training mode, sends the call through the modules."""
    model, x = perturbed(), images()
    eng = engine(model)
    reference = eng(x)
    block = model.blocks[2]
    layer = getattr(block, where, None) or getattr(block.attn, where, None) or getattr(block.mlp, where)
    seen = []
    handle = layer.register_forward_pre_hook(lambda mod, args: seen.append(1))
    out = eng(x)
    assert seen == [1] and eng.direct.direct_calls == 1
    assert torch.equal(out, module_route(eng, x, monkeypatch))
    handle.remove()
    layer.train()
    assert torch.equal(eng(x), module_route(eng, x, monkeypatch)) and eng.direct.direct_calls == 1
    layer.eval()
    assert torch.equal(eng(x), reference) and eng.direct.direct_calls == 2


def test_a_parameter_given_to_a_layer_that_reads_none_keeps_the_plan():
    """A parameter registered on a GELU or a dropout changes nothing their forward computes: the plan stands."""
    model, x = perturbed(), images()
    eng = engine(model)
    reference = eng(x)
    model.blocks[1].mlp.act.register_parameter("unused", nn.Parameter(torch.ones(3)))
    model.blocks[1].mlp.drop1.register_parameter("unused", nn.Parameter(torch.ones(3)))
    assert torch.equal(eng(x), reference) and eng.direct.direct_calls == 2


def test_hooks_on_the_model_or_on_every_module_see_the_module_route():
    model, x = perturbed(), images()
    eng = engine(model)
    eng(x)
    seen = []
    handle = model.register_forward_hook(lambda mod, args, out: seen.append(out))
    eng(x)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda mod, args, out: seen.append(mod))
    try:
        eng(x)
    finally:
        handle.remove()
    assert eng.direct.direct_calls == 1 and len(seen) > 1 + 3 * 10


class LoRA(nn.Module):
    """A low-rank adapter as PEFT wraps a layer: its own forward, and the base layer's weight and bias exposed."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, 2, bias=False)
        self.up = nn.Linear(2, base.out_features, bias=False)
        nn.init.normal_(self.up.weight)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


@pytest.mark.parametrize("where", ["qkv", "proj", "fc1", "fc2"])
def test_a_wrapped_layer_computes_its_own_forward(where):
    model, x = perturbed(), images()
    eng = engine(model)
    before = eng(x)
    owner = model.blocks[0].attn if where in ("qkv", "proj") else model.blocks[0].mlp
    setattr(owner, where, LoRA(getattr(owner, where)))
    after = eng(x)
    with torch.enable_grad():  # and the module route in training (autograd) too
        trained = model(x)
    assert (after - before).abs().max() > 1e-3  # the adapter counts
    torch.testing.assert_close(trained, after, rtol=0, atol=1e-5 * after.abs().max().item())
    assert eng.direct.direct_calls == 1


def test_a_replaced_activation_or_a_new_block_is_seen():
    model, x = perturbed(), images()
    eng = engine(model)
    eng(x)
    model.blocks[2].mlp.act = nn.ReLU()
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(eng(x), expected, rtol=0, atol=1e-6 * expected.abs().max().item())
    model.blocks[2] = perturbed(seed=5).blocks[2]  # standard again: a new plan
    with torch.no_grad():
        expected = model(x)
    assert torch.equal(eng(x), eng(x))
    torch.testing.assert_close(eng(x), expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    assert eng.direct.direct_calls == 1 + 3


@pytest.mark.parametrize("change", ["in place", "load_state_dict", "new parameter", "new qkv bias",
                                    "new layer norm weight", "layer norm", "gelu kind"])
def test_a_changed_model_gives_the_changed_logits(change, monkeypatch):
    model, x = perturbed(), images()
    eng = engine(model)
    before = eng(x)
    fc = model.blocks[1].mlp.fc1
    with torch.no_grad():
        if change == "in place":
            fc.weight.mul_(1.5)
        elif change == "load_state_dict":
            model.load_state_dict(perturbed(seed=9).state_dict())
        elif change == "new parameter":
            fc.weight = nn.Parameter(fc.weight * 1.5)
        elif change == "new qkv bias":
            model.blocks[2].attn.qkv.bias = nn.Parameter(model.blocks[2].attn.qkv.bias + 0.5)
        elif change == "new layer norm weight":
            model.blocks[0].norm1.weight = nn.Parameter(model.blocks[0].norm1.weight * 1.5)
        elif change == "layer norm":
            model.blocks[0].norm2.eps = 0.5
        else:
            model.blocks[1].mlp.act.approximate = "none"
    after = eng(x)
    assert (after - before).abs().max() > 1e-4
    assert torch.equal(after, module_route(eng, x, monkeypatch))
    assert eng.direct.direct_calls == 2


@pytest.mark.parametrize("change", ["pruned", "a new block list"])
@pytest.mark.parametrize("caller", ["model(x)", "engine"])
def test_a_new_list_of_blocks_is_seen(change, caller, monkeypatch):
    """`prune_intermediate_layers` (timm's) slices the blocks into a new list: the plan of the old list, whose own
    dict did not change, ran every old block before (the features of three blocks came out of all of them)."""
    model, x = perturbed(), images()
    run = model if caller == "model(x)" else engine(model)
    with torch.inference_mode():
        before = run(x)
        if change == "pruned":
            model.prune_intermediate_layers([1], prune_head=False)
        else:
            model.blocks = nn.ModuleList(list(model.blocks)[::-1])
        after = run(x)
        monkeypatch.setattr(vit_direct, "DIRECT_INFERENCE", False)
        expected = model(x)
    assert (after - before).abs().max() > 1e-4
    assert torch.equal(after, expected)


def test_not_for_training_autograd_or_other_dtypes():
    model, x = perturbed(), images()
    direct = Counting(model, None)
    with torch.no_grad():
        assert direct(x) is not None and direct.direct_calls == 1
        assert direct(x.double()) is None
        model.train()
        assert direct(x) is None
        model.eval()
        model.blocks[0].attn.train()  # one layer left in training mode: its blocks run as modules
        assert torch.equal(direct(x), model(x)) and direct.direct_calls == 1
        model.blocks[0].attn.eval()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert direct(x) is None
    assert direct(x) is None  # autograd on
    with torch.no_grad():
        model.to(torch.bfloat16)
        assert direct(x.bfloat16()) is None


def test_module_route_hooks_and_adapters_are_honoured_without_the_engine():
    """The model alone (its module route, in inference and in training) runs a hooked or wrapped layer as a module:
    its oneDNN shortcuts used to read the layer's weight directly, so hooks never fired and an adapter was ignored."""
    model, x = perturbed(), images()
    seen = []
    model.blocks[0].attn.qkv.register_forward_hook(lambda mod, args, out: seen.append(1))
    model.blocks[0].mlp.act.register_forward_hook(lambda mod, args, out: seen.append(2))
    with torch.no_grad():
        before = model(x)
    model(x)
    assert seen == [1, 2, 1, 2]
    model.blocks[1].attn.proj = LoRA(model.blocks[1].attn.proj)
    with torch.no_grad():
        assert (model(x) - before).abs().max() > 1e-3


def block_calls(monkeypatch) -> list:
    """Counts the blocks run through the direct plan (by the engine's DirectInference or the model's own)."""
    calls = []
    real = vit_direct._block
    monkeypatch.setattr(vit_direct, "_block", lambda *a: (calls.append(1), real(*a))[1])
    return calls


@pytest.mark.parametrize("kind", ["class token", "global average pool", "conv-stem hybrid"])
def test_the_model_itself_takes_the_direct_route_in_inference(kind, monkeypatch):
    """`model(x)` in a user's own code (eval mode, no autograd, CPU fp32) runs the direct plan with its live
    weights: the module route's logits to the last bit."""
    model, x = perturbed(**KINDS[kind]), images()
    calls = block_calls(monkeypatch)
    with torch.inference_mode():
        direct = model(x)
    assert len(calls) == SMALL["depth"]
    monkeypatch.setattr(vit_direct, "DIRECT_INFERENCE", False)
    with torch.no_grad():
        assert torch.equal(direct, model(x))
    assert len(calls) == SMALL["depth"]
    monkeypatch.setattr(vit_direct, "DIRECT_INFERENCE", True)
    with torch.no_grad():
        model.blocks[1].mlp.fc2.weight.mul_(1.5)  # live weights: an in-place change shows at once
        changed = model(x)
    assert (changed - direct).abs().max() > 1e-4 and len(calls) == 2 * SMALL["depth"]


def test_the_model_builds_no_plan_for_training_or_autograd(monkeypatch):
    model, x = perturbed(), images()
    model(x)  # autograd on
    with torch.no_grad():
        model.train()
        model(x)
        model.eval()
        model(x, return_attention=True)
    assert "_direct" not in model.__dict__


@pytest.mark.parametrize("where", ["class", "instance"])
def test_a_patched_forward_runs(where, monkeypatch):
    """Attention-map tools patch `Attention.forward` (or one layer's): the plan, which would skip it, steps aside,
    for the model's own direct route and for the engine's."""
    from vitlab.models.vit import Attention

    model, x = perturbed(), images()
    eng = engine(model)
    with torch.no_grad():
        before = model(x)
    seen = []
    original = Attention.forward

    def patched(self, *args, **kwargs):
        seen.append(1)
        out = original(self, *args, **kwargs)
        return (out[0] * 2, out[1]) if isinstance(out, tuple) else out * 2

    if where == "class":
        monkeypatch.setattr(Attention, "forward", patched)
    else:
        attn = model.blocks[1].attn
        attn.forward = lambda *args, **kwargs: patched(attn, *args, **kwargs)
    with torch.no_grad():
        after = model(x)
    engine_after = eng(x)
    expected_calls = SMALL["depth"] if where == "class" else 1
    assert len(seen) == 2 * expected_calls
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(engine_after, after, rtol=0, atol=1e-5 * after.abs().max().item())
    assert eng.direct.direct_calls == 0


def test_a_subclass_with_its_own_encode_runs_it():
    from vitlab.models.vit import VisionTransformer

    class Doubled(VisionTransformer):
        def encode(self, x, return_attention=False, class_token_only=False):
            tokens, maps = super().encode(x, return_attention, class_token_only)
            return tokens * 2, maps

    model, x = perturbed(), images()
    doubled = Doubled(model.config).eval()
    doubled.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(doubled(x), model(x))

        def encode(x, return_attention=False, class_token_only=False):  # patched on the instance: the same
            tokens, maps = VisionTransformer.encode(model, x, return_attention, class_token_only)
            return tokens * 2, maps

        model.encode = encode
        assert torch.equal(doubled(x), model(x))


def test_copies_do_not_share_or_carry_the_plan(tmp_path):
    import copy

    model, x = perturbed(), images()
    with torch.no_grad():
        expected = model(x)
        deep = copy.deepcopy(model)
        assert "_direct" not in deep.__dict__
        assert torch.equal(deep(x), expected)
        torch.save(model, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
        assert "_direct" not in loaded.__dict__ and torch.equal(loaded(x), expected)
        shallow = copy.copy(model)
        shallow(x)
        assert shallow.__dict__["_direct"].model is shallow and model.__dict__["_direct"].model is model


@pytest.mark.parametrize("caller", ["model(x)", "engine"])
def test_threads_calling_a_fresh_model_at_once_get_the_module_routes_logits(monkeypatch, caller, two_threads):
    """A threaded server's first requests build the plan concurrently: each call sees a whole plan or none. Small
    calls run on one thread, each on its own OS thread's count (models/threads.py), so the others keep theirs; the
    engine's rule once set torch's process-wide count, and calls in other threads meanwhile could round differently
    in the last bits."""
    import threading

    from vitlab.engine.torch_engines import TorchEngine

    model, x = perturbed(), images()
    monkeypatch.setattr(vit_direct, "DIRECT_INFERENCE", False)
    with torch.no_grad():
        expected = model(x)
    monkeypatch.setattr(vit_direct, "DIRECT_INFERENCE", True)
    results, start = [], threading.Barrier(6)

    def call(fn):
        start.wait()
        with torch.inference_mode():
            results.extend(fn(x) for _ in range(5))

    fn = model if caller == "model(x)" else TorchEngine(model)
    threads = [threading.Thread(target=call, args=(fn,)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 30 and all(torch.equal(r, expected) for r in results)


def test_a_deleted_model_goes_at_once():
    """The model holds its plan and the plan only a weak reference back: no cycle keeps a deleted model's weights
    until Python's cyclic collector runs (gigabytes for ViT-L/H in a loop over models)."""
    import gc
    import weakref

    model = perturbed()
    with torch.no_grad():
        model(images())
    assert "_direct" in model.__dict__
    gc.disable()
    try:
        ref = weakref.ref(model)
        del model
        assert ref() is None
    finally:
        gc.enable()
