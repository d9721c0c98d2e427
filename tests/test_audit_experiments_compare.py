"""Audit of `vitlab compare` (experiments): what compare.md says about the fine-tuning is what ran, and two
`--models` entries never share one model folder."""

import csv
import json

import pytest

import vitlab.experiments.compare as cmp
from vitlab.cli import main

TINY = "custom(dim=16,depth=1,heads=2,mlp_dim=32,patch_size=7)"
DATA = ["--data", "bundled", "--classes", "Sandal,Sneaker,Ankle boot", "--per-class", "10"]
BUDGET = ["--epochs", "1", "--lr", "1e-3", "--batch-size", "10", "--quiet", "--threads", "1"]


def test_entries_that_would_share_a_folder_are_refused_before_anything_runs(tmp_path, capsys):
    # the same spec written with spaces has the same folder: the second model deleted the first one's run,
    # both rows pointed at one run folder, and every rerun was refused as "made with other settings"
    out = tmp_path / "cmp"
    spaced = TINY.replace(",", ", ")
    rc = main(["compare", *DATA, "--models", f"{TINY},{spaced}", *BUDGET, "--precision", "fp32", "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "would share the folder" in err[0] and "--models" in err[0]
    assert not out.exists()
    # the API refuses it too (check_model_specs is what run_compare calls)
    with pytest.raises(cmp.VitlabError, match="would share the folder"):
        cmp.check_model_specs(cmp.parse_models(f"{TINY},{spaced}"))
    # a model given twice (other weights) keeps its numbered, distinct folders
    cmp.check_model_specs(cmp.parse_models(f"{TINY},{TINY}"))


def test_report_states_the_warmup_that_ran_and_the_precision_of_each_model(tmp_path, monkeypatch):
    """--warmup-steps longer than the run is capped by the training (3 steps here): compare.md said "warm-up 100
    steps" and "1 epochs". --precision auto picks each model's precision (bf16 for a wide ViT on a CPU with fast
    bf16, fp32 for a ResNet): compare.md called the fine-tuning "identical for every model" without a word."""
    import vitlab.train.loop as loop

    real = loop.run_precision

    def per_model(cfg, device, model, info):  # what `auto` picks on a CPU with fast bf16 kernels
        if cfg.precision == "auto":
            return "bf16" if getattr(model.config, "arch", "vit") == "vit" else "fp32"
        return real(cfg, device, model, info)

    monkeypatch.setattr(loop, "run_precision", per_model)
    out = tmp_path / "cmp"
    resnet = "resnet-26-small(layers=(1,),base_width=4)"
    rc = main(["compare", *DATA, "--models", f"{TINY},{resnet}", *BUDGET, "--warmup-steps", "100",
               "--decay", "cosine", "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "compare.json").read_text())
    runs = {r["model"]: json.loads((cmp.Path(r["run_dir"]) / "summary.json").read_text()) for r in summary["models"]}
    assert {s["resolved_settings"]["warmup_steps"] for s in runs.values()} == {3}
    assert [s["precision"] for s in runs.values()] == ["bf16", "fp32"]
    md = (out / "compare.md").read_text()
    assert "1 epoch," in md and "1 epochs" not in md
    assert "warm-up 3 steps" in md and "warm-up 100 steps" not in md
    assert f"precision (auto, chosen per model): {TINY} bf16, {resnet} fp32" in md
    with (out / "compare.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["precision"] for r in rows] == ["bf16", "fp32"]
    assert [r["fine_tuning_precision"] for r in summary["models"]] == ["bf16", "fp32"]


def test_one_precision_for_all_is_said_once(tmp_path):
    out = tmp_path / "cmp"
    assert main(["compare", *DATA, "--models", TINY, *BUDGET, "--precision", "fp32", "--out", str(out)]) == 0
    md = (out / "compare.md").read_text()
    assert "precision fp32" in md and "chosen per model" not in md
