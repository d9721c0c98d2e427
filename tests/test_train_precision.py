"""`--precision auto` on a CPU follows a measurement (bf16 is faster on some CPUs with bf16 instructions and
slower on others), and the run folder records the precision that ran."""

import json

import pytest
import torch
import yaml

from vitlab import runtime
from vitlab.models.registry import create_model
from vitlab.train import precision as P
from vitlab.train import train

CPU = torch.device("cpu")


def _models():
    narrow = create_model("custom", dim=32, depth=1, heads=4, mlp_dim=64, patch_size=4, image_size=16, num_classes=3)
    stem = create_model("custom", conv_stem=[8, 16], patch_size=1, dim=32, depth=1, heads=4, mlp_dim=64,
                        image_size=16, in_chans=1, num_classes=3)
    wide = create_model("custom", dim=192, depth=1, heads=3, mlp_dim=64, patch_size=8, image_size=16, num_classes=3)
    return narrow, stem, wide


@pytest.mark.parametrize("speedup, expected", [
    ("3.0", ("fp32", "bf16-stem", "bf16")),  # bf16 much faster (as on the AMD EPYC of docs/training.md)
    ("0.5", ("fp32", "fp32", "fp32")),  # bf16 measured 2x slower (the Intel Xeon of docs/training.md)
    ("1.1", ("fp32", "fp32", "fp32")),  # a gain too small to pay for autocast's casts
])
def test_auto_follows_the_measured_speedup(monkeypatch, speedup, expected):
    monkeypatch.setattr(runtime, "cpu_bf16_supported", lambda: True)
    monkeypatch.setenv("VITLAB_CPU_BF16_SPEEDUP", speedup)
    assert tuple(P.resolve_precision("auto", CPU, m) for m in _models()) == expected


def test_explicit_precision_is_kept_and_no_bf16_kernels_means_fp32(monkeypatch):
    narrow, stem, wide = _models()
    assert P.resolve_precision("bf16", CPU, narrow) == "bf16"
    assert P.resolve_precision("fp32", CPU, wide) == "fp32"
    monkeypatch.delenv("VITLAB_CPU_BF16_SPEEDUP", raising=False)
    monkeypatch.setattr(runtime, "cpu_bf16_supported", lambda: False)
    assert P.cpu_bf16_speedup() == 0.0
    assert P.resolve_precision("auto", CPU, wide) == "fp32"


def test_speedup_is_a_real_timing_kept_for_the_machine(tmp_path, monkeypatch):
    """Measured anew by every run, the probe picked fp32 in one run and bf16-stem in the next on a busy machine
    (four runs of one command: fp32, bf16-stem, bf16-stem, bf16-stem). It is now kept per machine."""
    monkeypatch.delenv("VITLAB_CPU_BF16_SPEEDUP", raising=False)
    monkeypatch.delenv("VITLAB_RETIME", raising=False)
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path))
    if not P.cpu_bf16_supported():
        pytest.skip("no bf16 kernels on this CPU")
    P._bf16_speedup.cache_clear()
    first = P.cpu_bf16_speedup()
    assert 0.05 < first < 50  # a ratio of two timings of the same product, not a constant
    P._bf16_speedup.cache_clear()  # a new process: the kept value, not a new timing
    monkeypatch.setattr(runtime, "_bf16_speedup", lambda threads: pytest.fail("measured again"))
    assert P.cpu_bf16_speedup() == first
    monkeypatch.setenv("VITLAB_RETIME", "1")
    monkeypatch.setattr(runtime, "_bf16_speedup", lambda threads: 7.0)
    assert P.cpu_bf16_speedup() == 7.0 and json.loads((tmp_path / "machine" / "cpu_bf16_speedup.json").read_text())


def test_config_yaml_records_the_resolved_precision(tmp_path, monkeypatch):
    from test_train_loop import tiny_cfg, tiny_data

    monkeypatch.setenv("VITLAB_CPU_BF16_SPEEDUP", "0.5")
    cfg = tiny_cfg(tmp_path, model_args=dict(conv_stem=[8], patch_size=1, dim=32, depth=1, heads=2, mlp_dim=64),
                   epochs=1, device="cpu")  # the CPU's bf16 probe decides; a GPU would take bf16
    assert cfg.precision == "auto"
    result = train(cfg, data=tiny_data())
    saved = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert saved["precision"] == "fp32"
