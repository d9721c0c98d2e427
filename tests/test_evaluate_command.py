"""`vitlab evaluate` end to end on tiny models and a tiny data set, checked against scikit-learn."""

import json
import shutil

import numpy as np
import pytest
import torch
from sklearn import metrics as skm

from vitlab.cli import main
from vitlab.data import Preprocess, load_data
from vitlab.models import create_model
from vitlab.weights import save_native

CLASSES = "Sandal,Sneaker,Ankle boot"
DATA = ["--data", "bundled", "--classes", CLASSES, "--per-class", "10"]
TINY = dict(dim=32, depth=1, heads=2, mlp_dim=64, patch_size=7, image_size=28, in_chans=1)


@pytest.fixture(scope="module")
def data():
    return load_data("bundled", classes=CLASSES, per_class=10, progress=False)


def _reference_logits(model, dataset, pre):
    """Logits computed here directly: all test images through the preprocessing and the model."""
    x = torch.stack([dataset[i][0] for i in range(len(dataset))])
    with torch.no_grad():
        return model.eval()(pre.batch(x)), dataset.labels.numpy()


def _metrics(out):
    return json.loads((out / "metrics.json").read_text())


def test_trained_head_matches_sklearn(tmp_path, data):
    model = create_model("custom", num_classes=3, seed=1, **TINY)
    with torch.no_grad():  # a head that is not all zeros, so predictions vary
        model.head.weight.normal_(0, 1.0)
    pre = Preprocess.for_model(28, channels=1)
    save_native(model, tmp_path / "w", class_names=CLASSES.split(","), preprocess=pre)
    out = tmp_path / "ev"
    assert main(["evaluate", str(tmp_path / "w"), *DATA, "--out", str(out), "--quiet"]) == 0
    m = _metrics(out)
    assert m["rows"][0]["label"] == "trained head" and m["head_mode"] == "trained"
    logits, y = _reference_logits(model, data.test, pre)
    pred = logits.argmax(1).numpy()
    h = m["head"]
    assert h["accuracy"] == pytest.approx(skm.accuracy_score(y, pred))
    assert h["macro_f1"] == pytest.approx(skm.f1_score(y, pred, average="macro", labels=[0, 1, 2], zero_division=0))
    assert np.array_equal(np.array(h["confusion_matrix"]), skm.confusion_matrix(y, pred, labels=[0, 1, 2]))
    for f in ("confusion_matrix.png", "confusion_matrix.csv", "per_class.csv", "summary.csv", "report.md"):
        assert (out / f).stat().st_size > 0
    assert "95% CI" in (out / "report.md").read_text()


def test_untrained_registry_model_with_frozen_features(tmp_path, data):
    out = tmp_path / "ev"
    spec = "custom(dim=32,depth=1,heads=2,mlp_dim=64,patch_size=7)"
    rc = main(["evaluate", spec, *DATA, "--out", str(out), "--quiet", "--fewshot", "--knn", "--probe",
               "--shots", "1,5", "--fewshot-seeds", "2", "--max-train-per-class", "8"])
    assert rc == 0
    m = _metrics(out)
    assert m["rows"][0]["label"] == "untrained model (random init, chance)"
    assert [r["shots"] for r in m["fewshot"]["results"]] == [1, 5]
    assert all(len(r["accuracy_per_seed"]) == 2 for r in m["fewshot"]["results"])
    assert m["knn"]["n_train"] == 24 and m["probe"]["n_train"] == 24
    labels = [r["label"] for r in m["rows"]]
    assert "few-shot ridge, 5-shot (frozen)" in labels and labels[-1].startswith("linear probe")
    assert (out / "fewshot.png").exists() and (out / "fewshot.csv").read_text().count("\n") == 1 + 2 * 2
    (out / "skipped_files.txt").write_text("x.png\tnot an image\n")  # as an earlier evaluation's list
    # the same folder again without --fewshot: the earlier report's few-shot files must not stay beside it
    assert main(["evaluate", spec, *DATA, "--out", str(out), "--quiet"]) == 0
    assert _metrics(out)["fewshot"] is None
    assert not any((out / f).exists() for f in ("fewshot.png", "fewshot.csv", "skipped_files.txt"))


