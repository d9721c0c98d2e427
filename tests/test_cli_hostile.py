"""Hostile input to every sub-command: each failure is ONE line on stderr, a non-zero exit, and nothing
left behind (no run folder, no output folder). Also: unexpected exceptions, memory errors and the
libraries' warnings reach the user as one line or not at all (VITLAB_DEBUG=1 shows everything)."""

import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import vitlab.commands.models as models_command
from vitlab.cli import main, one_line
from vitlab.data.preprocess import Preprocess
from vitlab.errors import VitlabError
from vitlab.models.registry import create_model
from vitlab.weights import save_native

NAMES = ["apple", "banana", "cherry"]
TRAIN = ["--data", "bundled", "--out", "{tmp}/runs", "--quiet"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Tiny weights, an image and the config files the probes point at."""
    root = tmp_path_factory.mktemp("assets")
    model = create_model("custom", dim=32, depth=1, heads=4, mlp_dim=64, patch_size=4, image_size=16,
                         num_classes=len(NAMES), seed=0)
    save_native(model, root / "w", class_names=NAMES, preprocess=Preprocess(image_size=16))
    arr = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    Image.fromarray(arr).save(root / "img.png")
    (root / "empty.yaml").write_text("")
    (root / "comments.yaml").write_text("# nothing here\n")
    (root / "list.yaml").write_text("- lr: 0.001\n- epochs: 2\n")
    (root / "unknown.yaml").write_text("lr: 0.001\nlearning_rate: 0.01\n")
    (root / "broken.yaml").write_text("lr: [0.001,\n")
    (root / "badtype.yaml").write_text("lr: fast\n")
    return root


def _edited_weights(assets, tmp_path, name: str, edit) -> str:
    """A copy of the tiny weights whose config.json was changed by `edit(config)`."""
    folder = tmp_path / name
    folder.mkdir()
    config = json.loads((assets / "w" / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes((assets / "w" / "model.safetensors").read_bytes())
    return str(folder)


def run_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    """(exit code, stderr lines) of `vitlab ARGV`; argparse's usage errors exit through SystemExit."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()


# (test id, argv, a fragment the one line must contain). {tmp}: the test's folder, {a}: the assets.
PROBES = [
    # train: wrong types, out-of-range values, bad config files
    ("train-epochs-abc", ["train", "--epochs", "abc", *TRAIN], "invalid float value"),
    ("train-batch-0", ["train", "--batch-size", "0", *TRAIN], "batch_size must be >= 1"),
    ("train-micro-batch-0", ["train", "--micro-batch", "0", *TRAIN], "micro_batch must be >= 1"),
    ("train-eval-batch-0", ["train", "--eval-batch-size", "0", *TRAIN], "eval_batch_size must be >= 1"),
    ("train-set-lr-abc", ["train", "--set", "lr=abc", *TRAIN], "lr must be a finite number"),
    ("train-lr-nan", ["train", "--lr", "nan", *TRAIN], "lr must be a finite number"),
    ("train-lr-0", ["train", "--lr", "0", *TRAIN], "lr must be > 0"),
    ("train-set-unknown", ["train", "--set", "nosuchfield=1", *TRAIN], "unknown training setting 'nosuchfield'"),
    ("train-set-no-equals", ["train", "--set", "lr", *TRAIN], "--set expects KEY=VALUE"),
    ("train-set-betas-one", ["train", "--set", "betas=0.9", *TRAIN], "betas must be 2 numbers"),
    ("train-threads-0", ["train", "--threads", "0", *TRAIN], "threads must be >= 1"),
    ("train-model-args-abc", ["train", "--model-args", "dim=abc", *TRAIN], "model argument dim must be a whole number"),
    ("train-steps-negative", ["train", "--steps", "-3", *TRAIN], "steps must be >= 0"),
    ("train-epochs-negative", ["train", "--epochs", "-1", *TRAIN], "epochs must be >= 0"),
    ("train-no-length", ["train", "--epochs", "0", *TRAIN], "set epochs > 0 or steps > 0"),
    ("train-warmup-negative", ["train", "--warmup-steps", "-1", *TRAIN], "warmup_steps must be >= 0"),
    ("train-label-smoothing-1", ["train", "--label-smoothing", "1", *TRAIN], "label_smoothing must be in [0, 1)"),
    ("train-dropout-1", ["train", "--set", "dropout=1", *TRAIN], "dropout must be in [0, 1)"),
    ("train-erasing-2", ["train", "--random-erasing", "2", *TRAIN], "random_erasing must be in [0, 1]"),
    ("train-mixup-negative", ["train", "--mixup", "-1", *TRAIN], "mixup must be >= 0"),
    ("train-crop-scale", ["train", "--crop-scale", "0.8,0.5", *TRAIN], "crop_scale must be"),
    ("train-std-0", ["train", "--set", "std=0", *TRAIN], "std must be > 0"),
    ("train-hflip-3", ["train", "--set", "hflip=3", *TRAIN], "hflip must be true or false"),
    ("train-empty-config", ["train", "--config", "{a}/empty.yaml", *TRAIN], "holds no settings"),
    ("train-comment-config", ["train", "--config", "{a}/comments.yaml", *TRAIN], "holds no settings"),
    ("train-list-config", ["train", "--config", "{a}/list.yaml", *TRAIN], "must hold a mapping"),
    ("train-unknown-key-config", ["train", "--config", "{a}/unknown.yaml", *TRAIN],
     "unknown training setting 'learning_rate'"),
    ("train-broken-config", ["train", "--config", "{a}/broken.yaml", *TRAIN], "is not valid YAML"),
    ("train-badtype-config", ["train", "--config", "{a}/badtype.yaml", *TRAIN], "lr must be a finite number"),
    ("train-missing-config", ["train", "--config", "{tmp}/nothere.yaml", *TRAIN], "no such config file"),
    ("train-folder-config", ["train", "--config", "{a}", *TRAIN], "is a folder"),
    ("train-unknown-recipe", ["train", "--recipe", "nope", *TRAIN], "unknown recipe 'nope'"),
    ("train-missing-resume", ["train", "--resume", "{tmp}/nothere", *TRAIN], "does not exist"),
    ("train-with-weights", ["train", "--set", "weights={a}/w", *TRAIN], "vitlab finetune"),
    # finetune
    ("finetune-no-weights", ["finetune", *TRAIN], "needs --weights"),
    ("finetune-set-lr-abc", ["finetune", "--weights", "{a}/w", "--set", "lr=abc", *TRAIN], "lr must be"),
    ("finetune-batch-0", ["finetune", "--weights", "{a}/w", "--batch-size", "0", *TRAIN], "batch_size must be"),
    # evaluate
    ("evaluate-missing-run", ["evaluate", "{tmp}/runs/nothere"], "does not exist"),
    ("evaluate-missing-run-with-data", ["evaluate", "{tmp}/runs/nothere", "--data", "bundled"], "does not exist"),
    ("evaluate-batch-0", ["evaluate", "{a}/w", "--data", "bundled", "--batch-size", "0"], "--batch-size"),
    ("evaluate-fraction-1", ["evaluate", "{a}/w", "--data", "bundled", "--val-fraction", "1"], "--val-fraction"),
    ("evaluate-knn-k-0", ["evaluate", "{a}/w", "--data", "bundled", "--knn", "--knn-k", "0"], "--knn-k"),
    ("evaluate-bad-split", ["evaluate", "{a}/w", "--data", "bundled", "--split", "nope"], "invalid choice"),
    ("evaluate-model-args-abc", ["evaluate", "custom(dim=abc)", "--data", "bundled"],
     "model argument dim must be a whole number"),
    # predict
    ("predict-missing-weights", ["predict", "{tmp}/nothere", "{a}/img.png"], "no such file or folder"),
    ("predict-missing-image", ["predict", "{a}/w", "{tmp}/nothere.png"], "no such image"),
    ("predict-top-k-0", ["predict", "{a}/w", "{a}/img.png", "--top-k", "0"], "--top-k"),
    ("predict-batch-abc", ["predict", "{a}/w", "{a}/img.png", "--batch-size", "abc"], "invalid int value"),
    ("predict-no-arguments", ["predict"], "the following arguments are required"),
    # compare: checked before its output folder exists
    ("compare-epochs-negative", ["compare", "--data", "bundled", "--models", "custom", "--epochs", "-1",
                                 "--out", "{tmp}/cmp"], "argument --epochs: expected a number > 0, got -1"),
    ("compare-set-lr-abc", ["compare", "--data", "bundled", "--models", "custom", "--set", "lr=abc",
                            "--out", "{tmp}/cmp"], "lr must be a finite number"),
    ("compare-set-unknown", ["compare", "--data", "bundled", "--models", "custom", "--set", "nosuchfield=1",
                             "--out", "{tmp}/cmp"], "unknown training setting"),
    ("compare-batch-0", ["compare", "--data", "bundled", "--models", "custom", "--batch-size", "0",
                         "--out", "{tmp}/cmp"], "argument --batch-size: expected a whole number >= 1, got 0"),
    ("train-seed-huge", ["train", "--data", "bundled", "--seed", "99999999999999999999", "--out", "{tmp}/r"],
     "seed must be from 0 to 4294967295"),
    ("evaluate-seed-huge", ["evaluate", "custom", "--data", "bundled", "--seed", "99999999999999", "--out",
                            "{tmp}/ev"], "argument --seed: expected a seed from 0 to 4294967295"),
    # studies: checked before the study folder exists
    ("study-scaling-lr-0", ["study", "scaling", "--lr", "0", "--out", "{tmp}/st"],
     "argument --lr: expected a number > 0, got 0"),
    ("study-scaling-seeds-0", ["study", "scaling", "--seeds", "0", "--out", "{tmp}/st"], "--seeds"),
    ("study-scaling-val-0", ["study", "scaling", "--val-fraction", "0", "--out", "{tmp}/st"], "--val-fraction"),
    ("study-transfer-epochs", ["study", "transfer", "--pretrain-epochs", "-1", "--out", "{tmp}/st"],
     "argument --pretrain-epochs: expected a number > 0, got -1"),
    ("compare-epochs-0", ["compare", "--data", "bundled", "--models", "custom", "--epochs", "0",
                          "--out", "{tmp}/cmp"], "argument --epochs: expected a number > 0, got 0"),
    ("study-transfer-per-class-0", ["study", "transfer", "--per-class", "0", "--out", "{tmp}/st"], "--per-class"),
    # demo, inspect, export, data
    ("demo-threads-0", ["demo", "--threads", "0", "--out", "{tmp}/runs"], "threads must be >= 1"),
    ("demo-epochs-negative", ["demo", "--epochs", "-1", "--out", "{tmp}/runs"], "epochs must be >= 0"),
    ("inspect-missing-model", ["inspect", "{tmp}/nothere", "--out", "{tmp}/insp"], "no such file or folder"),
    ("export-missing-weights", ["export", "{tmp}/nothere", "{tmp}/x.onnx"], "no such file or folder"),
    ("data-inspect-missing", ["data", "inspect", "{tmp}/nothere", "--out", "{tmp}/di"], "nothere"),
    ("unknown-command", ["nosuchcommand"], "invalid choice"),
]


@pytest.mark.parametrize("argv,fragment", [p[1:] for p in PROBES], ids=[p[0] for p in PROBES])
def test_hostile_input_is_one_line_and_leaves_nothing(argv, fragment, assets, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # commands that write into the working folder would show up here too
    monkeypatch.delenv("VITLAB_DEBUG", raising=False)
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{a}", str(assets)) for a in argv]
    code, err = run_cli(argv, capsys)
    assert code != 0
    assert len(err) == 1, err
    assert fragment in err[0]
    assert err[0].startswith("vitlab")
    assert list(tmp_path.iterdir()) == []  # no run folder, no output folder, no report


def test_evaluate_unfinished_run_folder(tmp_path, capsys):
    """A run folder without model/ (interrupted) is named as such, not as an unknown format."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("lr: 0.001\n")
    code, err = run_cli(["evaluate", str(run), "--data", "bundled"], capsys)
    assert code == 2 and len(err) == 1 and "has no model/ yet" in err[0] and "--resume" in err[0]


def test_usage_errors_are_one_line_with_exit_code_2(capsys):
    code, err = run_cli(["train", "--epochs", "abc"], capsys)
    assert code == 2
    assert err == ["vitlab train: error: argument --epochs: invalid float value: 'abc'; see `vitlab train --help`"]


def test_help_still_works(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0 and "--batch-size" in capsys.readouterr().out


# ------------------------------------------------------------------ unexpected exceptions
@pytest.mark.parametrize("exc,expected", [
    (TypeError("unsupported operand type(s) for +: 'int' and 'str'"), "TypeError: unsupported operand"),
    (KeyError("image_size"), "KeyError: 'image_size'"),
    (ZeroDivisionError("division by zero"), "ZeroDivisionError: division by zero"),
    (AttributeError("'NoneType' object has no attribute 'config'"), "AttributeError: 'NoneType' object"),
    (AssertionError(), "AssertionError (an unexpected failure"),
    (RuntimeError("first line of a long dump:\n  detail one\n  detail two\n  detail three"),
     "RuntimeError: first line of a long dump: detail one detail two detail three"),
])
def test_unexpected_exceptions_are_one_line(exc, expected, monkeypatch, capsys):
    monkeypatch.delenv("VITLAB_DEBUG", raising=False)

    def broken(args):
        raise exc

    monkeypatch.setattr(models_command, "run", broken)
    code, err = run_cli(["models"], capsys)
    assert code == 1 and len(err) == 1
    assert err[0].startswith("vitlab models: error: ") and expected in err[0]
    assert "VITLAB_DEBUG=1" in err[0]


@pytest.mark.parametrize("exc,where", [
    (MemoryError(), "the machine (RAM) ran out of memory"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 1099511627776 bytes."), "the machine (RAM) ran out of memory"),
    (RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.15 GiB total capacity)\n"
                  "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF"),
     "the GPU ran out of memory"),
])
def test_out_of_memory_says_what_ran_out_and_what_to_shrink(exc, where, monkeypatch, capsys):
    monkeypatch.delenv("VITLAB_DEBUG", raising=False)

    def hungry(args):
        raise exc

    monkeypatch.setattr(models_command, "run", hungry)
    code, err = run_cli(["models"], capsys)
    assert code == 2 and len(err) == 1
    assert where in err[0] and "--batch-size" in err[0] and "--image-size" in err[0]


@pytest.mark.parametrize("exc,expected", [
    (PermissionError(13, "Permission denied", "/data/runs"), "Permission denied: /data/runs; check the path"),
    (OSError(28, "No space left on device"), "No space left on device; check the path, its permissions and the free"),
    (ConnectionResetError(104, "Connection reset by peer"), "Connection reset by peer; check the network"),
    (OSError(12, "Cannot allocate memory"), "the machine (RAM) ran out of memory"),
])
def test_os_errors_are_the_users_to_fix(exc, expected, monkeypatch, capsys):
    monkeypatch.delenv("VITLAB_DEBUG", raising=False)

    def failing(args):
        raise exc

    monkeypatch.setattr(models_command, "run", failing)
    code, err = run_cli(["models"], capsys)
    assert code == 2 and len(err) == 1 and expected in err[0]


def test_multi_line_vitlab_error_is_joined_not_cut(monkeypatch, capsys):
    def two_lines(args):
        raise VitlabError("the file is truncated\n(re-download it)")

    monkeypatch.setattr(models_command, "run", two_lines)
    code, err = run_cli(["models"], capsys)
    assert code == 2 and err == ["vitlab models: error: the file is truncated (re-download it)"]


def test_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("VITLAB_DEBUG", "1")

    def broken(args):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(models_command, "run", broken)
    with pytest.raises(ZeroDivisionError):
        main(["models"])


def test_one_line_cuts_long_messages_at_a_sentence_end():
    long = "The first sentence explains the cause. " + "Then a very long explanation follows " * 20
    cut = one_line(long, 120)
    assert cut == "The first sentence explains the cause. [...]"
    assert one_line("a\n  b\n\nc") == "a b c"
    words = one_line("x" * 50 + " " + "y" * 100, 80)
    assert words == "x" * 50 + " [...]"  # no sentence end: cut between words, marked


# ------------------------------------------------------------------ warnings
def test_library_warnings_are_hidden_vitlab_ones_shown(monkeypatch, capsys):
    seen: list[str] = []

    def noisy(args):
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn("TypedStorage is deprecated", UserWarning, stacklevel=2)
            warnings.warn("np.find_common_type is deprecated", DeprecationWarning, stacklevel=2)
            warnings.warn("vitlab models: a note of ours", UserWarning, stacklevel=2)
        seen.extend(str(w.message) for w in caught)

    monkeypatch.setattr(models_command, "run", noisy)
    monkeypatch.delenv("VITLAB_DEBUG", raising=False)
    assert run_cli(["models"], capsys)[0] == 0
    assert seen == ["vitlab models: a note of ours"]
    seen.clear()
    monkeypatch.setenv("VITLAB_DEBUG", "1")
    assert run_cli(["models"], capsys)[0] == 0
    assert "TypedStorage is deprecated" in seen and "vitlab models: a note of ours" in seen


# ------------------------------------------------------------------ non-finite results
def _nan_weights(assets, tmp_path) -> str:
    """The tiny weights with a NaN final-norm weight (so a fresh head is NaN too), written straight to the
    file as a corrupted download would be."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nan_weights"
    folder.mkdir()
    (folder / "config.json").write_text((assets / "w" / "config.json").read_text())
    tensors = load_file(str(assets / "w" / "model.safetensors"))
    tensors["norm.weight"] = torch.full_like(tensors["norm.weight"], float("nan"))
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("kind", ["nan-weights", "nan-layer-norm-eps"])
def test_predict_refuses_nan_logits(kind, assets, tmp_path, capsys):
    """NaN weights or layer_norm_eps NaN used to print 'nan%' and exit 0."""
    if kind == "nan-weights":
        broken = _nan_weights(assets, tmp_path)
    else:
        broken = _edited_weights(assets, tmp_path, "nan_eps", lambda c: c["model"].update(layer_norm_eps=float("nan")))
    try:
        code = main(["predict", broken, str(assets / "img.png"), "--quiet"])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "%" not in captured.out
    # refused here (non-finite logits) or already when the weights load
    assert "non-finite" in err[0] or "nan" in err[0].lower()


def test_predict_files_counts_non_finite_images(assets):
    from vitlab.predict import predict_files

    model = create_model("custom", dim=32, depth=1, heads=4, mlp_dim=64, patch_size=4, image_size=16,
                         num_classes=3, seed=0)
    with torch.no_grad():
        model.head.bias.fill_(float("nan"))
    with pytest.raises(VitlabError, match=r"non-finite logits \(NaN or inf\) for 2 of 2 images"):
        predict_files(model, {"preprocess": Preprocess(image_size=16)}, [assets / "img.png"] * 2, batch_size=1)


@pytest.mark.parametrize("edit,fragment", [
    (lambda c: c["preprocess"].update(std=[0.0, 0.5, 0.5]), "std"),
    (lambda c: c["preprocess"].update(mean=[float("nan")] * 3), "mean"),
    (lambda c: c["preprocess"].update(image_size=[0, 0]), "image_size"),
], ids=["std-0", "mean-nan", "image-size-0"])
def test_predict_refuses_broken_stored_preprocessing(edit, fragment, assets, tmp_path, capsys):
    broken = _edited_weights(assets, tmp_path, "broken_pre", edit)
    code, err = run_cli(["predict", broken, str(assets / "img.png")], capsys)
    assert code == 2 and len(err) == 1 and fragment in err[0]


def test_evaluate_refuses_nan_logits(tmp_path):
    from vitlab.data import load_data
    from vitlab.evaluate.runner import evaluate_model

    data = load_data("bundled", classes="Sandal,Sneaker,Ankle boot", per_class=5, progress=False)
    model = create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=7, image_size=28, in_chans=1,
                         num_classes=3, seed=0)
    with torch.no_grad():
        model.norm.weight.fill_(float("inf"))
    with pytest.raises(VitlabError, match="non-finite logits"):
        evaluate_model(model, data, Preprocess.for_model(28, channels=1), model_classes=list(data.class_names),
                       progress=False)


def test_evaluate_cli_refuses_nan_weights(assets, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    broken = _nan_weights(assets, tmp_path)
    code, err = run_cli(["evaluate", broken, "--data", "bundled", "--classes", "Sandal,Sneaker,Ankle boot",
                         "--per-class", "5", "--quiet", "--out", str(tmp_path / "ev")], capsys)
    assert code == 2 and len(err) == 1
    assert "non-finite" in err[0] or "nan" in err[0].lower()
    assert not (tmp_path / "ev").exists()  # no report of NaN numbers


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(std=0.0), "std"),
    (dict(std=(0.5, -0.1, 0.5)), "std"),
    (dict(mean=float("inf")), "mean"),
    (dict(image_size=0), "image_size"),
    (dict(image_size=100_000), "image_size"),
    (dict(image_size=16, resize=-3), "resize"),
    (dict(crop_fraction=float("nan")), "crop_fraction"),
    (dict(channels=2), "channels"),
    (dict(mean=(0.5, 0.5)), "mean/std"),
])
def test_preprocess_refuses_broken_records(kwargs, fragment):
    with pytest.raises(VitlabError, match=fragment):
        Preprocess(**kwargs)
    record = Preprocess(image_size=16).to_dict()
    record.update(kwargs)
    with pytest.raises(VitlabError):
        Preprocess.from_dict(record)


