"""Audit 15: a newcomer's walk through the README and the compare / study / train / inspect guides. Each test pins
one defect that walk found: a wrong hint, a note dropped under --quiet, wording that misleads."""

import argparse

import numpy as np
import pytest
from PIL import Image
from tests.test_cli_usage import usage_error as _usage_error

from vitlab.cli import main
from vitlab.errors import VitlabError


def _png(path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(value)
    Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(path)


def _classes(root, per_class: int, classes=("a", "b")):
    """`per_class` random 8 px PNGs in each class folder of `root`; returns `root`."""
    for k, c in enumerate(classes):
        for i in range(per_class):
            _png(root / c / f"{i}.png", i + 100 * k)
    return root


def _tiny_vit(path, class_names):
    """A saved untrained 8 px ViT whose head has `class_names`."""
    from vitlab.models.registry import create_model
    from vitlab.weights import save_native

    vit = create_model("custom", dim=8, depth=1, heads=1, mlp_dim=16, patch_size=4, image_size=8,
                       num_classes=len(class_names), seed=0)
    save_native(vit, path, class_names=list(class_names))
    return path


def test_a_missing_required_option_gets_no_weights_hint(capsys):
    # `vitlab compare --models a,b` forgot --data; it said "vitlab compare takes the weights as an option:
    # --weights WEIGHTS", because the bare word `compare` itself counted as a leftover argument
    line = _usage_error(["compare", "--models", "a,b"], capsys)
    assert line == "vitlab compare: error: the following arguments are required: --data; see `vitlab compare --help`"
    line = _usage_error(["compare", "--data", "digits"], capsys)
    assert line == "vitlab compare: error: the following arguments are required: --models; see `vitlab compare --help`"
    # the hints that are right stay: an option for a positional argument, a leftover bare argument
    assert "takes MODEL as an argument, without --weights" in _usage_error(["evaluate", "--weights=w.npz"], capsys)
    assert "takes the weights as an option: --weights WEIGHTS" in _usage_error(
        ["finetune", "runs/x/model", "--data", "digits"], capsys)


def test_train_quiet_still_says_what_the_data_loader_left_out(tmp_path, capsys):
    # --quiet is "no progress bar"; it also dropped the data's notes: a file in no class folder not read, a
    # --per-class above a class's size, said by `vitlab train` without --quiet and by `vitlab data inspect`
    root = _classes(tmp_path / "photos", 10)
    _png(root / "stray.png", 999)
    code = main(["train", "--data", str(root), "--model", "custom", "--model-args",
                 "dim=8,depth=1,heads=1,mlp_dim=16,patch_size=4", "--image-size", "8", "--batch-size", "4",
                 "--steps", "1", "--per-class", "50", "--threads", "1", "--precision", "fp32", "--quiet",
                 "--out", str(tmp_path / "runs"), "--name", "r"])
    assert code == 0
    err = capsys.readouterr().err
    assert "1 image file directly in it, in no class folder, not read" in err
    assert "--per-class 50: fewer training images than that for a, b; kept all of them" in err


def test_evaluate_quiet_still_says_what_the_data_loader_left_out(tmp_path, capsys):
    # the same for `vitlab evaluate --quiet` (and compare, which loads through it): the stray file was left out
    # without a word

    root = _classes(tmp_path / "photos", 10)
    _png(root / "stray.png", 999)
    _tiny_vit(tmp_path / "vit", ["a", "b"])
    assert main(["evaluate", str(tmp_path / "vit"), "--data", str(root), "--engine", "torch", "--threads", "1",
                 "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err.count("1 image file directly in it, in no class folder, not read") == 1


def test_a_resumed_study_says_once_where_its_thread_count_comes_from():
    # printed as "(recorded by the study's first run; recorded in settings.json)": twice "recorded", and the
    # count is decided when the study starts, before any run
    from vitlab.runtime import study_threads

    count, why = study_threads(None, 3)
    assert count == 3
    assert why == "decided when the study started"
    assert f"({why}; recorded in settings.json)".count("recorded") == 1


def test_inspect_says_one_image_in_the_singular(tmp_path):
    # "-n 128: the test split of D has only 1 images, so 1 are used"
    from vitlab.commands.inspect import gather_images
    from vitlab.data.preprocess import Preprocess

    root = tmp_path / "d"
    for c in ("a", "b"):
        for i in range(4):
            _png(root / "train" / c / f"{i}.png", i + (0 if c == "a" else 100))
    _png(root / "test" / "a" / "t.png", 7)
    args = argparse.Namespace(images=None, num_images=5, data=str(root), split="test", seed=0, skip_bad=False)
    images, labels, settings, notes = gather_images(args, Preprocess.for_model(8, channels=3))
    assert len(images) == 1
    assert f"-n 5: the test split of {root} has only 1 image, so 1 is used" in notes


@pytest.mark.parametrize("typo, meant", [("vitt", "vit"), ("hybird", "hybrid")])
def test_a_study_model_typo_names_the_study_model(typo, meant):
    # `vitlab study scaling --models vit,vitt` answered "did you mean 'vit-ti/8' or ...": the registry's names,
    # not the study's own short names the --help lists
    from vitlab.experiments.transfer import model_config

    with pytest.raises(VitlabError) as exc:
        model_config(typo, 10, 28, 1)
    assert f"did you mean {meant!r}?" in str(exc.value)
    assert "the study's models (vit, hybrid, resnet, resnet26)" in str(exc.value)


def test_compare_refuses_a_registry_name_of_another_family_for_its_weights(tmp_path, capsys):
    # `--models resnet-50 --weights=VIT`: the row called a ViT-Ti 'resnet-50' (its parameter count the only sign),
    # as a --weights list in another order than --models would; a free label stays a label

    root = _classes(tmp_path / "photos", 10)
    _tiny_vit(tmp_path / "vit", ["a", "b"])
    code = main(["compare", "--data", str(root), "--models", "resnet-50,my-vit",
                 f"--weights={tmp_path / 'vit'},{tmp_path / 'vit'}", "--epochs", "1", "--batch-size", "4",
                 "--precision", "fp32", "--threads", "1", "--out", str(tmp_path / "cmp"), "--quiet"])
    captured = capsys.readouterr()
    assert code == 2
    assert "--models entry 'resnet-50' names a ResNet, but its --weights" in captured.err
    assert "hold a ViT (custom)" in captured.err
    assert "| my-vit | trained head |" in captured.out  # the label's row ran


def test_compare_refuses_data_without_a_test_split_before_any_model(tmp_path, capsys):
    # 3 images per class: --test-fraction 0.1 carves no test split. Each model failed "while evaluating zero-shot"
    # with advice to "choose --split" (compare has none), then the command crashed on len(None)
    root = _classes(tmp_path / "few", 3)
    out = tmp_path / "cmp"
    code = main(["compare", "--data", str(root), "--models", "custom(dim=8,depth=1,heads=1,mlp_dim=16,patch_size=4)",
                 "--epochs", "1", "--batch-size", "2", "--threads", "1", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == ["vitlab compare: error: the data has no test split (few: 2 classes, train 6 images, 3 channels): "
                   "too few images per class to carve one; add images, give a test/ folder beside train/, or raise "
                   "--test-fraction"]
    assert not out.exists()


def test_train_without_held_out_images_says_there_is_no_accuracy(tmp_path, capsys):
    # 3 images per class carve no validation or test split: the run ended without an accuracy line, without a
    # word why, and listed a confusion_matrix.png it had not written
    root = _classes(tmp_path / "few", 3)
    code = main(["train", "--data", str(root), "--model", "custom", "--model-args",
                 "dim=8,depth=1,heads=1,mlp_dim=16,patch_size=4", "--image-size", "8", "--batch-size", "2",
                 "--steps", "1", "--threads", "1", "--precision", "fp32", "--quiet",
                 "--out", str(tmp_path / "runs"), "--name", "r"])
    assert code == 0
    out = capsys.readouterr().out
    assert "vitlab: no accuracy: the data has no validation or test split to score" in out
    run_line = [line for line in out.splitlines() if line.startswith("vitlab: run folder: ")]
    assert run_line and "confusion_matrix.png" not in run_line[0] and "summary.json" in run_line[0]
    assert not (tmp_path / "runs" / "r" / "confusion_matrix.png").exists()


def test_compare_with_every_model_failed_does_not_speak_of_the_others(tmp_path, capsys):
    # "1 of 1 models failed: ...; the others are in OUT/compare.md": there were no others
    root = _classes(tmp_path / "photos", 10)
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    out = tmp_path / "cmp"
    code = main(["compare", "--data", str(root), "--models", "bad", f"--weights={tmp_path / 'junk.safetensors'}",
                 "--epochs", "1", "--batch-size", "4", "--threads", "1", "--out", str(out), "--quiet"])
    assert code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("vitlab compare: error: 1 of 1 model failed: bad (loading: ")
    assert "the others" not in last and f"their rows are in {out / 'compare.md'}" in last


def test_a_flag_value_cut_short_gets_the_choice_it_begins(capsys):
    # `--engine onnx` (ONNX Runtime's everyday name) got no hint: too short for a close spelling of 'onnxruntime'
    line = _usage_error(["predict", "w", "x.png", "--engine", "onnx"], capsys)
    assert line.endswith("did you mean 'onnxruntime'?; see `vitlab predict --help`")
    line = _usage_error(["predict", "w", "x.png", "--engine", "o"], capsys)  # several choices begin so: no guess
    assert "did you mean" not in line


def test_study_transfer_refuses_upstream_classes_smaller_than_a_batch_before_writing(tmp_path, capsys):
    # pre-training on 16 upstream images: train refused "use --batch-size 16 or less", a flag `vitlab study
    # transfer` does not have, after the study folder and its settings.json were written
    root = tmp_path / "four"
    for k, c in enumerate(("a", "b", "c", "d")):
        for i in range(10):
            _png(root / c / f"{i}.png", 100 * k + i)
    out = tmp_path / "study"
    code = main(["study", "transfer", "--data", str(root), "--upstream", "a,b", "--downstream", "c,d",
                 "--models", "vit", "--per-class", "2", "--threads", "1", "--out", str(out), "--quiet"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("vitlab study transfer: error: the upstream classes have 16 training images, fewer than one "
                       "pre-training batch (128); add images to them, or give more classes with --upstream")
    assert not out.exists()


def test_inspect_help_names_only_flags_inspect_has():
    # its --engine help said "with --device auto, onnxruntime, compiled, openvino and --int8 run on the CPU", and
    # inspect has no --int8 (`vitlab inspect --int8` is refused); --device said nothing of its default 'auto'
    from vitlab.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    inspect = sub.choices["inspect"]
    engine = next(a for a in inspect._actions if "--engine" in a.option_strings)
    device = next(a for a in inspect._actions if "--device" in a.option_strings)
    assert "--int8" not in engine.help and not any("--int8" in a.option_strings for a in inspect._actions)
    assert device.help.startswith("auto, cpu") and device.default == "auto"
    predict = sub.choices["predict"]  # the commands that have --int8 still say so
    assert "--int8" in next(a for a in predict._actions if "--engine" in a.option_strings).help


def test_compare_quiet_still_says_what_the_data_loader_left_out(tmp_path, capsys):
    # `vitlab compare --quiet` on train/ test/ and a mistyped tst/: the folder not read was never said
    root = tmp_path / "split"
    for part, n in (("train", 6), ("test", 2), ("tst", 2)):
        for c in ("a", "b"):
            for i in range(n):
                _png(root / part / c / f"{i}.png", i + (0 if c == "a" else 100))
    code = main(["compare", "--data", str(root), "--models", "custom(dim=8,depth=1,heads=1,mlp_dim=16,patch_size=4)",
                 "--epochs", "1", "--batch-size", "64", "--threads", "1", "--out", str(tmp_path / "cmp"), "--quiet"])
    assert code == 2  # the batch is refused once the data is loaded: enough to see what the load said
    err = capsys.readouterr().err
    assert f"data: {root}: tst/ not read: beside split folders only train/, val/ and test/" in err
    assert err.count("tst/ not read") == 1


def test_evaluate_refuses_one_class(tmp_path, capsys):
    # `vitlab evaluate MODEL --data oneclass/` reported "zero-shot (fresh head, chance) 100.00 %" (any head restricted
    # to one class is always right); train, compare and the studies refuse one class

    root = tmp_path / "one"
    for i in range(12):
        _png(root / "a" / f"{i}.png", i)
    _tiny_vit(tmp_path / "vit", ["a", "b"])
    assert main(["evaluate", str(tmp_path / "vit"), "--data", str(root), "--engine", "torch", "--quiet"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the data has 1 class (a)" in err[0], err


def test_evaluate_says_why_a_trained_model_got_a_fresh_head(tmp_path, capsys):
    # data classes a, b, boot on a model of classes a, b, c: "zero-shot (fresh head, chance)" with no word on why

    root = tmp_path / "photos"
    for k, c in enumerate(("a", "b", "boot")):
        for i in range(10):
            _png(root / c / f"{i}.png", i + 100 * k)
    _tiny_vit(tmp_path / "vit", ["a", "b", "c"])
    assert main(["evaluate", str(tmp_path / "vit"), "--data", str(root), "--engine", "torch", "--quiet",
                 "--out", str(tmp_path / "ev")]) == 0
    out = capsys.readouterr().out
    assert "fresh head" in out and "1 of the data's 3 classes are not among the model's class names ('boot')" in out


def test_inspect_summary_rounds_pixel_distances_it_shows():
    # "uniform 116.4922 px", "< 58.2461 px": more digits than a pixel distance means
    import numpy as np

    from vitlab.inspect.summary import distance_summary, summary_lines

    distance = np.array([[10.0, 30.0], [40.0, 60.0]])
    line = next(s for s in summary_lines({"distance": distance_summary(distance, 116.4922, 224)})
                if s.startswith("attention distance"))
    assert "(uniform 116.5 px)" in line and "(< " in line and "4922" not in line and "2461" not in line
