"""`vitlab compare` reports what it really did: the resolved fine-tuning settings and thread count, the real
sizes of frozen-feature rows, models built at the data's size, the head fine-tuning starts from; and it
refuses, in one line and before any work, what it cannot compare (one class, a batch over the training
set, --set of its own data settings, --out naming a file)."""

import csv
import json
import math

import pytest
import torch
import yaml

import vitlab.experiments.compare as cmp
from vitlab.cli import main
from vitlab.data import Preprocess, load_data
from vitlab.errors import VitlabError
from vitlab.models import create_model
from vitlab.weights import save_native

TINY = "custom(dim=16,depth=1,heads=2,mlp_dim=32,patch_size=7)"
DATA = ["--data", "bundled", "--classes", "Sandal,Sneaker", "--per-class", "5"]
BUDGET = ["--epochs", "1", "--lr", "1e-3", "--batch-size", "5", "--precision", "fp32", "--quiet"]


def _compare(out, models=TINY, *extra, data=DATA, budget=BUDGET):
    return main(["compare", *data, "--models", models, *budget, "--out", str(out), *extra])


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _run_config(out, model: str) -> dict:
    return yaml.safe_load((out / cmp._safe(model) / "finetune" / "config.yaml").read_text())


def test_the_report_shows_the_resolved_settings_and_the_one_thread_count(tmp_path, capsys):
    """--set epochs=2 --set lr=0.05 trained 2 epochs at 0.05 while compare.md said 1 epoch at 0.001; and each model
    picked its own thread count from the load average. The count is decided once, recorded and printed."""
    out = tmp_path / "cmp"
    second = "custom(dim=16,depth=1,heads=2,mlp_dim=24,patch_size=7)"
    assert _compare(out, f"{TINY},{second}", "--set", "epochs=2", "--set", "lr=0.05",
                    "--set", "label_smoothing=0.1") == 0
    md = (out / "compare.md").read_text()
    summary = json.loads((out / "compare.json").read_text())
    threads = summary["settings"]["threads"]
    assert isinstance(threads, int) and threads >= 1  # decided at the start, not left to each run
    assert "2 epochs, adamw lr 0.05 " in md and "label smoothing 0.1" in md and f"CPU threads: {threads}" in md
    assert "1 epochs" not in md and "lr 0.001" not in md
    for model in (TINY, second):
        cfg = _run_config(out, model)
        assert (cfg["epochs"], cfg["lr"], cfg["label_smoothing"], cfg["threads"]) == (2, 0.05, 0.1, threads)
        res = json.loads((out / cmp._safe(model) / "result.json").read_text())
        assert res["training"]["threads"] == threads and res["settings_used"]["settings"]["threads"] == threads
    # resumed without --threads: the recorded count, whatever the machine's load says now
    assert cmp.recorded_threads(out, cmp.parse_models(f"{TINY},{second}")) == threads
    capsys.readouterr()
    other = threads + 1
    assert _compare(out, f"{TINY},{second}", "--set", "epochs=2", "--set", "lr=0.05", "--set", "label_smoothing=0.1",
                    "--threads", str(other)) == 2
    line = _one_error_line(capsys)
    assert f"threads {threads} -> {other}" in line and "other settings" in line