def test_mapped_by_name_and_by_flag_and_fresh(tmp_path, data):
    # a model over all 10 bundled classes, evaluated on 3 of them: mapped by class name automatically
    full = load_data("bundled", per_class=1, progress=False).class_names
    model = create_model("custom", num_classes=10, seed=2, **TINY)
    with torch.no_grad():
        model.head.weight.normal_(0, 1.0)
    pre = Preprocess.for_model(28, channels=1)
    save_native(model, tmp_path / "w10", class_names=full, preprocess=pre)
    out = tmp_path / "ev"
    assert main(["evaluate", str(tmp_path / "w10"), *DATA, "--out", str(out), "--quiet"]) == 0
    m = _metrics(out)
    assert m["rows"][0]["label"] == "zero-shot (mapped pretrained head)"
    logits, y = _reference_logits(model, data.test, pre)
    idx = [full.index(c) for c in CLASSES.split(",")]
    pred = logits[:, idx].argmax(1).numpy()  # one head class per new class: argmax of the restricted logits
    assert m["head"]["accuracy"] == pytest.approx(skm.accuracy_score(y, pred))
    # an explicit map; a 1000-class head is labelled as ImageNet
    big = create_model("custom", num_classes=1000, seed=3, **TINY)
    save_native(big, tmp_path / "w1k", preprocess=pre)
    assert main(["evaluate", str(tmp_path / "w1k"), *DATA, "--out", str(out), "--quiet",
                 "--zero-shot-map", "Sandal=774,Sneaker=770+630,Ankle boot=514"]) == 0
    assert _metrics(out)["rows"][0]["label"] == "zero-shot (mapped ImageNet head)"
    # no map and no names: a fresh head, chance level, labelled so
    assert main(["evaluate", str(tmp_path / "w1k"), *DATA, "--out", str(out), "--quiet"]) == 0
    m = _metrics(out)
    assert m["rows"][0]["label"] == "zero-shot (fresh head, chance)" and m["head_mode"] == "fresh"


@pytest.mark.parametrize("extra, words", [
    (["--shots", "5"], "--shots sets up --fewshot, which is not on; add --fewshot, or drop --shots"),
    (["--knn-k", "5", "--knn-temperature", "0.1"], "--knn-k, --knn-temperature set up --knn, which is not on"),
])
def test_a_frozen_feature_setting_without_its_analysis_is_refused(capsys, extra, words):
    """It used to run a plain evaluation without a word."""
    assert main(["evaluate", "custom(dim=32,depth=1,heads=2,patch_size=7)", *DATA, "--quiet", *extra]) == 2
    assert words in capsys.readouterr().err