def test_torchrun_processes_report_one_refusal_once(monkeypatch, capsys):
    """Under torchrun every process refused the same wrong setting with the same line; on one machine it is printed
    once per launch. Another line, another launch, or no torchrun at all still prints."""
    import uuid

    bad = ["train", "--resume", "/nonexistent/run/checkpoints/step-0000003.pt"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", uuid.uuid4().hex)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert main(bad) == 2 and main(bad) == 2  # two processes of one launch (same parent)
    assert capsys.readouterr().err.count("vitlab train: error: ") == 1
    assert main(["train", "--resume", "/nonexistent/other/step-0000001.pt"]) == 2  # a line of its own
    assert capsys.readouterr().err.count("vitlab train: error: ") == 1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", uuid.uuid4().hex)  # the next launch
    assert main(bad) == 2
    assert capsys.readouterr().err.count("vitlab train: error: ") == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one process: nothing to share a line with
    assert main(bad) == 2 and main(bad) == 2
    assert capsys.readouterr().err.count("vitlab train: error: ") == 2


def test_an_error_line_is_one_write(monkeypatch):
    """Under torchrun every process reports the same failure into one pipe: print wrote the newline separately,
    and the processes' lines ran together ("...checkpoint filevitlab train: error: ...")."""
    import io
    import sys

    writes = []

    class Recorder(io.StringIO):
        def write(self, text):
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Recorder())
    assert main(["train", "--resume", "/nonexistent/run/checkpoints/step-0000003.pt"]) == 2
    (line,) = [w for w in writes if "error" in w]
    assert line.startswith("vitlab train: error: ") and line.endswith("\n") and line.count("\n") == 1
    assert "\n" not in writes  # no newline written on its own
