"""Timings that run on a machine's first use only (then come from the cache) leave the program's random streams
where they were: a seeded program draws the same numbers on its first run on a machine as on every later one.
They drew their random inputs from torch's global generator, so a user's own training loop drew other dropout
masks (and its data order other numbers) the first time its model timed its training products."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import vitlab
from vitlab import runtime
from vitlab.models import fast_linear

pytestmark = pytest.mark.usefixtures("keep_torch_threads")  # tests/conftest.py


@pytest.fixture(autouse=True)
def timing_again(monkeypatch):
    """Every measurement runs, as on a machine's first use, and the products route goes back to its default."""
    monkeypatch.setenv("VITLAB_RETIME", "1")
    monkeypatch.delenv("VITLAB_TORCH_PRODUCTS_SPEEDUP", raising=False)
    monkeypatch.delenv("VITLAB_CPU_BF16_SPEEDUP", raising=False)
    yield
    fast_linear.set_training_products("auto")
    fast_linear.use_auto_route("onednn")


def random_states() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def assert_untouched(before: tuple) -> None:
    torch_state, python_state, numpy_state = before
    assert torch.equal(torch.get_rng_state(), torch_state), "torch's global random stream moved"
    assert random.getstate() == python_state and np.array_equal(np.random.get_state()[1], numpy_state)


def small_vit() -> torch.nn.Module:
    return vitlab.create_model("custom", image_size=16, patch_size=4, dim=32, depth=2, heads=4, mlp_dim=64,
                               num_classes=5, seed=0)


def test_a_training_forward_that_times_its_products(capsys):
    if not fast_linear.onednn_linear_available():
        pytest.skip("no oneDNN in this torch build: nothing to time")
    model = small_vit().train()  # no dropout: the forward itself draws nothing
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    before = random_states()
    model(x).sum().backward()
    assert "timing the training products" in capsys.readouterr().err
    assert_untouched(before)


def test_the_cpu_bf16_probe():
    torch.manual_seed(0)
    before = random_states()
    runtime._bf16_speedup.__wrapped__(torch.get_num_threads(), size=32, repeats=1)
    assert_untouched(before)


def test_engine_auto_and_export_auto_and_the_attention_engine(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    from vitlab.engine import prepare_engine
    from vitlab.engine.attention import prepare_attention_engine
    from vitlab.export import export_for_engine

    model = small_vit().eval()
    torch.manual_seed(0)
    before = random_states()
    prepare_engine(model, "auto", batch_size=2, source=tmp_path, quiet=True)
    prepare_attention_engine(model, "auto", batch_size=2, source=tmp_path, quiet=True)
    _, written = export_for_engine(model, tmp_path / "model.onnx", "auto", source=tmp_path, quiet=True)
    assert "auto: ONNX Runtime fused" in written  # the export timed its two graphs
    assert_untouched(before)