def test_errors_are_one_line(tmp_path, capsys):
    assert main(["evaluate", "no-such-model-or-path", *DATA, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vitlab evaluate: error:") and "vitlab models" in err[0]
    big = create_model("custom", num_classes=1000, seed=3, **TINY)
    save_native(big, tmp_path / "w1k")
    assert main(["evaluate", str(tmp_path / "w1k"), *DATA, "--quiet", "--zero-shot-map", "Sandal=774"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unmapped" in err[0]


def test_choose_head_mode():
    from vitlab.evaluate.runner import choose_head_mode

    m3 = create_model("custom", num_classes=3, seed=0, **TINY)
    assert choose_head_mode(m3, ["a", "b", "c"], ["A", "b", "c"]) == ("trained", None)
    assert choose_head_mode(m3, ["a", "b", "c"], ["c", "a", "b"]) == ("trained", [[1], [2], [0]])
    assert choose_head_mode(m3, ["a", "b", "c"], None) == ("trained", None)
    assert choose_head_mode(m3, ["a", "b"], ["b", "x", "a"]) == ("mapped", [[2], [0]])
    assert choose_head_mode(m3, ["a", "b", "q"], ["a", "b", "c"]) == ("fresh", None)
    assert choose_head_mode(m3, ["a", "b"], None) == ("fresh", None)
    assert choose_head_mode(m3, ["a", "b", "c"], None, head="fresh") == ("fresh", None)


def test_skipped_files_are_counted_once_and_listed(tmp_path, capsys):
    from PIL import Image

    for cls in ("a", "b"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(np.full((28, 28), 40 * i, np.uint8)).save(tmp_path / "imgs" / cls / f"{i}.png")
    (tmp_path / "imgs" / "a" / "bad.png").write_bytes(b"not a png")
    out = tmp_path / "ev"
    spec = "custom(dim=32,depth=1,heads=2,mlp_dim=64,patch_size=7)"
    assert main(["evaluate", spec, "--data", str(tmp_path / "imgs"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("data: skipped 1 file (not an image: 1)") == 1
    assert f"data: the skipped files are listed in {out / 'skipped_files.txt'}" in err
    assert (out / "skipped_files.txt").read_text().startswith(str(tmp_path / "imgs" / "a" / "bad.png"))


def test_a_runs_model_folder_and_checkpoints_are_evaluated_as_the_run(tmp_path, capsys):
    """RUN, RUN/model and RUN/checkpoints/X.pt all take the run's data without --data (evaluate.loading.run_of, the
    rule inspect and predict's calibration use too); a checkpoint's report goes beside the run's, not over it."""
    from vitlab.train import resolve_config, train
    from vitlab.train.checkpoint import CheckpointManager

    cfg = resolve_config("small-data", overrides=dict(
        data="bundled", classes=CLASSES.split(","), per_class=10, steps=2, batch_size=6, out_dir=str(tmp_path),
        name="run", model="custom", model_args=dict(dim=16, depth=1, heads=2, mlp_dim=32, patch_size=7),
        precision="fp32", quiet=True))
    run = train(cfg).run_dir
    step = CheckpointManager(run / "checkpoints").latest()
    for spec, folder in ((run, "eval-test"), (run / "model", "eval-test"), (step, f"eval-{step.stem}-test")):
        shutil.rmtree(run / folder, ignore_errors=True)
        assert main(["evaluate", str(spec), "--quiet"]) == 0, spec
        m = _metrics(run / folder)
        assert np.array(m["head"]["confusion_matrix"]).shape == (3, 3) and m["head_mode"] == "trained", spec
    # other data than the run's: a folder of its own, not over the run's own report
    before = (run / "eval-test" / "metrics.json").read_text()
    assert main(["evaluate", str(run), "--data", "digits", "--quiet"]) == 0
    assert (run / "eval-digits-test" / "metrics.json").is_file()
    assert (run / "eval-test" / "metrics.json").read_text() == before
    capsys.readouterr()


def test_frozen_rows_show_the_images_and_k_really_used(tmp_path, capsys):
    """3 training images per class: the 5-shot row claimed 15 images and kNN said k=20 while using 9."""
    out = tmp_path / "ev"
    spec = "custom(dim=32,depth=1,heads=2,mlp_dim=64,patch_size=7)"
    assert main(["evaluate", spec, "--data", "bundled", "--classes", CLASSES, "--per-class", "3", "--out", str(out),
                 "--quiet", "--fewshot", "--shots", "1,5", "--fewshot-seeds", "1", "--knn"]) == 0
    rows = {r["method"]: r for r in _metrics(out)["rows"]}
    assert rows["fewshot-1"]["train_images"] == 3 and "incomplete" not in rows["fewshot-1"]["label"]
    assert rows["fewshot-5"]["train_images"] == 9 and "(frozen; incomplete)" in rows["fewshot-5"]["label"]
    assert rows["knn"]["label"].startswith("kNN k=9 ") and "asked for k=20" in rows["knn"]["note"]
    assert _metrics(out)["knn"]["k"] == 9 and _metrics(out)["knn"]["k_asked"] == 20
    capsys.readouterr()


def test_a_model_name_is_built_at_the_smallest_size_its_grid_takes():
    """fit_image_size gave up on a spec whose default 224 px does not fit its own stride (patch_size=5) and
    returned the data's side unfitted; the model then failed to build."""
    from vitlab.errors import VitlabError
    from vitlab.evaluate.loading import fit_image_size

    assert fit_image_size("vit-b/16", 28) == 32 and fit_image_size("resnet-18", 28) == 28
    assert fit_image_size("custom(dim=16,depth=1,heads=2,patch_size=5)", 28) == 30
    with pytest.raises(VitlabError, match="not divisible by heads"):  # another field: said as such
        fit_image_size("custom(dim=15,depth=1,heads=2,patch_size=5)", 28)


def test_a_run_evaluated_on_its_own_data_named_again_keeps_its_splits(tmp_path, capsys, monkeypatch):
    """`vitlab evaluate RUN --data <the run's source>` used seed 0 and the default fractions, not the run's: on
    data whose test split is carved, 6 of 8 test images were the run's training images."""
    from vitlab.train import resolve_config, train

    cfg = resolve_config("small-data", overrides=dict(
        data="digits", seed=7, steps=2, batch_size=8, out_dir=str(tmp_path), name="run", model="custom",
        model_args=dict(dim=16, depth=1, heads=2, mlp_dim=32, patch_size=2, image_size=8), precision="fp32",
        quiet=True))
    run = train(cfg).run_dir
    import vitlab.data

    seen = []
    real = vitlab.data.load_data
    monkeypatch.setattr(vitlab.data, "load_data", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    capsys.readouterr()
    assert main(["evaluate", str(run), "--data", "digits", "--out", str(tmp_path / "ev")]) == 0
    assert "is the run's own data: its split settings" in capsys.readouterr().err
    assert main(["evaluate", str(run), "--out", str(tmp_path / "ev"), "--quiet"]) == 0
    assert [kw["seed"] for kw in seen] == [7, 7]


def test_the_runs_own_data_with_other_classes_gets_a_folder_of_its_own(tmp_path, capsys):
    """docs/evaluation.md's `vitlab evaluate runs/demo --data bundled --classes "Sandal,Sneaker,Ankle boot"`
    wrote its 3-class report to RUN/eval-test, over the run's own report on all its classes (as other data and
    int8 evaluations did before they got folders of their own)."""
    from vitlab.train import resolve_config, train

    cfg = resolve_config("small-data", overrides=dict(
        data="bundled", classes=CLASSES.split(","), per_class=10, steps=1, batch_size=6, out_dir=str(tmp_path),
        name="run", model="custom", model_args=dict(dim=16, depth=1, heads=2, mlp_dim=32, patch_size=7),
        precision="fp32", quiet=True))
    run = train(cfg).run_dir
    assert main(["evaluate", str(run), "--quiet", "--engine", "torch"]) == 0
    before = (run / "eval-test" / "metrics.json").read_text()
    two = "Sandal,Sneaker"
    assert main(["evaluate", str(run), "--data", "bundled", "--classes", two, "--quiet", "--engine", "torch"]) == 0
    assert (run / "eval-test" / "metrics.json").read_text() == before
    sub = run / "eval-bundled-classes-Sandal-Sneaker-test"
    assert np.array(_metrics(sub)["head"]["confusion_matrix"]).shape == (2, 2)
    # the run's own classes, named again or by --data alone, and its own seed are still the run's report
    assert main(["evaluate", str(run), "--data", "bundled", "--classes", CLASSES, "--seed", "0", "--quiet",
                 "--engine", "torch"]) == 0
    assert sorted(p.name for p in run.glob("eval-*")) == ["eval-bundled-classes-Sandal-Sneaker-test", "eval-test"]
    assert main(["evaluate", str(run), "--per-class", "3", "--seed", "2", "--quiet", "--engine", "torch"]) == 0
    assert (run / "eval-bundled-per-class-3-seed-2-test" / "metrics.json").is_file()
    capsys.readouterr()
