"""Usage mistakes on the command line: each gets one line from the sub-command's own parser, with a hint where
one helps, and no option is taken for another (abbreviations are off). Every command line the README and docs/
show parses."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from vitlab.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def usage_error(argv: list[str], capsys) -> str:
    """The one stderr line of a usage error (exit code 2)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("argv, command, hint", [
    (["predict", "--weights", "w.npz", "img.png"], "vitlab predict",
     "vitlab predict takes WEIGHTS as an argument, without --weights: `vitlab predict [options] WEIGHTS IMAGES [IMAGES ...]`"),
    (["evaluate", "--model", "vit-ti/16", "--data", "digits"], "vitlab evaluate",
     "vitlab evaluate takes MODEL as an argument, without --model: `vitlab evaluate [options] MODEL`"),
    (["evaluate", "--weights=w.npz"], "vitlab evaluate",  # nothing left for MODEL: argparse's "required" error
     "vitlab evaluate takes MODEL as an argument, without --weights"),
    (["convert", "--src", "a.npz", "b"], "vitlab convert", "vitlab convert takes SRC as an argument, without --src"),
    (["train", "--epoch", "3"], "vitlab train", "did you mean --epochs?"),
    (["train", "--epo", "3"], "vitlab train", "did you mean --epochs?"),  # cut short: the one option it begins
    (["predict", "w", "img.png", "--top_k", "3"], "vitlab predict", "did you mean --top-k?"),
    (["finetune", "runs/x/model", "--data", "digits"], "vitlab finetune",  # the reverse of predict's WEIGHTS
     "unrecognized arguments: runs/x/model; vitlab finetune takes the weights as an option: --weights WEIGHTS"),
])
def test_a_mistaken_option_gets_its_hint_from_the_sub_command(argv, command, hint, capsys):
    line = usage_error(argv, capsys)
    assert line.startswith(f"{command}: error: ")
    assert hint in line
    assert line.endswith(f"see `{command} --help`")


def test_a_nested_sub_command_reports_its_own_name(capsys):
    line = usage_error(["data", "inspect", "digits", "--no-such-option"], capsys)
    assert line == ("vitlab data inspect: error: unrecognized arguments: --no-such-option; "
                    "see `vitlab data inspect --help`")


def test_no_weights_hint_where_the_weights_option_was_given(capsys):
    line = usage_error(["finetune", "--weights", "w", "--data", "digits", "extra"], capsys)
    assert line == "vitlab finetune: error: unrecognized arguments: extra; see `vitlab finetune --help`"


def test_no_unrelated_hint_for_an_option_like_no_other(capsys):
    line = usage_error(["train", "--zzz", "1"], capsys)
    assert line == "vitlab train: error: unrecognized arguments: --zzz 1; see `vitlab train --help`"


def test_an_option_is_never_taken_for_a_longer_one(capsys):
    # With argparse's abbreviations on, `--model vit-ti/16` was read as `--model-args vit-ti/16`.
    line = usage_error(["predict", "--model", "vit-ti/16", "w", "img.png"], capsys)
    assert "unrecognized arguments: --model" in line
    assert "without --model" in line
    args = build_parser().parse_args(["predict", "--model-args", "heads=3", "w", "img.png"])
    assert args.model_args == "heads=3"


# ----------------------------------------------------------------------------- documented command lines
def _code_lines(text: str):
    """The lines of shell code blocks: fenced (bash, sh, shell, console or no language) and indented."""
    fence, after_blank, indented = None, True, False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else (stripped[3:].strip() or "plain")
            continue
        if fence is not None:
            if fence in ("bash", "sh", "shell", "console", "plain"):
                yield line
            continue
        indented = line.startswith("    ") and (after_blank or indented) and not stripped.startswith(("-", "*", "|"))
        if indented:
            yield line
        after_blank = not stripped


def documented_command_lines() -> list[tuple[str, str]]:
    """(file, the arguments after `vitlab`) of each command line in the README's and docs' code blocks; lines
    with placeholders (`...`, `[--option]`, `<x>`) are left out, and so is output such as `vitlab serve: ...`."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        code = re.sub(r"\\\n\s*", " ", "\n".join(_code_lines(path.read_text())))
        for line in code.splitlines():
            match = re.match(r"(?:\$ )?(?:[A-Z_]+=\S+\s+)*(?:\S*/)?(?:vitlab|python -m vitlab|torchrun .*?-m vitlab) (.*)",
                             line.strip())
            if not match:
                continue
            arguments = re.split(r"\s(?:#|\||>|2>|&&|;)\s?", " " + match.group(1))[0].strip()
            if not arguments or arguments.split()[0].endswith(":") or re.search(r"\.\.\.|\[--|<", arguments):
                continue
            found.append((str(path.relative_to(ROOT)), arguments))
    return found


def test_the_docs_show_command_lines_to_check():
    assert len(documented_command_lines()) >= 50


@pytest.mark.parametrize("where, arguments", documented_command_lines())
def test_every_documented_command_line_parses(where, arguments):
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            _, extras = build_parser().parse_known_args(shlex.split(arguments))
    except SystemExit as exc:
        # placeholders the docs use for values (`--batch-size B`, `--format table|json|csv`) are fine
        placeholder = re.search(r"invalid (int|float) value|invalid choice: '[^']*\|", stderr.getvalue())
        assert not exc.code or placeholder, f"{where}: vitlab {arguments}: {stderr.getvalue().strip()}"
        return
    assert not extras, f"{where}: vitlab {arguments}: unrecognized {extras}"
