"""Memory handed back once an engine is ready (vitlab.engine.release, runtime.return_freed_memory): the torch
weights of a model that ONNX Runtime or OpenVINO runs instead, and what building the engine freed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import vitlab
from vitlab.engine.release import release_model, runs_model
from vitlab.engine.sub_batch import SubBatched
from vitlab.engine.torch_engines import TorchEngine
from vitlab.errors import VitlabError

glibc_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    model = vitlab.create_model("custom", image_size=32, patch_size=8, dim=64, depth=2, heads=4, mlp_dim=128,
                                num_classes=10).eval()
    # non-zero heads and biases, so that a released or wrong model could not pass by giving zeros
    model.load_state_dict({k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()})
    return model


def images(n: int = 3) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _recording(monkeypatch) -> list[bool]:
    from vitlab.engine import release

    released, real = [], release.release_model
    monkeypatch.setattr(release, "release_model", lambda m, e: released.append(real(m, e)) or released[-1])
    return released


def test_which_engines_run_the_model():
    model = tiny()
    assert runs_model(TorchEngine(model)) and runs_model(SubBatched(TorchEngine(model), 2))
    assert runs_model(lambda x: x)  # an engine that does not say is taken to need its model
    assert not runs_model(SimpleNamespace(runs_model=False))
    assert not runs_model(SubBatched(SimpleNamespace(runs_model=False, name="x"), 2))


def test_a_torch_engine_keeps_its_model():
    model = tiny()
    engine = TorchEngine(model)
    before = engine(images())
    assert not release_model(model, engine)
    assert all(not p.is_meta for p in model.parameters())
    assert torch.equal(engine(images()), before)


def test_an_onnxruntime_engine_runs_on_after_the_model_is_released(tmp_path):
    pytest.importorskip("onnxruntime")
    from vitlab.engine import prepare_engine

    model = tiny()
    engine = prepare_engine(model, "onnxruntime", source=tmp_path, quiet=True)
    with torch.inference_mode():
        reference = model(images())
    before = engine(images())
    assert not engine.runs_model
    assert release_model(model, engine)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model.config.num_classes == 10 and model.head.weight.shape == (10, 64)  # what a command still reads
    assert torch.equal(engine(images()), before)
    assert (before - reference).abs().max() < 1e-4
    with pytest.raises(VitlabError, match="weights were released once its onnxruntime engine was built"):
        model(images())


def test_predict_with_onnxruntime_releases_its_own_model(tmp_path, monkeypatch):
    """`vitlab.predict.predict` loads its own model, so it may free it; the answers are the eager model's."""
    pytest.importorskip("onnxruntime")
    from PIL import Image

    from vitlab.predict import predict

    model = tiny()
    vitlab.save(model, tmp_path / "model")
    files = []
    for i in range(3):
        pixels = torch.randint(0, 256, (40, 48, 3), generator=torch.Generator().manual_seed(i), dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(tmp_path / f"{i}.png")
        files.append(tmp_path / f"{i}.png")
    released = _recording(monkeypatch)
    eager = predict(tmp_path / "model", files, engine="torch")
    onnx = predict(tmp_path / "model", files, engine="onnxruntime")
    assert released == [False, True]  # eager: the engine keeps its packed copies; ONNX Runtime: freed at once
    assert [p.labels for p in onnx] == [p.labels for p in eager]
    for a, b in zip(onnx, eager):
        assert max(abs(x - y) for x, y in zip(a.probs, b.probs)) < 1e-5


@glibc_linux
def test_return_freed_memory_gives_the_heap_back():
    """With the allocator tuned (freed memory kept), 256 MB freed stays resident until it is returned."""
    script = textwrap.dedent("""
        import torch
        from vitlab.runtime import return_freed_memory, tune_cpu_allocator
        def anon():
            return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('RssAnon')) // 1024
        assert tune_cpu_allocator()
        t = torch.ones(64 << 20)
        held = anon()
        del t
        kept = anon()
        assert return_freed_memory()
        print(held, kept, anon())
    """)
    held, kept, after = map(int, subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                                                text=True).stdout.split())
    assert kept > held - 32  # the tuned allocator kept it
    assert after < kept - 200  # and now it went back


def test_evaluate_releases_only_where_the_engine_computes_the_logits(tmp_path, monkeypatch, capsys):
    """`vitlab evaluate` frees its model for an engine's head pass; a fresh head needs the torch model and keeps it."""
    pytest.importorskip("onnxruntime")
    import shutil
    from pathlib import Path

    from vitlab.cli import main

    kept = Path(__file__).resolve().parents[1] / "docs" / "figures" / "fmnist_vit_model"
    model = tmp_path / "model"
    shutil.copytree(kept, model, ignore=shutil.ignore_patterns("engines"))
    released = _recording(monkeypatch)
    assert main(["evaluate", str(model), "--data", "bundled", "--engine", "onnxruntime", "--out",
                 str(tmp_path / "e1"), "--quiet"]) == 0
    assert released == [True]
    assert main(["evaluate", str(model), "--data", "bundled", "--engine", "onnxruntime", "--head", "fresh",
                 "--out", str(tmp_path / "e2"), "--quiet"]) == 0
    assert released == [True]  # not called: the fresh head ran in torch
    capsys.readouterr()
