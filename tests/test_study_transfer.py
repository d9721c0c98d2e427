"""`vitlab study transfer` end to end on the bundled data with tiny models: tables, figure, resume."""

from __future__ import annotations

import csv
import json

import pytest

from vitlab.cli import main
from vitlab.errors import VitlabError
from vitlab.experiments import transfer
from vitlab.experiments.transfer import TransferSettings, run_transfer_study

TINY_VIT = "custom(dim=16,depth=1,heads=2,mlp_dim=32,patch_size=7)"
TINY_RESNET = "resnet-18-small(base_width=8,layers=(1,1))"


def _settings(**kw) -> TransferSettings:
    base = dict(data="bundled", models=[TINY_VIT, TINY_RESNET], per_class=[4, 12], pretrain_epochs=0.2,
                pretrain_batch=64, finetune_min_steps=3, finetune_epochs=1, quiet=True)
    base.update(kw)
    return TransferSettings(**base)


def test_study_writes_tables_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "study"
    rows = run_transfer_study(_settings(), out)
    assert len(rows) == 4  # 2 models x 2 sizes
    for f in ("study.md", "study.csv", "study.json", "study.png", "settings.json"):
        assert (out / f).exists(), f
    with (out / "study.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert [(r["model"], int(r["per_class"])) for r in table] == [(TINY_VIT, 4), (TINY_VIT, 12),
                                                                  (TINY_RESNET, 4), (TINY_RESNET, 12)]
    for r in rows:
        assert not r.get("error")
        assert 0.0 <= r["knn_accuracy"] <= 1.0 and 0.0 <= r["finetuned_accuracy"] <= 1.0
        assert r["finetuned_ci95"][0] <= r["finetuned_accuracy"] <= r["finetuned_ci95"][1]
        assert r["train_images"] == 3 * r["per_class"]  # three footwear classes, val held out of the rest
        # the study's numbers are the compare runs' numbers
        compare = json.loads((out / f"downstream-{r['per_class']}" / "compare.json").read_text())
        entry = next(m for m in compare["models"] if m["model"] == r["model"])
        assert entry["fine_tuned"]["head"]["accuracy"] == r["finetuned_accuracy"]
    md = (out / "study.md").read_text()
    assert "fresh head" in md and "kNN" in md and "chance" in md

    # a second run reuses every pre-training run and every finished compare entry
    def boom(*a, **k):
        raise AssertionError("nothing should be trained again")

    monkeypatch.setattr("vitlab.train.train", boom)
    monkeypatch.setattr("vitlab.experiments.compare.train", boom, raising=False)
    again = run_transfer_study(_settings(), out)
    assert [r["finetuned_accuracy"] for r in again] == [r["finetuned_accuracy"] for r in rows]


def test_study_refuses_changed_settings_and_overlap(tmp_path):
    out = tmp_path / "study"
    out.mkdir()
    (out / "settings.json").write_text(json.dumps({"pretrain_lr": 1.0}))
    with pytest.raises(VitlabError, match="other settings"):
        run_transfer_study(_settings(), out)
    with pytest.raises(VitlabError, match="disjoint"):
        run_transfer_study(_settings(downstream_classes=["Bag", "Sandal"]), tmp_path / "other")


def test_study_models_are_comparable():
    """The three default families: a few hundred thousand parameters and 8-17 MMACs per 28 px image."""
    from vitlab.models.registry import analytic_macs, build_model, count_parameters, get_config

    for name in ("vit", "hybrid", "resnet"):
        spec, args = transfer.model_spec(name)
        cfg = get_config(spec, num_classes=7, image_size=28, in_chans=1, **args)
        assert 150_000 < count_parameters(build_model(cfg)) < 500_000
        assert 5e6 < analytic_macs(cfg) < 2e7
    assert transfer.model_spec("resnet")[0] == "resnet-50-small"  # the standard BatchNorm family


def test_study_cli_bad_sizes(capsys):
    with pytest.raises(SystemExit) as exc:  # argparse's own one-line usage error
        main(["study", "transfer", "--per-class", "10,x"])
    assert exc.value.code == 2
    assert "whole numbers" in capsys.readouterr().err


def test_study_typo_does_not_lock_the_folder(tmp_path):
    out = tmp_path / "study"
    with pytest.raises(VitlabError):
        run_transfer_study(_settings(downstream_classes=["Sandal", "Snaekers"]), out)
    with pytest.raises(VitlabError):
        run_transfer_study(_settings(models=["no-such-model"]), out)
    assert not (out / "settings.json").exists()
