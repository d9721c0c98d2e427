"""TorchEngine runs a ViT call with little arithmetic on one thread (ONE_THREAD_MAX_FLOPS): the FLOPs it decides by
are the model's at the images' size, the thread count is 1 inside such a call only, comes back after it (and after an
error), and other threads keep theirs."""

from __future__ import annotations

import threading

import pytest
import torch

import vitlab
from vitlab.engine import torch_engines
from vitlab.engine.torch_engines import TorchEngine, one_thread
from vitlab.errors import VitlabError
from vitlab.models.attention_core import explicit_attention_applies
from vitlab.models.registry import analytic_macs


def tiny_vit(**kw):
    cfg = dict(image_size=32, patch_size=8, dim=32, depth=2, heads=4, mlp_dim=48, num_classes=5, seed=0) | kw
    return vitlab.create_model("custom", **cfg).eval()


@pytest.mark.parametrize("size", [(32, 32), (32, 48)])
def test_the_flop_estimate_is_twice_the_models_multiply_accumulates_at_the_images_size(size):
    engine = TorchEngine(tiny_vit())
    images = torch.randn(3, 3, *size)
    macs = analytic_macs(engine.model.config.replace(image_size=size))  # tested against torch's count elsewhere
    assert engine.flops(images) == 2 * 3 * macs


def threads_seen_by(engine: TorchEngine, images: torch.Tensor) -> int:
    seen = []
    handle = engine.model.register_forward_pre_hook(lambda m, args: seen.append(torch.get_num_threads()))
    try:
        engine(images)
    finally:
        handle.remove()
    return seen[0]


def test_a_small_call_runs_on_one_thread_and_a_large_one_on_all(two_threads, monkeypatch):
    engine, images = TorchEngine(tiny_vit()), torch.randn(2, 3, 32, 32)
    assert engine.flops(images) <= torch_engines.ONE_THREAD_MAX_FLOPS
    assert threads_seen_by(engine, images) == 1
    assert torch.get_num_threads() == 2
    monkeypatch.setattr(torch_engines, "ONE_THREAD_MAX_FLOPS", engine.flops(images) - 1)
    assert threads_seen_by(engine, images) == 2
    assert threads_seen_by(engine, images[:1]) == 1  # half the work: small again


def test_an_engine_for_a_stream_of_calls_keeps_all_threads(two_threads):
    """predict's and evaluate's eager engine (`--engine torch`) calls back to back: its small calls keep both
    threads, and give the logits of the engine with the rule."""
    from vitlab.commands._engine_args import eager_engine

    model, images = tiny_vit(), torch.randn(2, 3, 32, 32)
    engine = eager_engine(model, "predict", quiet=True)
    assert not engine.small(images) and threads_seen_by(engine, images) == 2
    assert torch.equal(engine(images), TorchEngine(model)(images))


def test_an_eager_engine_that_auto_picks_for_predict_keeps_all_threads(two_threads, tmp_path, monkeypatch):
    """Where `--engine auto` picks eager PyTorch for predict or evaluate (no ONNX Runtime here), its small calls
    keep both threads as with `--engine torch`; serve's engine (prepare_engine itself) keeps the rule."""
    from types import SimpleNamespace

    from vitlab.commands._engine_args import engine_for
    from vitlab.engine import choose
    from vitlab.engine.sub_batch import SubBatched

    model, images = tiny_vit(), torch.randn(1, 3, 32, 32)
    for picked in (TorchEngine(model), SubBatched(TorchEngine(model), 4)):
        monkeypatch.setattr(choose, "prepare_engine", lambda *a, picked=picked, **k: picked)
        args = SimpleNamespace(engine="auto", int8=None, quiet=True)
        engine = engine_for(args, model, source=tmp_path, preprocess=None, batch_size=1, device=torch.device("cpu"),
                            command="predict")
        assert engine is picked and threads_seen_by(getattr(engine, "engine", engine), images) == 2
    assert threads_seen_by(TorchEngine(model), images) == 1


def test_the_thread_count_comes_back_after_an_error(two_threads):
    engine = TorchEngine(tiny_vit())

    def fail(module, args):
        assert torch.get_num_threads() == 1
        raise ValueError("inside the call")

    handle = engine.model.register_forward_pre_hook(fail)
    with pytest.raises(ValueError, match="inside the call"):
        engine(torch.randn(1, 3, 32, 32))
    handle.remove()
    assert torch.get_num_threads() == 2
    with pytest.raises(VitlabError, match="input image size .33, 32.*resize or crop"):
        engine(torch.randn(1, 3, 33, 32))  # a size the patches do not fit: the model's own line, count untouched
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), one_thread():
        raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


def test_other_threads_keep_their_count_during_a_small_call(two_threads):
    engine, images = TorchEngine(tiny_vit()), torch.randn(1, 3, 32, 32)
    assert engine.small(images)
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def other() -> None:
        seen["before"] = torch.get_num_threads()  # this thread has used torch before the call begins
        inside.wait(10)
        seen["during"] = torch.get_num_threads()
        done.set()

    def hold(module, args):
        inside.set()
        done.wait(10)

    worker = threading.Thread(target=other)
    worker.start()
    while "before" not in seen:
        pass
    handle = engine.model.register_forward_pre_hook(hold)
    try:
        engine(images)
    finally:
        handle.remove()
    worker.join()
    assert seen == {"before": 2, "during": 2}


FMNIST = dict(image_size=28, in_chans=1, patch_size=4, dim=64, depth=6, heads=4, mlp_dim=128, num_classes=10)


@pytest.mark.parametrize("kind", ["17 tokens", "Fashion-MNIST ViT (50 tokens)", "145 tokens"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_one_thread_call_gives_the_models_logits_on_all_threads(two_threads, kind, batch):
    """To the last bit where the route is the explicit attention (up to 80 tokens at 2 threads); through torch's
    fused kernel (145 tokens) within float rounding."""
    cfg = FMNIST if kind.startswith("Fashion") else dict(image_size=8 * int((int(kind.split()[0]) - 1) ** 0.5))
    model = tiny_vit(**cfg)
    images = torch.randn(batch, model.config.in_chans, *model.config.image_size)
    engine = TorchEngine(model)
    assert engine.small(images)
    with torch.inference_mode():
        expected = model(images)
    with torch.inference_mode(), one_thread():
        assert explicit_attention_applies(torch.randn(1, 4, 17, 8))  # the route of 2 threads, on one
    got = engine(images)
    if kind == "145 tokens":
        assert (got - expected).abs().max() <= 1e-6 * expected.abs().max()
    else:
        assert torch.equal(got, expected)


def test_other_models_and_devices_keep_the_thread_count(two_threads):
    resnet = TorchEngine(vitlab.create_model("resnet-18", num_classes=3))  # not measured: keeps torch's threads
    assert not resnet.small(torch.randn(1, 3, 32, 32))
    engine = TorchEngine(tiny_vit())
    assert engine.small(torch.randn(1, 3, 32, 32))
    assert not engine.small(torch.randn(1, 3, 32, 32, device="meta"))
