"""`vitlab compare` end to end: tiny models on a tiny data set, from scratch and from "pretrained" weights."""

import csv
import json

import pytest
import torch

from vitlab.cli import main
from vitlab.data import Preprocess, load_data
from vitlab.experiments.compare import parse_models
from vitlab.models import create_model
from vitlab.weights import save_native

CLASSES = "Sandal,Sneaker,Ankle boot"


def test_parse_models():
    ms = parse_models("vit-b/16,custom(dim=32,depth=1),resnet-50", "a.npz,-,none")
    assert [m.spec for m in ms] == ["vit-b/16", "custom(dim=32,depth=1)", "resnet-50"]
    assert [m.weights for m in ms] == ["a.npz", None, None]
    assert [m.name for m in parse_models("resnet-50,resnet-50")] == ["resnet-50 #1", "resnet-50 #2"]
    from vitlab.errors import VitlabError

    with pytest.raises(VitlabError):
        parse_models("vit-b/16,resnet-50", "a.npz")


def test_compare_end_to_end(tmp_path, capsys):
    # "pretrained": a tiny ViT over all 10 bundled classes, saved in the native format
    names = load_data("bundled", per_class=1, progress=False).class_names
    pre = Preprocess.for_model(28, channels=1)
    pretrained = create_model("custom", num_classes=10, dim=32, depth=1, heads=2, mlp_dim=64, patch_size=7,
                              image_size=28, in_chans=1, seed=4)
    with torch.no_grad():
        pretrained.head.weight.normal_(0, 1.0)
    save_native(pretrained, tmp_path / "pre", class_names=names, preprocess=pre)

    out = tmp_path / "cmp"
    tiny_vit = "custom(dim=32,depth=1,heads=2,mlp_dim=64,patch_size=7)"
    models = f"{tiny_vit},resnet-26-small(layers=(1,)),tiny-pretrained"
    rc = main(["compare", "--data", "bundled", "--classes", CLASSES, "--per-class", "10",
               "--models", models, f"--weights=-,none,{tmp_path / 'pre'}",
               "--epochs", "2", "--lr", "1e-3", "--batch-size", "10", "--precision", "fp32",
               "--out", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "fine-tuned acc %" in printed and "train images/s" in printed
    assert "zero-shot (mapped pretrained head)" in printed and "untrained model (random init, chance)" in printed
    for f in ("compare.md", "compare.csv", "compare.json", "history.csv", "val_loss.png", "val_accuracy.png",
              "runtime.png"):
        assert (out / f).stat().st_size > 0, f
    summary = json.loads((out / "compare.json").read_text())
    res = {r["model"]: r for r in summary["models"]}
    assert res[tiny_vit]["zero_shot_label"] == "untrained model (random init, chance)"
    assert res[tiny_vit]["source"] == "from scratch"
    # the pretrained model's head knows the three classes by name: mapped, real zero-shot
    assert res["tiny-pretrained"]["zero_shot_label"] == "zero-shot (mapped pretrained head)"
    assert res["tiny-pretrained"]["source"] == "pretrained"
    for r in summary["models"]:
        # the curves start at epoch 0 on the validation split, labelled with the head: the mapped head's
        # zero-shot transfer, or the zero head a from-scratch model trains from (not its random zero-shot head)
        assert [h["epoch"] for h in r["history"]] == [0, 1, 2] and r["epochs"] == 2
        assert r["history"][0]["evaluation"] == (
            r["zero_shot_label"] if r["source"] == "pretrained" else "untrained model (zero head, as training starts)")
        assert all(h["val_loss"] is not None and h["val_acc"] is not None for h in r["history"])
        assert r["train_wall_time_s"] > 0 and r["train_images_per_s"] > 0 and r["status"] == "ok"
        # our evaluation and the training loop's own test pass agree (same preprocessing, fp32)
        assert r["fine_tuned"]["head"]["accuracy"] == pytest.approx(r["train_test_accuracy"])
        assert r["fine_tuned"]["rows"][0]["label"] == "fine-tuned"
    with (out / "compare.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["model"] for r in rows] == [tiny_vit, "resnet-26-small(layers=(1,))", "tiny-pretrained"]
    for r in rows:
        j = res[r["model"]]
        assert float(r["zero_shot_accuracy"]) == pytest.approx(j["zero_shot"]["head"]["accuracy"], abs=1e-6)
        assert float(r["fine_tuned_macro_f1"]) == pytest.approx(j["fine_tuned"]["head"]["macro_f1"], abs=1e-6)
        assert r["test_images"] == "300" and r["train_images"] == "30"
    assert [(t["a"], t["b"]) for t in summary["mcnemar"]] == [
        (tiny_vit, "resnet-26-small(layers=(1,))"), (tiny_vit, "tiny-pretrained"),
        ("resnet-26-small(layers=(1,))", "tiny-pretrained")]
    assert all(0.0 <= t["p_value"] <= 1.0 for t in summary["mcnemar"])
    with (out / "history.csv").open() as f:
        hist = list(csv.DictReader(f))
    assert [h["epoch"] for h in hist if h["model"] == "tiny-pretrained"] == ["0", "1", "2"]
    md = (out / "compare.md").read_text()
    assert "McNemar" in md and "train images/s" in md
    assert "untrained model (random init, chance)" in md and "zero-shot (mapped pretrained head)" in md
    # the fine-tuning run folder evaluates again to the same number, with the run's own data settings
    run = res["tiny-pretrained"]["run_dir"]
    assert main(["evaluate", run, "--quiet", "--out", str(tmp_path / "re")]) == 0
    again = json.loads((tmp_path / "re" / "metrics.json").read_text())
    assert again["rows"][0]["label"] == "trained head"
    assert again["head"]["accuracy"] == pytest.approx(res["tiny-pretrained"]["fine_tuned"]["head"]["accuracy"])


def test_from_scratch_image_size_fits_the_patch():
    from vitlab.evaluate.loading import fit_image_size, parse_model_spec, split_model_list

    assert fit_image_size("vit-b/16", 28) == 32  # 28 px data, 16 px patches
    assert fit_image_size("r50+vit-b/16", 28) == 32  # stride 16 = 1 x the stem's 16
    assert fit_image_size("custom(patch_size=7)", 28) == 28
    assert fit_image_size("resnet-50", 28) == 28  # any size works for a ResNet
    assert fit_image_size("custom(conv_stem=(8,16,24),patch_size=1)", 28) == 28  # the stem pads
    # 28 -> 14 -> 7 is no multiple of patch 2; 29 -> 15 -> 8 is
    assert fit_image_size("custom(conv_stem=(8,16),patch_size=2)", 28) == 29
    assert parse_model_spec("resnet-26-small(layers=(1,1),width_factor=2)") == (
        "resnet-26-small", {"layers": (1, 1), "width_factor": 2})
    assert split_model_list("a(x=1,y=(1,2)),b") == ["a(x=1,y=(1,2))", "b"]


def test_a_zero_shot_map_that_does_not_fit_the_data_stops_before_anything_is_written(tmp_path, capsys):
    """Accepted before whatever the models were (from-scratch ones never read it), and shown in compare.md."""
    out = tmp_path / "cmp"
    args = ["compare", "--data", "digits", "--models", "resnet-18", "--epochs", "1", "--out", str(out), "--quiet"]
    assert main([*args, "--zero-shot-map", "Sandal=774"]) == 2
    assert "--zero-shot-map names class 'Sandal', which the data set does not have" in capsys.readouterr().err
    assert main([*args, "--zero-shot-map", "0=1,1=2"]) == 2
    assert "leaves classes ['2', '3', '4', '5', '6', '7', '8', '9'] unmapped" in capsys.readouterr().err
    assert not out.exists()


def test_a_training_interrupted_inside_compare_says_to_rerun_compare(tmp_path, monkeypatch, capsys):
    """Its own advice, `vitlab train --resume OUT/MODEL/finetune`, would train a run compare never picks up."""
    from pathlib import Path

    import vitlab.experiments.compare as experiment
    from vitlab.train.config import TrainConfig
    from vitlab.train.resume import resume_command

    said = []

    def interrupted(*args, **kwargs):
        said.append(resume_command(TrainConfig(), Path("inner")))
        raise KeyboardInterrupt

    monkeypatch.setattr(experiment, "run_compare", interrupted)
    out = tmp_path / "cmp"
    assert main(["compare", "--data", "digits", "--models", "resnet-18", "--out", str(out), "--quiet"]) == 130
    assert said == [f"the same `vitlab compare` command with --resume {out} (finished models are kept)"]
    assert resume_command(TrainConfig(), Path("inner")) == "vitlab train --resume inner"  # outside compare


@pytest.mark.parametrize("models, words", [
    ("resnet-18,vit-zz/16", "--models entry 'vit-zz/16': no such file or folder"),
    ("custom(dim=32,depht=1)", "unknown model config fields ['depht'] (for depht use depth)"),
    ("custom(dim=32", "the overrides have no closing ')'"),
])
def test_a_bad_model_entry_stops_before_any_model_trains(tmp_path, capsys, models, words):
    out = tmp_path / "cmp"
    assert main(["compare", "--data", "digits", "--models", models, "--epochs", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_frozen_feature_rows_reach_the_csv_and_the_printed_table(tmp_path, capsys):
    """--knn / --fewshot rows were only in compare.md."""
    out = tmp_path / "cmp"
    tiny_vit = "custom(dim=32,depth=1,heads=2,mlp_dim=64,patch_size=7)"
    rc = main(["compare", "--data", "bundled", "--classes", CLASSES, "--per-class", "10", "--models", tiny_vit,
               "--epochs", "1", "--batch-size", "10", "--precision", "fp32", "--out", str(out), "--quiet",
               "--knn", "--fewshot", "--shots", "1,2", "--fewshot-seeds", "1"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "frozen features before fine-tuning (frozen.csv)" in printed and "kNN" in printed
    with (out / "frozen.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["model"] for r in rows] == [tiny_vit] * 3  # two few-shot counts and the kNN
    assert {r["method"] for r in rows} >= {"fewshot-1", "fewshot-2"} and all(0 <= float(r["accuracy"]) <= 1 for r in rows)
