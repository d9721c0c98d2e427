"""Audit of the command line as a timm / Hugging Face user meets it: a mistyped command or choice gets a
suggestion, bad numbers are refused while the flags are read (never an empty table with exit code 0, never an
"unexpected failure"), `vitlab models PATTERN` filters like timm.list_models, and every option says what it does."""

import argparse
import subprocess
import sys

import pytest

from test_cli_usage import usage_error  # the one stderr line of a usage error (exit code 2)
from vitlab.cli import build_parser, main


# ----------------------------------------------------------------------------- typos in choices
@pytest.mark.parametrize("argv, prog, hint", [
    (["modles"], "vitlab", "did you mean 'models'?"),
    (["evalute", "w"], "vitlab", "did you mean 'evaluate'?"),
    (["models", "--format", "tabel"], "vitlab models", "did you mean 'table'?"),
    (["data", "inpsect", "digits"], "vitlab data", "did you mean 'inspect'?"),
    (["convert", "a", "b", "--to", "hff"], "vitlab convert", "did you mean 'hf'?"),
])
def test_a_mistyped_choice_gets_a_suggestion(argv, prog, hint, capsys):
    line = usage_error(argv, capsys)
    assert line.startswith(f"{prog}: error: ")
    assert hint in line
    assert line.endswith(f"see `{prog} --help`")


def test_no_suggestion_for_a_choice_like_no_other(capsys):
    line = usage_error(["zzzzzz"], capsys)
    assert "did you mean" not in line


# ----------------------------------------------------------------------------- vitlab models
@pytest.mark.parametrize("argv, flag", [
    (["models", "--image-size", "0"], "--image-size"),
    (["models", "--image-size", "-5"], "--image-size"),
    (["models", "--num-classes", "-1"], "--num-classes"),
])
def test_models_refuses_impossible_sizes(argv, flag, capsys):
    # before: an empty table, every model "left out: 224 is not a multiple of their stride", exit code 0
    line = usage_error(argv, capsys)
    assert f"argument {flag}" in line


def test_models_num_classes_zero_is_a_headless_model(capsys):
    assert main(["models", "--num-classes", "0", "vit-ti/16"]) == 0
    out = capsys.readouterr().out
    assert "vit-ti/16" in out and "5,524,416" in out  # 5,717,416 - (192 x 1000 + 1000)


def _names_in_table(out: str) -> list[str]:
    lines = out.splitlines()
    return [line.split()[0] for line in lines[1:] if line and not line.startswith(("GFLOPs", "resnet-N", "Use:"))]


