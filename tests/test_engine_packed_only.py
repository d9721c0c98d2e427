"""An eager torch engine that owns its model keeps only the packed copies of the large linear weights once released
(engine.release.release_model -> TorchEngine.keep_packed_only -> DirectInference.keep_packed_only): the same logits,
the plain copies freed, and the model refusing every other call in one line instead of computing with them."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import vitlab
from vitlab.engine.release import release_model
from vitlab.engine.sub_batch import SubBatched
from vitlab.engine.torch_engines import TorchEngine
from vitlab.errors import VitlabError
from vitlab.models import fast_linear

needs_packing = pytest.mark.skipif(not fast_linear.packing_available(), reason="oneDNN weight packing")


def wide(dim: int = 768) -> torch.nn.Module:
    """One block as wide as ViT-B's (its linear weights never take the small-product route), on 32 px images."""
    torch.manual_seed(0)
    model = vitlab.create_model("custom", image_size=32, patch_size=16, dim=dim, depth=2, heads=12,
                                mlp_dim=4 * dim, num_classes=10).eval()
    # non-zero heads and biases: a model computing with lost weights could not pass by giving zeros
    model.load_state_dict({k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()})
    return model


def images(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(n))


def block_weights(model) -> list[torch.Tensor]:
    return [fc.weight for b in model.blocks for fc in (b.attn.qkv, b.attn.proj, b.mlp.fc1, b.mlp.fc2)]


@needs_packing
def test_the_plain_weights_go_after_the_next_call_and_the_logits_stay():
    model = wide()
    with torch.inference_mode():
        eager = {n: model(images(n)) for n in (1, 4)}
    engine = SubBatched(TorchEngine(model), 2)  # as --engine auto picks it: the wrapper passes the release on
    before = engine(images(4))
    old = [weakref.ref(w) for w in block_weights(model)]
    assert not release_model(model, engine)  # the model is still what the engine runs
    assert not any(w.is_meta for w in block_weights(model))  # not before the engine's next call
    assert torch.equal(engine(images(4)), before)
    assert all(w.is_meta for w in block_weights(model))
    gc.collect()
    assert all(ref() is None for ref in old)  # nothing holds the plain copies any more: their memory is free
    # the rest stays (the patch embedding, norms, biases, head: read by the model's own modules)
    assert not any(p.is_meta for name, p in model.named_parameters() if not name.endswith(
        ("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight")))
    for n in (1, 4):  # other batch sizes, the same packed copies
        assert torch.equal(engine(images(n)), before if n == 4 else engine(images(n)))
        assert (engine(images(n)) - eager[n]).abs().max() < 1e-5
    assert torch.equal(engine(images(4)), before)


@needs_packing
def test_the_model_refuses_every_call_but_the_engines():
    model = wide()
    engine = TorchEngine(model)
    engine(images(2))
    release_model(model, engine)
    engine(images(2))
    for call in (lambda: model(images(2)), lambda: model(images(2), return_attention=True)):
        with pytest.raises(VitlabError, match="weights were freed once its torch engine held them packed"):
            with torch.inference_mode():
                call()
    with pytest.raises(VitlabError, match="weights were freed"):
        model(images(2))  # with autograd
    with pytest.raises(VitlabError, match="weights were freed"):
        engine(images(2).double())  # a call the engine's direct route does not cover
    # a hook on a block makes the plan step aside for the modules, which would compute with meta weights: refused
    handle = model.blocks[0].register_forward_hook(lambda *a: None)
    with pytest.raises(VitlabError, match="weights were freed"):
        engine(images(2))
    handle.remove()
    assert engine(images(2)).shape == (2, 10)


@needs_packing
def test_small_weights_stay_and_the_model_still_runs():
    # ViT-Ti width: every linear weight has a row count at which F.linear runs it with the plain copy
    model = wide(192)
    engine = TorchEngine(model)
    engine(images(2))
    release_model(model, engine)
    out = engine(images(2))
    assert not any(p.is_meta for p in model.parameters())
    with torch.inference_mode():
        assert (model(images(2)) - out).abs().max() < 1e-5


def test_without_packed_weights_nothing_is_freed(monkeypatch):
    model = wide()
    monkeypatch.setattr("vitlab.engine.torch_engines.packing_fits", lambda m: False)
    engine = TorchEngine(model)
    release_model(model, engine)
    out = engine(images(2))
    assert not any(p.is_meta for p in model.parameters())
    with torch.inference_mode():
        assert torch.equal(model(images(2)), out)


@needs_packing
def test_released_inside_the_callers_inference_mode():
    # vitlab serve warms its engine up under torch.inference_mode(): the stand-ins are made outside it all the same
    model = wide()
    engine = TorchEngine(model)
    with torch.inference_mode():
        before = engine(images(2))
        release_model(model, engine)
        assert torch.equal(engine(images(2)), before)
    assert all(w.is_meta for w in block_weights(model))
    assert torch.equal(engine(images(2)), before)
