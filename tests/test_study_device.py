"""`vitlab study scaling|transfer --device`: every run trains where asked (a study on a GPU machine can be kept on
the CPU), a device that is not there is one line before the study folder exists, and the device is recorded."""

from __future__ import annotations

import json

import pytest
import torch
from tests.test_study_scaling import TINY_RESNET
from tests.test_study_scaling import _settings as scaling_settings
from tests.test_study_transfer import _settings as transfer_settings

from vitlab.cli import main
from vitlab.errors import VitlabError
from vitlab.experiments.scaling import run_scaling_study
from vitlab.experiments.transfer import run_transfer_study

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")


def test_scaling_runs_on_the_device_asked_for_and_records_it(tmp_path):
    out = tmp_path / "s"
    run_scaling_study(scaling_settings(models=[TINY_RESNET], sizes=[40], seeds=1, device="cpu"), out)
    assert json.loads((out / "settings.json").read_text())["device"] == "cpu"
    runs = json.loads((out / "study.json").read_text())["runs"]
    summary = json.loads((out / runs[0]["run"] / "summary.json").read_text())
    assert summary["device"] == "cpu"
    with pytest.raises(VitlabError, match=r"other settings \(device\)"):  # a rerun must ask for the same
        run_scaling_study(scaling_settings(models=[TINY_RESNET], sizes=[40], seeds=1, device="auto"), out)


@NO_GPU
@pytest.mark.parametrize("study", ["scaling", "transfer"])
def test_a_missing_gpu_is_one_line_before_anything_is_written(tmp_path, study, capsys):
    out = tmp_path / study
    run = run_scaling_study if study == "scaling" else run_transfer_study
    settings = scaling_settings if study == "scaling" else transfer_settings
    with pytest.raises(VitlabError, match="no CUDA GPU is visible"):
        run(settings(device="cuda"), out)
    assert not out.exists()
    assert main(["study", study, "--data", "bundled", "--device", "cuda", "--out", str(out)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda" in err[0] and not out.exists()


def test_transfer_passes_the_device_to_pretraining_and_fine_tuning(tmp_path, monkeypatch):
    """The pre-training runs and the downstream compare both get it (checked where they are configured)."""
    import vitlab.train as train_module  # pretrain imports train from it when it runs
    from vitlab.experiments import compare, transfer

    seen = {}

    def fake_train(cfg, *a, **k):
        seen.setdefault("pretrain", set()).add(cfg.device)
        raise SystemExit  # stop after the first run was configured

    monkeypatch.setattr(train_module, "train", fake_train)
    with pytest.raises(SystemExit):
        run_transfer_study(transfer_settings(models=[TINY_RESNET], device="cpu"), tmp_path / "t")
    assert seen["pretrain"] == {"cpu"}
    assert json.loads((tmp_path / "t" / "settings.json").read_text())["device"] == "cpu"
    st = transfer_settings(device="cpu")
    captured = {}

    def fake_compare(data, models, settings, out, **kw):
        captured["device"] = settings.device
        raise SystemExit

    monkeypatch.setattr(compare, "run_compare", fake_compare)
    data = transfer.downstream_data(4, st)
    with pytest.raises(SystemExit):
        transfer.downstream({}, 4, data, st, tmp_path / "d")
    assert captured["device"] == "cpu"
