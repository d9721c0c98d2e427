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
    # compute in MMACs, as the scaling study's table gives it (0.0118 GMACs read as nothing)
    assert "MMACs/image" in md and f"| {1000 * rows[0]['gmacs']:,.1f} |" in md

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


def test_classes_are_compared_as_classes_of_the_data(tmp_path):
    """'0' is T-shirt/top: the check compared strings. An empty list meant all classes; one class is 100 %."""
    out = tmp_path / "study"
    cases = [
        (dict(upstream_classes=["0", "1", "2"], downstream_classes=["T-shirt/top", "Sandal"]),
         r"disjoint; both have \['T-shirt/top'\]"),
        (dict(upstream_classes=["trouser", "1"]), "--upstream gives class 'Trouser' twice"),
        (dict(upstream_classes=[]), "--upstream is empty"),
        (dict(upstream_classes=[" ", ""]), "--upstream is empty"),
        (dict(downstream_classes=["Sandal"]), "--downstream has one class"),
        (dict(downstream_classes=["Sandal", "Snaekers"]), "--downstream: unknown class"),
    ]
    for kw, match in cases:
        with pytest.raises(VitlabError, match=match):
            run_transfer_study(_settings(**kw), out)
        assert not out.exists()


def test_bad_model_lists_are_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "study"
    cases = [
        ([TINY_VIT, TINY_RESNET, TINY_VIT], "twice"),  # was silently de-duplicated
        (["custom(dim=16,depth=1,heads=2,patch_size=7,num_classes=3)"], "num_classes is decided by"),
        (["custom(dim=16,depth=1,heads=2,patch_size=5)"], "not a multiple"),  # a 28 px image
        (["custom(dim=16,depth=1,heads=2"], r"no closing '\)'"),
    ]
    for models, match in cases:
        with pytest.raises(VitlabError, match=match):
            run_transfer_study(_settings(models=models), out)
        assert not out.exists()


def test_refuses_other_data_and_a_changed_thread_count(tmp_path):
    out = tmp_path / "study"
    out.mkdir()
    identity = {"classes": ["a", "b"], "images": {"train": 10, "val": 2, "test": 2}}
    (out / "settings.json").write_text(json.dumps({"data_identity": identity}))
    with pytest.raises(VitlabError, match="other data"):  # its pre-training runs were made on that data
        run_transfer_study(_settings(), out)
    (out / "settings.json").write_text(json.dumps({"threads": 1}))
    with pytest.raises(VitlabError, match=r"other settings \(threads\)"):
        run_transfer_study(_settings(threads=2), out)
    # the same classes written another way are the same setting
    (out / "settings.json").write_text(json.dumps({"downstream_classes": ["sandal", "7", "Ankle boot"],
                                                   "pretrain_lr": 1.0}))
    with pytest.raises(VitlabError, match=r"other settings \(pretrain_lr\)"):
        run_transfer_study(_settings(), out)


def test_reports_the_sizes_batch_steps_and_threads_really_used(tmp_path):
    """--per-class above what the data has (450 per class after the validation split) reports 450, not the ask."""
    import torch

    out = tmp_path / "study"
    before = torch.get_num_threads()
    try:
        rows = run_transfer_study(_settings(models=[TINY_VIT], per_class=[5, 1000, 2000], finetune_epochs=0,
                                            threads=1), out)
    finally:
        torch.set_num_threads(before)
    assert [(r["per_class"], r["per_class_requested"], r["train_images"], r["batch"]) for r in rows] == [
        (5, 5, 15, 15), (450, 1000, 1350, 16)]  # 2000 draws the same images as 1000: one row
    md = (out / "study.md").read_text()
    assert "450 (asked 1000" in md and "| 1000 |" not in md
    assert "batch 16 (15 at 5 images/class" in md  # 15 images: the batch that ran
    assert "CPU threads: 1 for every run" in md
    assert json.loads((out / "settings.json").read_text())["threads"] == 1
    with (out / "downstream-1000" / "frozen.csv").open() as fh:
        labels = [r["label"] for r in csv.DictReader(fh)]
    assert any("450-shot" in label for label in labels) and not any("1000-shot" in label for label in labels)
    compare_md = (out / "downstream-5" / "compare.md").read_text()
    assert "0 epochs" not in compare_md and f"{rows[0]['steps']} steps" in compare_md
    import yaml

    for run in (out / "pretrain").iterdir(), (out / "downstream-5").glob("*/finetune"):
        for r in run:
            assert yaml.safe_load((r / "config.yaml").read_text())["threads"] == 1


def test_long_specs_pretrain_in_their_own_folders(tmp_path, monkeypatch):
    """Specs cut to the same 60 characters shared a pre-training run: B's row repeated A's numbers."""
    from vitlab.experiments.compare import _safe

    long_a = "custom(dim=16,depth=1,heads=2,mlp_dim=32,classifier=token,patch_size=7)"
    long_b = "custom(dim=16,depth=1,heads=2,mlp_dim=32,classifier=token,patch_size=4)"
    folders = []
    monkeypatch.setattr("vitlab.train.train", lambda cfg, **k: folders.append((cfg.name, cfg.model_args)))
    for name in (long_a, long_b):
        transfer.pretrain(name, _settings(threads=1), tmp_path)
    assert folders[0][0] != folders[1][0]
    assert [args["patch_size"] for _, args in folders] == [7, 4]
    assert _safe(long_a) != _safe(long_b)  # and so are their downstream compare folders