def test_models_pattern_filters_like_timm_list_models(capsys):
    assert main(["models", "vit-b*"]) == 0
    names = _names_in_table(capsys.readouterr().out)
    assert names == ["vit-b/8", "vit-b/14", "vit-b/16", "vit-b/32", "vit-b/16-gap"]
    assert main(["models", "resnet-5*", "*r152*", "--format", "csv"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].startswith("name,")
    assert [r.split(",")[0] for r in rows[1:]] == ["resnet-50", "bit-r152x2", "bit-r152x4", "bit-r152x1-postact"]


def test_models_pattern_takes_the_peers_spelling_case_insensitively(capsys):
    assert main(["models", "ViT-S/16"]) == 0
    assert _names_in_table(capsys.readouterr().out) == ["vit-s/16"]


def test_models_pattern_filters_the_pretrained_table(capsys):
    assert main(["models", "--pretrained", "vit-s/16.*"]) == 0
    names = _names_in_table(capsys.readouterr().out)
    assert names and all(n.startswith("vit-s/16.") for n in names)


def test_models_pattern_that_matches_nothing_is_one_line_with_a_suggestion(capsys):
    assert main(["models", "vit-bb/16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("vitlab models: error: no model matches 'vit-bb/16'")
    assert "vit-b/16" in err[0]


def test_models_pattern_needs_no_torch():
    code = ("import sys, contextlib, io, vitlab.cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert vitlab.cli.main(['models', 'vit-*']) == 0\n"
            "    assert vitlab.cli.main(['models', '--pretrained', 'vit-*']) == 0\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


# ----------------------------------------------------------------------------- vitlab data
@pytest.mark.parametrize("argv, flag", [
    (["data", "inspect", "bundled", "--samples", "0"], "--samples"),
    (["data", "inspect", "bundled", "--samples", "-1"], "--samples"),
    (["data", "shard", "bundled", "out", "--storage-size", "-1"], "--storage-size"),
])
def test_data_refuses_impossible_counts_while_reading_flags(argv, flag, capsys, tmp_path, monkeypatch):
    # before: `--samples 0` ran the whole inspection, then "ValueError: Number of columns must be a positive
    # integer, not 0 (an unexpected failure ...)", exit code 1; `--storage-size -1` was accepted
    monkeypatch.chdir(tmp_path)
    line = usage_error(argv, capsys)
    assert f"argument {flag}" in line
    assert not any(tmp_path.iterdir())


def test_data_download_takes_quiet_and_out_like_the_other_commands(monkeypatch, tmp_path, capsys):
    import vitlab.data.download as download

    seen = {}

    def fake(name, root=None, progress=True, timeout=30.0):
        seen.update(name=name, root=root, progress=progress)
        return tmp_path

    monkeypatch.setattr(download, "download", fake)
    assert main(["data", "download", "mnist", "--out", str(tmp_path), "--quiet"]) == 0
    assert seen == {"name": "mnist", "root": str(tmp_path), "progress": False}
    assert main(["data", "download", "mnist", "--dir", str(tmp_path)]) == 0  # the old name still works
    assert seen == {"name": "mnist", "root": str(tmp_path), "progress": True}


# ----------------------------------------------------------------------------- help of every option
OWNED = ["demo", "models", "data", "compare", "inspect", "convert", "study"]


def _leaf_parsers(parser: argparse.ArgumentParser, prefix: list[str]):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(prefix), parser
        return
    for name, sub in subs[0].choices.items():
        yield from _leaf_parsers(sub, prefix + [name])


@pytest.mark.parametrize("command, parser", [
    (c, p) for c, p in _leaf_parsers(build_parser(), []) if c.split()[0] in OWNED])
def test_every_option_says_what_it_does(command, parser):
    silent = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert not silent, f"vitlab {command}: options without help: {silent}"


# ----------------------------------------------------------------------------- vitlab inspect
@pytest.mark.parametrize("argv, flag", [
    (["-n", "-1"], "-n/--num-images"),
    (["--rollout-images", "-1"], "--rollout-images"),
    (["--components", "0"], "--components"),
    (["--batch-size", "0"], "--batch-size"),
    (["--discard-ratio", "2"], "--discard-ratio"),
])
def test_inspect_names_the_one_flag_that_is_out_of_range(argv, flag, capsys):
    # before: "--num-images and --rollout-images must be >= 0, --batch-size and --components >= 1" for any of them
    line = usage_error(["inspect", "model-folder", *argv], capsys)
    assert f"argument {flag}:" in line


def test_models_pretrained_refuses_the_table_flags_it_would_ignore(capsys):
    """`vitlab models --pretrained --image-size 384` listed the checkpoints as if the flag were not there."""
    from vitlab.cli import main

    assert main(["models", "--pretrained", "--image-size", "384"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--image-size size the model table" in err[0]
    assert main(["models", "vit-ti*", "--format", "csv"]) == 0  # the table's defaults still apply
    out = capsys.readouterr().out
    assert "vit-ti/16" in out


def test_train_takes_val_fraction_as_a_flag(tmp_path):
    """The validation share was only `--set val_fraction=`, though compare and the studies have the flag."""
    import yaml

    from vitlab.cli import main

    assert main(["train", "--data", "bundled", "--steps", "1", "--batch-size", "8", "--val-fraction", "0.3",
                 "--model-args", "dim=16,depth=1,heads=2,mlp_dim=32,patch_size=7", "--out", str(tmp_path),
                 "--name", "v", "--quiet"]) == 0
    assert yaml.safe_load((tmp_path / "v" / "config.yaml").read_text())["val_fraction"] == 0.3
