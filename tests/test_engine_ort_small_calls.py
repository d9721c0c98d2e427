"""The ONNX Runtime engines run a ViT call with little arithmetic in a session of one thread (ort.ONE_THREAD_MAX_FLOPS):
the FLOPs they decide by are the model's at the graph's image size, the one-thread session opens with the engine
where one image is a small call (else only if the bound changes) and gives the same logits, and models that are not
ViTs keep all their threads."""

from __future__ import annotations

import pytest
import torch

import vitlab

pytest.importorskip("onnxruntime")
from vitlab.engine import ort, prepare_engine  # noqa: E402
from vitlab.engine.sub_batch import SubBatched  # noqa: E402
from vitlab.models.registry import analytic_macs  # noqa: E402


def tiny_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    model = vitlab.create_model("custom", image_size=32, patch_size=8, dim=32, depth=2, heads=4, mlp_dim=48,
                                num_classes=5).eval()
    with torch.no_grad():  # zero-initialised heads and biases would hide differences
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def engine_of(picked):
    return picked.engine if isinstance(picked, SubBatched) else picked


def threads_of(session) -> int:
    return session.get_session_options().intra_op_num_threads


@pytest.mark.parametrize("size", [(32, 32), (32, 48)])
def test_the_flops_are_the_models_at_the_graphs_image_size(size):
    model = tiny_vit()
    assert ort.flops_per_image(model, size) == 2 * analytic_macs(model.config.replace(image_size=size))


def test_a_cnn_has_no_flop_count_so_its_engine_keeps_every_thread():
    model = vitlab.create_model("resnet-18", num_classes=3)
    assert ort.flops_per_image(model, (32, 32)) is None


@pytest.mark.parametrize("int8", [None, "dynamic"])
def test_a_small_call_runs_on_one_thread_with_the_same_logits(two_threads, tmp_path, monkeypatch, int8):
    model = tiny_vit()
    prepared = engine_of(prepare_engine(model, "onnxruntime", int8=int8, source=tmp_path, quiet=True))
    assert isinstance(prepared, ort.OrtEngine)
    assert prepared.flops_per_image == ort.flops_per_image(model, (32, 32))  # what `--engine` runs decides by FLOPs
    engine = ort.OrtEngine(prepared.path, 2, flops_per_image=prepared.flops_per_image)
    # one image is a small call: the one-thread session opens with the engine, not on a server's first request
    assert threads_of(engine.one_thread_session) == 1 and threads_of(engine.session) == 2
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    assert 3 * engine.flops_per_image <= ort.ONE_THREAD_MAX_FLOPS
    monkeypatch.setattr(ort, "ONE_THREAD_MAX_FLOPS", 2 * engine.flops_per_image)  # 2 images: small; 3: not
    assert engine.session_for(3) is engine.session and engine.session_for(2) is engine.one_thread_session
    whole, small = engine(x), engine(x[:2])
    assert torch.equal(small, ort.OrtEngine(engine.path, 2)(x[:2]))  # the same graph on all threads: the same bits
    if int8 is None:  # (dynamic int8 scales each call's activations by their range: a part of a batch is another call)
        assert torch.equal(small, whole[:2])


def test_a_model_too_large_for_one_thread_at_one_image_opens_no_second_session(two_threads, tmp_path, monkeypatch):
    model = tiny_vit()
    path = engine_of(prepare_engine(model, "onnxruntime", source=tmp_path, quiet=True)).path
    flops = ort.flops_per_image(model, (32, 32))
    monkeypatch.setattr(ort, "ONE_THREAD_MAX_FLOPS", flops / 2)
    engine = ort.OrtEngine(path, 2, flops_per_image=flops)
    engine(torch.randn(1, 3, 32, 32))
    assert engine.one_thread_session is None and engine.session_for(1) is engine.session
    monkeypatch.setattr(ort, "ONE_THREAD_MAX_FLOPS", flops)  # the bound changed after opening: opened when needed
    engine(torch.randn(1, 3, 32, 32))
    assert threads_of(engine.session_for(1)) == 1


def test_an_engine_of_one_thread_opens_no_second_session(tmp_path):
    model = tiny_vit()
    path = engine_of(prepare_engine(model, "onnxruntime", source=tmp_path, quiet=True)).path
    engine = ort.OrtEngine(path, 1, flops_per_image=ort.flops_per_image(model, (32, 32)))
    engine(torch.randn(1, 3, 32, 32))
    assert engine.one_thread_session is None and engine.session_for(1) is engine.session


def test_without_a_flop_count_every_call_takes_the_runs_threads(two_threads, tmp_path):
    model = tiny_vit()
    path = engine_of(prepare_engine(model, "onnxruntime", source=tmp_path, quiet=True)).path
    engine = ort.OrtEngine(path, 2)
    engine(torch.randn(1, 3, 32, 32))
    assert engine.one_thread_session is None and engine.session_for(1) is engine.session


def test_the_benchmark_runs_and_finds_the_same_logits_on_either_thread_count(monkeypatch, capsys):
    """benchmarks/ort_threads.py, whose numbers the rule's comment quotes, still runs (one round, batch 1)."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import ort_threads

    monkeypatch.setattr(sys, "argv", ["ort_threads.py", "--models", "fmnist", "--batches", "1", "--rounds", "1",
                                      "--calls", "1", "--threads", "2"])
    ort_threads.main()
    out = capsys.readouterr().out
    assert out.count("largest logit difference, 1 thread against 2: 0\n") == 2  # fp32 and int8
    assert out.count("1 thread x") == 4  # fp32 and int8, back to back and after the pause
