"""Audit 18 of `vitlab compare` and `vitlab study`: what a user of their own photos and of the studies meets."""

import json

import numpy as np
import pytest
import yaml
from PIL import Image

from vitlab.cli import main
from vitlab.models import create_model
from vitlab.weights import save_native


def _photos(root, per_class=10):
    """A folder of 3 classes of small PNG photos, no test/ folder: compare carves its test split from it."""
    rng = np.random.default_rng(0)
    for c, colour in enumerate(((200, 40, 40), (40, 200, 40), (40, 40, 200))):
        d = root / f"class{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            pixels = np.clip(rng.normal(colour, 30, size=(16, 16, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(d / f"{i}.png")
    return root


def _fake_run(root, data, seed):
    """A run folder as `vitlab train --data DATA --seed SEED` leaves it (config.yaml + model/), without training."""
    model = create_model("custom", num_classes=3, dim=16, depth=1, heads=2, mlp_dim=32, patch_size=8, image_size=16)
    save_native(model, root / "model", class_names=["class0", "class1", "class2"])
    (root / "config.yaml").write_text(yaml.safe_dump({"data": str(data), "seed": seed, "val_fraction": 0.1}))
    return root


def test_weights_of_a_run_that_trained_on_the_test_images_are_refused(tmp_path, capsys):
    """A run trained on the same photos split with another seed has some of compare's test images in its training
    split: its 'trained head' and fine-tuned rows were scored partly on images it had learnt, unsaid."""
    photos = _photos(tmp_path / "photos")
    run = _fake_run(tmp_path / "run", photos, seed=1)
    out = tmp_path / "cmp"
    args = ["compare", "--data", str(photos), "--models", "mine", "--weights", str(run), "--epochs", "1",
            "--batch-size", "4", "--out", str(out), "--quiet"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"its weights are the training run {run}, which trained on" in err
    assert "test images" in err and "give --seed 1 (the run's split)" in err
    assert not out.exists()  # refused before anything was written


def test_a_run_with_the_same_split_passes_the_check(tmp_path):
    """The same seed and fractions carve the same val/test images: nothing the run trained on is scored."""
    from vitlab.data import load_data
    from vitlab.experiments.compare import CompareSettings, check_runs_unseen, check_study, parse_models

    photos = _photos(tmp_path / "photos")
    run = _fake_run(tmp_path / "run", photos, seed=1)
    data = load_data(str(photos), seed=1, progress=False)
    models = parse_models("mine", str(run))
    st = CompareSettings(seed=1, batch_size=4)
    check_study(data, models, st)
    check_runs_unseen(data, models, st, {"data": str(photos), "val_fraction": 0.1, "test_fraction": 0.1})
    # and the seed-0 study of the same data is refused by the function itself too (API callers)
    data0 = load_data(str(photos), seed=0, progress=False)
    from vitlab.errors import VitlabError

    with pytest.raises(VitlabError, match="trained on"):
        check_runs_unseen(data0, models, CompareSettings(seed=0, batch_size=4), {"data": str(photos)})


def _scaling_args(out):
    return ["study", "scaling", "--data", "bundled", "--models", "custom(dim=8,depth=1,heads=2,mlp_dim=16,patch_size=7)",
            "--sizes", "100", "--seeds", "1", "--min-steps", "3", "--batch-size", "50", "--evals", "1",
            "--threads", "1", "--out", str(out), "--quiet"]


def _accuracy_columns(study_md):
    """The rows of study.md without the seconds per run (a wall clock, other in every process)."""
    return [line.rsplit("|", 2)[0] for line in study_md.read_text().splitlines() if line.startswith("| custom")]


def test_a_scaling_row_cut_off_by_a_kill_is_made_again_on_resume(tmp_path, capsys):
    """scaling.json was written in place: a study killed while writing it left half a file, and every rerun stopped
    on it with 'JSONDecodeError ... an unexpected failure' instead of resuming."""
    out = tmp_path / "sc"
    assert main(_scaling_args(out)) == 0
    before = _accuracy_columns(out / "study.md")
    (done,) = (out / "runs").glob("*/scaling.json")
    done.write_text(done.read_text()[:60])  # what a kill in the middle of writing leaves
    capsys.readouterr()
    assert main(_scaling_args(out)) == 0, capsys.readouterr().err
    assert _accuracy_columns(out / "study.md") == before
    assert json.loads(done.read_text())["size"] == 100  # written whole again


def test_a_study_settings_record_that_does_not_read_is_one_line(tmp_path, capsys):
    out = tmp_path / "sc"
    out.mkdir()
    (out / "settings.json").write_text('{"data": "bund')
    assert main(_scaling_args(out)) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and "settings.json" in err and "unexpected failure" not in err


def test_a_class_too_small_for_a_test_image_is_said_to_be_unscored(tmp_path, capsys):
    """A class folder of 2 photos gives no test image (10 % of 2 rounds to 0): it was trained on, and the table's
    accuracy and macro-F1 said nothing about it, unsaid (compare.md listed it among the classes)."""
    photos = _photos(tmp_path / "photos", per_class=10)
    (tmp_path / "photos" / "rare").mkdir()
    for i in range(2):
        Image.new("RGB", (16, 16), (128, 128, 0)).save(tmp_path / "photos" / "rare" / f"{i}.png")
    out = tmp_path / "cmp"
    assert main(["compare", "--data", str(photos), "--models", "custom(dim=8,depth=1,heads=2,mlp_dim=16,patch_size=8)",
                 "--epochs", "1", "--batch-size", "8", "--threads", "1", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "not scored: rare (no test image" in printed
    md = (out / "compare.md").read_text()
    assert "rare (0 test)" in md and "**Not scored: rare**" in md and "class0 (1 test)" in md


def test_the_transfer_table_says_its_test_images_and_seed(tmp_path):
    """study.md named no test-set size (upstream or downstream) and no seed."""
    from vitlab.experiments.transfer import TransferSettings, collect, write_tables

    run = tmp_path / "pretrain" / "vit"
    model = create_model("custom", num_classes=7, dim=8, depth=1, heads=2, mlp_dim=16, patch_size=7, image_size=28,
                         in_chans=1)
    save_native(model, run / "model")
    (run / "summary.json").write_text(json.dumps({"parameters": 1223, "test_accuracy": 0.4, "wall_time_s": 1.0,
                                                  "test_metrics": {"n": 700}}))
    head = {"accuracy": 0.6, "macro_f1": 0.55, "accuracy_ci95": [0.5, 0.7]}
    summary = {"test_images": 300, "models": [{
        "model": "vit", "status": "ok", "fine_tuned": {"head": head}, "train_wall_time_s": 2.0,
        "zero_shot": {"rows": [{"method": "head", "label": "zero-shot (fresh head, chance)", "accuracy": 0.33,
                                "macro_f1": 0.2, "ci95_lo": 0.3, "ci95_hi": 0.4}]}}]}
    used = {"per_class": 5, "per_class_requested": 5, "train_images": 15, "batch": 15, "steps": 30}
    rows = collect({"vit": run}, {5: (summary, used)})
    md = write_tables(rows, TransferSettings(data="bundled", seed=3), tmp_path).read_text()
    assert "(upstream test accuracy on 700 images)" in md and "of those classes (300 images)" in md
    assert "One seed (3)" in md


def test_published_weights_missing_offline_name_the_weights_entry(tmp_path, monkeypatch, capsys):
    """`--models vit-b/16,resnet-50 --weights ViT-B_16.npz,-` offline: the error named "--models entry 'vit-b/16'",
    the label, not the --weights entry to fix."""
    monkeypatch.setenv("VITLAB_OFFLINE", "1")
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "cmp"
    assert main(["compare", "--data", "bundled", "--models", "vit-b/16,resnet-50", "--weights=ViT-B_16.npz,-",
                 "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--models entry 'vit-b/16' (its --weights 'ViT-B_16.npz'): VITLAB_OFFLINE=1 and ViT-B_16.npz" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_compare_says_what_each_zero_shot_label_means():
    """A run's own head ('trained head') stood in the 'zero-shot evaluation' column unexplained: compare.md
    explained the other three labels only. The --help said 'zero-shot evaluation' without saying it is chance
    without a class map."""
    from vitlab.cli import build_parser
    from vitlab.experiments.compare import _markdown

    summary = {"data": "photos: 3 classes", "class_names": ["a", "b", "c"], "settings": {"augment": False,
               "epochs": 1, "optimizer": "adamw", "lr": 1e-3, "decay": "constant", "warmup_steps": 0,
               "weight_decay": 0.0, "batch_size": 4, "seed": 0}, "train_images": 9, "test_images": 3, "models": []}
    md = "\n".join(_markdown(summary))
    assert "'trained head' = the model's own head, which already has these classes" in md and "not zero-shot" in md
    sub = next(a for a in build_parser()._actions if getattr(a, "choices", None) and "compare" in a.choices)
    text = " ".join(sub.choices["compare"].format_help().split())
    assert "without one a pretrained model gets a new random head and its row says 'fresh head, chance'" in text


TINY = "custom(dim=8,depth=1,heads=2,mlp_dim=16,patch_size=8)"


def test_a_compare_resumed_with_the_data_spelled_otherwise_is_reused(tmp_path, monkeypatch, capsys):
    """`--data photos` then `--data /abs/photos/` (or from another folder): one folder, refused as "made with other
    settings or data (data 'photos' -> '/abs/photos/')" and every model redone or the study stuck."""
    photos = _photos(tmp_path / "photos")
    monkeypatch.chdir(tmp_path)
    args = ["--models", TINY, "--epochs", "1", "--batch-size", "8", "--threads", "1", "--out", str(tmp_path / "cmp")]
    assert main(["compare", "--data", "photos", *args]) == 0
    capsys.readouterr()
    monkeypatch.chdir(tmp_path / "photos")  # another working folder, the absolute path with a trailing slash
    assert main(["compare", "--data", f"{photos}/", *args]) == 0, capsys.readouterr().err
    assert "finished earlier, reusing" in capsys.readouterr().out


def test_a_scaling_study_resumed_with_the_data_spelled_otherwise_goes_on(tmp_path, monkeypatch, capsys):
    _photos(tmp_path / "photos")
    monkeypatch.chdir(tmp_path)
    args = ["--models", TINY, "--sizes", "12", "--seeds", "1", "--min-steps", "2", "--batch-size", "4", "--evals", "1",
            "--threads", "1", "--out", str(tmp_path / "sc"), "--quiet"]
    assert main(["study", "scaling", "--data", "photos", *args]) == 0
    capsys.readouterr()
    monkeypatch.chdir(tmp_path / "photos")
    assert main(["study", "scaling", "--data", f"{tmp_path / 'photos'}/", *args]) == 0, capsys.readouterr().err
    assert "done before" in capsys.readouterr().out


def test_the_studies_figures_say_which_split_and_how_many_images(tmp_path, monkeypatch):
    """val_accuracy.png / val_loss.png and both studies' study.png said 'accuracy (%)' with no split size: a curve
    on 3 validation images and one on 3,000 look alike."""
    import matplotlib.figure

    labels = {}

    def savefig(fig, path, *args, **kwargs):
        labels[str(path).rsplit("/", 1)[-1]] = fig.axes[0].get_ylabel()

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    from vitlab.experiments import compare, scaling, transfer

    history = [{"epoch": e, "val_loss": 1.0 - e / 10, "val_acc": 0.5 + e / 10} for e in range(3)]
    compare._write_plots({"val_images": 300, "models": [{"model": "m", "status": "ok", "history": history,
                                                          "train_wall_time_s": 1.0}]}, tmp_path)
    assert labels["val_accuracy.png"] == "accuracy (%) on the 300 validation images"
    assert labels["val_loss.png"] == "cross-entropy on the 300 validation images"
    row = {"model": "m", "size": 100, "test_accuracy": 0.5, "test_accuracy_ci95": [0.4, 0.6]}
    scaling.plot_study([row], [dict(row, seed=0, test_n=1000)], tmp_path)
    assert labels["study.png"] == "test accuracy (%) on 1,000 test images"
    trow = {"model": "m", "per_class": 5, "finetuned_accuracy": 0.5, "finetuned_ci95": [0.4, 0.6], "test_images": 300}
    transfer.plot_study([trow], tmp_path)
    assert labels["study.png"] == "test accuracy (%) on 300 test images"


def test_compare_md_keeps_what_the_loader_said_about_the_data(tmp_path, capsys):
    """Copies of training photos in the test split, and skipped files, were said once on stderr while loading;
    compare.md, the record a reader keeps, presented the test accuracy as on unseen images."""
    import shutil

    photos = _photos(tmp_path / "photos", per_class=10)
    for i in range(10):  # every photo of class0 twice: some copies land in the test split, their twins in train
        shutil.copy(photos / "class0" / f"{i}.png", photos / "class0" / f"copy{i}.png")
    (photos / "empty").mkdir()
    out = tmp_path / "cmp"
    assert main(["compare", "--data", str(photos), "--models", TINY, "--epochs", "1", "--batch-size", "8",
                 "--threads", "1", "--out", str(out), "--quiet"]) == 0
    md = (out / "compare.md").read_text()
    assert "**Data notes** (from loading): data: skipped 1 file (empty class: 1)" in md
    assert "of the test split's" in md and "have the same pixels as a training image" in md


def test_weights_written_again_under_their_name_are_not_reused(tmp_path, capsys):
    """A compare resumed after its weights file was replaced (a run trained again, a new export under the same
    name) reused the old weights' rows as if they were the new ones'."""
    photos = _photos(tmp_path / "photos")

    def weights(seed):
        model = create_model("custom", num_classes=1000, dim=8, depth=1, heads=2, mlp_dim=16, patch_size=8,
                             image_size=16, seed=seed)
        save_native(model, tmp_path / "w")

    weights(1)
    args = ["compare", "--data", str(photos), "--models", "mine", "--weights", str(tmp_path / "w"), "--epochs", "1",
            "--batch-size", "8", "--threads", "1", "--out", str(tmp_path / "cmp"), "--quiet"]
    assert main(args) == 0
    result = tmp_path / "cmp" / "mine" / "result.json"
    made = result.stat().st_mtime_ns
    # unchanged weights, with the engines `vitlab predict` caches in the model folder: reused, not redone
    (tmp_path / "w" / "engines" / "abc").mkdir(parents=True)
    (tmp_path / "w" / "engines" / "abc" / "fp32.onnx").write_bytes(b"onnx")
    assert main(args) == 0 and result.stat().st_mtime_ns == made
    capsys.readouterr()
    weights(2)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "result.json was made with other settings or data (weights_sha256 " in err


def test_a_head_matched_only_by_its_size_says_so(tmp_path):
    """A state dict names no classes: a 3-output head on 3 classes was called 'trained head' (and fine-tuning
    started from it) with nothing saying that its classes were only assumed to be the data's, in order."""
    import torch

    photos = _photos(tmp_path / "photos")
    model = create_model("resnet-18-small", num_classes=3, base_width=4, image_size=16)
    torch.save(model.state_dict(), tmp_path / "other-task.pth")
    out = tmp_path / "cmp"
    assert main(["compare", "--data", str(photos), "--models", "other", "--weights", str(tmp_path / "other-task.pth"),
                 "--epochs", "1", "--batch-size", "8", "--threads", "1", "--out", str(out), "--quiet"]) == 0
    row = json.loads((out / "compare.json").read_text())["models"][0]
    assert row["zero_shot_label"] == "trained head (by class count: the weights name no classes)"
    assert row["history"][0]["evaluation"] == row["zero_shot_label"]  # the head fine-tuning started from


def test_a_vit_state_dict_can_be_compared_with_the_fields_it_cannot_tell(tmp_path, capsys):
    """A timm-style ViT state dict needs classifier= and heads= to load; the reader's advice was '--model-args
    classifier=token', a flag compare does not have, and a --models label's overrides were ignored: such weights
    could not be compared at all."""
    import torch

    photos = _photos(tmp_path / "photos")
    model = create_model("custom", num_classes=1000, dim=16, depth=1, heads=2, mlp_dim=32, patch_size=8, image_size=16)
    torch.save(model.state_dict(), tmp_path / "vit.pth")
    common = ["--weights", str(tmp_path / "vit.pth"), "--epochs", "1", "--batch-size", "8", "--threads", "1", "--quiet"]
    assert main(["compare", "--data", str(photos), "--models", "mine", *common, "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "write the --models entry as mine(classifier=token)" in err and "--model-args" not in err
    out = tmp_path / "b"
    assert main(["compare", "--data", str(photos), "--models", "mine(classifier=token,heads=2)", *common,
                 "--out", str(out)]) == 0, capsys.readouterr().err
    row = json.loads((out / "compare.json").read_text())["models"][0]
    assert row["status"] == "ok" and row["source"] == "pretrained"


def test_a_diverging_study_run_names_what_the_study_can_change(tmp_path, capsys):
    """The training's advice 'lower --lr, keep --grad-clip 1 or use --precision fp32' named two flags `vitlab study
    scaling` lacks, and the same command only resumed the run into the same NaN."""
    args = _scaling_args(tmp_path / "sc")
    args[args.index("--min-steps") + 1] = "5"
    assert main([*args, "--lr", "1e9"]) == 2
    err = capsys.readouterr().err
    assert "loss became nan" in err and "start it again with a lower --lr and a new --out" in err
    assert "--grad-clip" not in err and "--precision" not in err


def test_no_validation_split_gives_no_empty_curves(tmp_path, capsys):
    """--val-fraction 0: val_loss.png and val_accuracy.png were written with empty axes and advertised as 'curves
    from epoch 0' by the printed line and compare.md."""
    photos = _photos(tmp_path / "photos")
    out = tmp_path / "cmp"
    assert main(["compare", "--data", str(photos), "--models", TINY, "--val-fraction", "0", "--epochs", "1",
                 "--batch-size", "8", "--threads", "1", "--out", str(out), "--quiet"]) == 0
    assert "no validation split, so no curves" in capsys.readouterr().out
    assert not (out / "val_accuracy.png").exists() and not (out / "val_loss.png").exists()
    assert (out / "runtime.png").exists()
    assert "Figures: runtime.png (no validation split, so no curves)" in (out / "compare.md").read_text()


def test_the_epochs_column_gives_the_epochs_run(tmp_path):
    """--epochs 0.5 ran half an epoch (10 of 20 steps); the table's epochs column counted epoch records: 1."""
    out = tmp_path / "cmp"
    assert main(["compare", "--data", "bundled", "--per-class", "20", "--models", "custom(dim=8,depth=1,heads=2,"
                 "mlp_dim=16,patch_size=7)", "--epochs", "0.5", "--batch-size", "10", "--threads", "1",
                 "--out", str(out), "--quiet"]) == 0
    row = json.loads((out / "compare.json").read_text())["models"][0]
    assert row["epochs"] == 0.5 and row["history"][-1]["step"] == 10
    assert "| 200 | 0.50 |" in (out / "compare.md").read_text()  # train images, epochs


def test_the_weights_are_hashed_once_per_study(tmp_path, monkeypatch):
    """The digest was computed for the reuse check and again for the model's own record: a large checkpoint read
    whole twice per model."""
    from vitlab.experiments import compare

    calls = []
    real = compare.weights_digest
    monkeypatch.setattr(compare, "weights_digest", lambda path: calls.append(path) or real(path))
    photos = _photos(tmp_path / "photos")
    model = create_model("custom", num_classes=3, dim=8, depth=1, heads=2, mlp_dim=16, patch_size=8, image_size=16)
    save_native(model, tmp_path / "w", class_names=["class0", "class1", "class2"])
    assert main(["compare", "--data", str(photos), "--models", "mine", "--weights", str(tmp_path / "w"), "--epochs",
                 "1", "--batch-size", "8", "--threads", "1", "--out", str(tmp_path / "cmp"), "--quiet"]) == 0
    assert len(calls) == 1


def _swap_two_photos(photos):
    """Relabel two photos (one moved each way): every class and split keeps its size."""
    (photos / "class0" / "0.png").rename(photos / "class1" / "from0.png")
    (photos / "class1" / "0.png").rename(photos / "class0" / "from1.png")


def test_a_photo_moved_to_another_class_is_other_data_for_compare(tmp_path, capsys):
    """Fixing a mislabelled photo keeps every split's size: the data's summary was the same, and the rows made
    before the fix were reused beside new ones as if on the same data."""
    photos = _photos(tmp_path / "photos")
    args = ["compare", "--data", str(photos), "--models", TINY, "--epochs", "1", "--batch-size", "8", "--threads", "1",
            "--out", str(tmp_path / "cmp"), "--quiet"]
    assert main(args) == 0
    _swap_two_photos(photos)
    capsys.readouterr()
    assert main(args) == 2
    assert "made with other settings or data (files_and_labels_sha256 " in capsys.readouterr().err


def test_a_photo_moved_to_another_class_is_other_data_for_a_scaling_study(tmp_path, capsys):
    photos = _photos(tmp_path / "photos")
    args = ["study", "scaling", "--data", str(photos), "--models", TINY, "--sizes", "12", "--seeds", "1",
            "--min-steps", "2", "--batch-size", "4", "--evals", "1", "--threads", "1", "--out", str(tmp_path / "sc"),
            "--quiet"]
    assert main(args) == 0
    _swap_two_photos(photos)
    capsys.readouterr()
    assert main(args) == 2
    assert "holds a study made on other files of" in capsys.readouterr().err