def test_a_resume_without_threads_takes_the_recorded_count(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cmp"
    assert _compare(out, TINY, "--threads", "1") == 0
    import vitlab.runtime

    # a machine that would now pick another count (the CLI's runtime and the study's own decision both ask it)
    monkeypatch.setattr(vitlab.runtime, "choose_threads", lambda requested: (requested or 3, "test"))
    capsys.readouterr()
    assert main(["compare", *DATA, "--models", TINY, *BUDGET[:-1], "--resume", str(out)]) == 0
    printed = capsys.readouterr()
    assert "finished earlier, reusing" in printed.out and "threads 1 (recorded by the study in" in printed.err


def test_a_result_from_before_threads_were_recorded_is_kept_and_said(tmp_path, capsys):
    """Studies made before compare recorded one thread count (settings.threads None) were refused on every rerun
    as 'made with other settings (threads None -> 2)'."""
    out = tmp_path / "cmp"
    assert _compare(out, TINY, "--threads", "1") == 0
    result = out / cmp._safe(TINY) / "result.json"
    record = json.loads(result.read_text())
    record["settings_used"]["settings"]["threads"] = None  # as an older vitlab wrote it
    result.write_text(json.dumps(record))
    capsys.readouterr()
    assert _compare(out, TINY, "--threads", "2", budget=BUDGET[:-1]) == 0  # not --quiet: says it reuses
    printed = capsys.readouterr()
    assert "finished earlier, reusing" in printed.out
    assert "does not record its CPU thread count" in printed.err and "runs at 2 threads" in printed.err


@pytest.mark.parametrize("setting, flag", [
    ("data=digits", "--data"), ("classes=Sandal", "--classes"), ("per_class=3", "--per-class"),
    ("val_fraction=0.2", "--val-fraction"), ("seed=3", "--seed"), ("threads=2", "--threads"),
    ("image_size=32", "--image-size"), ("name=x", "--out"),
])
def test_set_of_a_setting_compare_owns_is_refused(tmp_path, capsys, setting, flag):
    """--set data=digits trained on compare's data while the run's config.yaml said digits."""
    out = tmp_path / "cmp"
    assert _compare(out, TINY, "--set", setting) == 2
    line = _one_error_line(capsys)
    assert f"--set {setting.split('=')[0]}=... is compare's own setting" in line and f"use {flag} instead" in line
    assert not out.exists()
    with pytest.raises(VitlabError, match="compare's own setting"):  # callers of the API too
        cmp.training_config(cmp.CompareSettings(train_overrides={setting.split("=")[0]: 1}))


def test_a_custom_patch_size_is_checked_and_built_at_the_datas_size(tmp_path, capsys):
    """patch_size=5 was checked at 224 px (refused, even with --image-size 30) although the data is 28 px."""
    spec = "custom(dim=16,depth=1,heads=2,mlp_dim=32,patch_size=5)"
    cmp.check_model_specs(cmp.parse_models(spec))  # before the data is known: the fields only
    assert cmp.build_size(spec, None, 28) == 30 and cmp.build_size(spec, 35, 28) == 35
    assert cmp.build_size("custom(patch_size=5,image_size=30)", None, 28) == 30
    out = tmp_path / "cmp"
    assert _compare(out, spec) == 0
    assert _run_config(out, spec)["image_size"] == 30
    assert _compare(tmp_path / "c35", spec, "--image-size", "35") == 0  # --image-size applies
    assert _run_config(tmp_path / "c35", spec)["image_size"] == 35
    capsys.readouterr()
    assert _compare(tmp_path / "c32", spec, "--image-size", "32") == 2
    line = _one_error_line(capsys)
    assert "image size (32, 32) is not a multiple of the total stride 5" in line
    assert not (tmp_path / "c32").exists()


def test_frozen_rows_show_the_images_and_k_really_used(tmp_path, capsys):
    """3 images per class: a 5-shot row claimed 10 training images (6 used) and kNN k=20 (6 used)."""
    out = tmp_path / "cmp"
    data = ["--data", "bundled", "--classes", "Sandal,Sneaker", "--per-class", "3"]
    budget = ["--epochs", "1", "--batch-size", "3", "--precision", "fp32", "--quiet"]
    assert _compare(out, TINY, "--fewshot", "--shots", "1,5", "--fewshot-seeds", "1", "--knn",
                    data=data, budget=budget) == 0
    with (out / "frozen.csv").open() as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert rows["fewshot-1"]["train_images"] == "2" and "incomplete" not in rows["fewshot-1"]["label"]
    assert rows["fewshot-5"]["train_images"] == "6" and "incomplete" in rows["fewshot-5"]["label"]
    assert rows["knn"]["label"].startswith("kNN k=6 ") and rows["knn"]["train_images"] == "6"
    md = (out / "compare.md").read_text()
    assert "5-shot (frozen; incomplete)" in md and "kNN k=6 " in md and "kNN k=20" not in md
    report = (out / cmp._safe(TINY) / "zero-shot" / "metrics.json").read_text()
    assert "kNN k=20" not in report  # the per-model report says the same


def test_one_class_and_a_batch_over_the_training_set_are_refused_up_front(tmp_path, capsys):
    out = tmp_path / "cmp"
    one = ["--data", "bundled", "--classes", "Sandal", "--per-class", "5"]
    assert _compare(out, TINY, data=one) == 2
    assert "a comparison needs at least 2" in _one_error_line(capsys)
    assert _compare(out, TINY, "--batch-size", "16") == 2  # 10 training images; found before any model ran
    assert "--batch-size 16 is larger than the training set (10 images)" in _one_error_line(capsys)
    assert not out.exists()
    (tmp_path / "afile").write_text("")
    assert _compare(tmp_path / "afile", TINY) == 2
    assert "is a file, not a folder" in _one_error_line(capsys)


def _pretrained(tmp_path, class_names):
    model = create_model("custom", num_classes=len(class_names), dim=16, depth=1, heads=2, mlp_dim=32,
                         patch_size=7, image_size=28, in_chans=1, seed=4)
    with torch.no_grad():
        model.head.weight.normal_(0, 1.0)
        model.head.bias.normal_(0, 1.0)
    save_native(model, tmp_path / "pre", class_names=class_names, preprocess=Preprocess.for_model(28, channels=1))
    return model


def test_a_head_with_the_classes_in_another_order_is_reordered_not_replaced(tmp_path, capsys):
    """The zero-shot row said 'trained head' (mapped by name) while fine-tuning then started from a zero head."""
    from vitlab.evaluate.loading import load_for_eval

    data = load_data("bundled", classes="T-shirt/top,Trouser,Pullover", per_class=2, progress=False)
    assert list(data.class_names) == ["T-shirt/top", "Trouser", "Pullover"]
    _pretrained(tmp_path, ["Pullover", "Trouser", "T-shirt/top"])
    lm = load_for_eval(str(tmp_path / "pre"))
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        before = lm.model(x)
    assert cmp._start_head(lm.model, lm, data, cmp.CompareSettings(), "pretrained") is True
    with torch.no_grad():
        assert torch.allclose(lm.model(x), before[:, [2, 1, 0]])  # the data's order, by name

    out = tmp_path / "cmp"
    rc = main(["compare", "--data", "bundled", "--classes", "T-shirt/top,Trouser,Pullover", "--per-class", "5",
               "--models", "pre", f"--weights={tmp_path / 'pre'}", *BUDGET[:-1], "--lr", "1e-9", "--out", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "head: new, zero-initialised" not in captured.out + captured.err
    res = json.loads((out / "pre" / "result.json").read_text())
    assert res["zero_shot_label"] == res["start_head"] == res["history"][0]["evaluation"] == "trained head"
    assert _run_config(out, "pre")["zero_head"] is False
    # the trained head, reordered, barely moved by lr 1e-9: the same predictions as the zero-shot row
    assert res["fine_tuned"]["head"]["accuracy"] == pytest.approx(res["zero_shot"]["head"]["accuracy"])


def test_epoch_zero_evaluates_the_head_fine_tuning_starts_from(tmp_path):
    """A from-scratch model's epoch 0 was its random zero-shot head; its fine-tuning starts from a zero head."""
    out = tmp_path / "cmp"
    assert _compare(out, TINY) == 0
    res = json.loads((out / cmp._safe(TINY) / "result.json").read_text())
    assert res["zero_shot_label"] == "untrained model (random init, chance)"
    start = res["history"][0]
    assert start["epoch"] == 0 and start["evaluation"] == "untrained model (zero head, as training starts)"
    assert start["val_loss"] == pytest.approx(math.log(2), abs=1e-5)  # all-equal logits over 2 classes
    assert "Epoch 0 of the curves: each model as its fine-tuning starts" in (out / "compare.md").read_text()


def test_models_at_different_input_sizes_are_said(tmp_path, capsys):
    """A patch-5 model runs at 30 px and a patch-7 one at 28 px on the same data: compare.md said the fine-tuning was
    identical for every model and no file named the sizes."""
    out = tmp_path / "cmp"
    five = "custom(dim=16,depth=1,heads=2,mlp_dim=32,patch_size=5)"
    assert _compare(out, f"{TINY},{five}") == 0
    md = (out / "compare.md").read_text()
    assert "**not identical**: input size" in md and "28x28 px" in md and "30x30 px" in md
    with (out / "compare.csv").open() as f:
        sizes = {r["model"]: r["image_size"] for r in csv.DictReader(f)}
    assert set(sizes.values()) == {"28x28", "30x30"}
    assert _compare(tmp_path / "one", TINY) == 0  # one size: nothing to say
    assert "input size" not in (tmp_path / "one" / "compare.md").read_text()
    capsys.readouterr()


def test_compare_report_names_the_finetune_recipes_crop_sampler():
    """compare fine-tunes with the finetune recipe, whose crops follow TF's sampler: with --augment the report
    says so (a study with crops drawn otherwise is another study)."""
    from vitlab.experiments.compare import CompareSettings, _describe_training, training_config

    tr = training_config(CompareSettings(augment=True))
    assert tr["crop_sampler"] == "tf"
    text = _describe_training(tr, {})
    assert "crop (TF's box sampler) + flip augmentation" in text
    assert "no augmentation" in _describe_training(training_config(CompareSettings()), {})
