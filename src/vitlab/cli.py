"""The `vitlab` command: parses arguments and hands over to the packages.

Each sub-command lives in its own module under `vitlab/commands/` and exposes
`register(subparsers)`, which adds its parser and sets `func(args) -> int | None`.

Every failure reaches the user as one line on stderr ("vitlab CMD: error: cause; fix") and a non-zero
exit. VITLAB_DEBUG=1 shows the libraries' warnings, and the traceback of an unexpected failure (an OSError or
any other exception vitlab did not raise itself) instead of its line; vitlab's own errors stay one line.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import pkgutil
import re
import sys
import warnings

import vitlab
from vitlab.errors import VitlabError

# The order sub-commands are listed in `vitlab --help`; modules not named here follow.
_ORDER = ["demo", "models", "data", "train", "finetune", "evaluate", "compare", "predict", "serve", "inspect", "convert", "export",
          "engines"]

# Unexpected messages longer than this are cut at a sentence end (the full text: VITLAB_DEBUG=1).
_MAX_MESSAGE = 300


_ARGV: list[str] = []  # the command line `main` parses, for the hints of `_OneLineParser.error`


class _ShowsDefaults:
    """Help lines end in "(default: X)" where an option has a default its help does not already state."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or default in (None, False, argparse.SUPPRESS) or default == []
                or action.option_strings == [] or isinstance(action, argparse._StoreConstAction)
                or text == argparse.SUPPRESS):
            return text
        shown = str(",".join(map(str, default)) if isinstance(default, (list, tuple)) else default).replace("%", "%%")
        return f"{text} (default: {shown})" if text else f"default: {shown}"


class _DefaultsFormatter(_ShowsDefaults, argparse.HelpFormatter):
    pass


class _RawDefaultsFormatter(_ShowsDefaults, argparse.RawDescriptionHelpFormatter):
    pass


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage (26 lines for `vitlab train`) before a usage error; one line
    naming the mistake and pointing at --help says the same. Sub-parsers inherit the class.

    Abbreviated options are off: with them `vitlab predict --model vit-b/16 ...` was read as `--model-args
    vit-b/16`, another option than the user meant, without a word. An unknown option gets a hint instead
    (`_hint`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        given = kwargs.get("formatter_class", argparse.HelpFormatter)
        kwargs["formatter_class"] = {argparse.HelpFormatter: _DefaultsFormatter,
                                     argparse.RawDescriptionHelpFormatter: _RawDefaultsFormatter}.get(given, given)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if message.startswith("the following arguments are required"):  # `--weights W` for a positional WEIGHTS
            # unknown options only: the bare words of the whole command line (the sub-command's name, option
            # values) are no leftover argument, and `vitlab compare --models a,b` is missing --data, not --weights
            message = _with_hint(self, message, _ARGV, bare=False)
        elif hint := _choice_hint(self, message):  # `vitlab modles`, `--format tabel`
            message = f"{message}; {hint}"
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def _command_modules() -> list[str]:
    import vitlab.commands as pkg

    found = [m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")]
    return sorted(found, key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n))


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="vitlab",
        description="The Vision Transformer of 'An Image is Worth 16x16 Words': build, load, train, evaluate, inspect.",
    )
    parser.add_argument("--version", action="version", version=f"vitlab {vitlab.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _command_modules():
        importlib.import_module(f"vitlab.commands.{name}").register(sub)
    return parser


def _innermost_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub-)sub-command that `args` chose: `vitlab data inspect`'s, not `vitlab`'s."""
    while True:
        chosen = [action.choices[getattr(args, action.dest)] for action in parser._actions
                  if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices]
        if not chosen:
            return parser
        parser = chosen[0]


# What people write as an option (timm's and Hugging Face's scripts take --model) for what a vitlab command takes
# as its first positional argument.
_WEIGHTS_OPTIONS = {"weights", "model", "checkpoint", "ckpt", "pretrained", "model_name"}


def _positional_usage(action: argparse.Action) -> str:
    name = action.metavar or action.dest.upper()
    return {"+": f"{name} [{name} ...]", "*": f"[{name} ...]", "?": f"[{name}]"}.get(action.nargs, name)


def _unknown_options(parser: argparse.ArgumentParser, tokens: list[str]) -> list[str]:
    """The options among `tokens` (`--name` or `--name=value`) that `parser` does not know, as written."""
    known = {o for a in parser._actions for o in a.option_strings}
    return [t.split("=", 1)[0] for t in tokens if t.startswith("-") and len(t) > 1 and t.split("=", 1)[0] not in known]


def _hint(parser: argparse.ArgumentParser, option: str) -> str:
    """How to say what an unknown option meant: a positional argument written as an option (`--weights W` where
    the command takes WEIGHTS as an argument), or a close spelling of a known option (--epoch, --top_k)."""
    name = option.lstrip("-").replace("-", "_")
    positionals = [a for a in parser._actions
                   if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
    for action in positionals:
        if name == action.dest or (action.dest in ("weights", "model") and name in _WEIGHTS_OPTIONS):
            usage = " ".join(_positional_usage(a) for a in positionals)
            return (f"{parser.prog} takes {action.metavar or action.dest.upper()} as an argument, without {option}: "
                    f"`{parser.prog} [options] {usage}`")
    known = {o.lstrip("-").replace("-", "_"): o for a in parser._actions for o in a.option_strings
             if o.startswith("--")}
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    if not close and len(name) >= 3:  # a cut-short name (--epo): the one option it begins, if only one
        close = [k for k in known if k.startswith(name)]
        close = close if len(close) == 1 else []
    return f"did you mean {known[close[0]]}?" if close else ""


def _choice_hint(parser: argparse.ArgumentParser, message: str) -> str:
    """'did you mean X?' for argparse's "argument NAME: invalid choice: 'VALUE'" where a choice is spelled close."""
    match = re.match(r"argument (\S+): invalid choice: '(.*?)'", message)
    if not match:
        return ""
    name, value = match.groups()
    choices = [str(c) for a in parser._actions if argparse._get_action_name(a) == name and a.choices
               for c in a.choices]
    close = difflib.get_close_matches(value.lower(), choices, n=1, cutoff=0.6)
    if not close and len(value) >= 3:  # cut short (`--engine onnx`): the one choice it begins, if only one
        close = [c for c in choices if c.startswith(value.lower())]
        close = close if len(close) == 1 else []
    return f"did you mean {close[0]!r}?" if close else ""


def _positional_hint(parser: argparse.ArgumentParser, tokens: list[str]) -> str:
    """Where a bare argument was left over and the command takes weights as an option (`vitlab finetune --weights
    W`, unlike predict's positional WEIGHTS): say so."""
    if not any(t and not t.startswith("-") for t in tokens):
        return ""
    for action in parser._actions:
        given = any(t.split("=", 1)[0] in action.option_strings for t in _ARGV)
        if action.dest == "weights" and action.option_strings and not given:
            option = max(action.option_strings, key=len)
            return f"{parser.prog} takes the weights as an option: {option} {action.metavar or 'WEIGHTS'}"
    return ""


def _with_hint(parser: argparse.ArgumentParser, message: str, tokens: list[str], bare: bool = True) -> str:
    """`message` and the hint for the first unknown option in `tokens` that has one (else, with `bare`, for a
    bare argument: `tokens` are the leftover arguments)."""
    hints = [h for h in (_hint(parser, o) for o in _unknown_options(parser, tokens)) if h]
    hints = hints or [h for h in (_positional_hint(parser, tokens) if bare else "",) if h]
    return f"{message}; {hints[0]}" if hints else message


def one_line(text: str, limit: int | None = None) -> str:
    """A message on one line: its lines joined; beyond `limit` characters cut after the last whole
    sentence (a half sentence can read as wrong advice), marked as cut."""
    flat = " ".join(line.strip() for line in str(text).splitlines() if line.strip())
    if limit is None or len(flat) <= limit:
        return flat
    end = max(flat.rfind(". ", 0, limit), flat.rfind("; ", 0, limit))
    if end > 0:
        return flat[: end + 1] + " [...]"
    return flat[:limit].rsplit(" ", 1)[0] + " [...]"


def _is_out_of_memory(exc: BaseException) -> bool:
    # torch's OutOfMemoryError is a RuntimeError; its CPU allocator raises a plain RuntimeError
    text = str(exc).lower()
    return (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
            or "out of memory" in text or "can't allocate memory" in text or "cannot allocate memory" in text)


def _memory_message(exc: BaseException) -> str:
    where = "the GPU" if ("cuda" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError") else "the machine (RAM)"
    return (f"{where} ran out of memory; use a smaller --batch-size (or --micro-batch), a smaller --image-size "
            "or a smaller model")


def _os_message(exc: OSError) -> str:
    """Permissions, a full disk, a file where a folder belongs, a dropped connection: the user's to fix."""
    what = exc.strerror or one_line(str(exc), _MAX_MESSAGE) or type(exc).__name__
    where = f": {exc.filename}" if exc.filename else ""
    if isinstance(exc, ConnectionError):
        return f"{what}{where}; check the network connection and try again"
    return f"{what}{where}; check the path, its permissions and the free disk space"


def _unexpected_message(exc: BaseException) -> str:
    text = one_line(str(exc), _MAX_MESSAGE)
    what = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"{what} (an unexpected failure: set VITLAB_DEBUG=1 for the traceback, and please report it)"


def _quiet_library_warnings() -> None:
    """Keep torch / numpy / matplotlib / PIL warnings off the screen. vitlab itself reports through
    one-line prints to stderr; a warning whose message starts with 'vitlab' is still shown."""
    if sys.warnoptions:  # the user chose with python -W / PYTHONWARNINGS
        return
    warnings.simplefilter("ignore")
    warnings.filterwarnings("default", message="vitlab")


def _run(args: argparse.Namespace, prog: str) -> int:
    """args.func(args); any failure becomes one line on stderr starting with `prog` (`vitlab data inspect`)."""
    try:
        return int(args.func(args) or 0)
    except VitlabError as exc:
        _say(f"{prog}: error: {one_line(str(exc))}")
        return 2
    except FileNotFoundError as exc:
        _say(f"{prog}: error: no such file or folder: {exc.filename or exc}; check the path")
        return 2
    except KeyboardInterrupt:
        _say(f"{prog}: interrupted")
        return 130
    except BrokenPipeError:  # `vitlab models | head`: the reader left early, which is no error
        _silence_stdout()
        return 0
    except Exception as exc:  # one line for users; VITLAB_DEBUG=1 shows the traceback
        if os.environ.get("VITLAB_DEBUG"):
            raise
        if _is_out_of_memory(exc):
            _say(f"{prog}: error: {_memory_message(exc)}")
            return 2
        if isinstance(exc, OSError):
            _say(f"{prog}: error: {_os_message(exc)}")
            return 2
        _say(f"{prog}: error: {_unexpected_message(exc)}")
        return 1


def _say(line: str) -> None:
    """`line` on stderr in one write: under torchrun every process reports the same failure into one pipe, and
    print's separate write of the newline let the two lines run together ("...recordsvitlab train: error: ...").
    The same line from the other processes of one torchrun on this machine is left out (`_first_to_say`)."""
    if not _first_to_say(line):
        return
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _first_to_say(line: str) -> bool:
    """False where another process of the same torchrun launch on this machine has already reported this very line:
    a wrong setting refused by every process printed it once per process. Each process claims a marker file named
    after the launch (torchrun's run id and its agent, the processes' parent) and the line; only the one that
    creates it prints. A line of its own (one process's failure) is always printed, as is any line outside
    torchrun or where the marker cannot be written."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) < 2:
        return True
    import hashlib
    import tempfile

    key = hashlib.sha256(f"{run_id}|{os.getppid()}|{line}".encode()).hexdigest()[:24]
    folder = os.path.join(tempfile.gettempdir(), "vitlab-torchrun-lines")
    try:
        os.makedirs(folder, exist_ok=True)
        os.close(os.open(os.path.join(folder, key), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except (OSError, ValueError):
        pass
    return True


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that Python's exit-time flush does not print a second BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is not a real file (tests capture it)
        pass


def main(argv: list[str] | None = None) -> int:
    debug = bool(os.environ.get("VITLAB_DEBUG"))
    with warnings.catch_warnings():  # the filters hold for this command only (main is also called in-process)
        if not debug:
            _quiet_library_warnings()
        parser = build_parser()
        _ARGV[:] = sys.argv[1:] if argv is None else list(argv)
        args, extras = parser.parse_known_args(argv)
        if extras:  # reported by the sub-command's own parser, which knows its options (`vitlab predict: ...`)
            command = _innermost_parser(parser, args)
            command.error(_with_hint(command, f"unrecognized arguments: {' '.join(extras)}", extras))
        if not getattr(args, "func", None):
            parser.print_help()
            return 0
        return _run(args, _innermost_parser(parser, args).prog)


if __name__ == "__main__":
    sys.exit(main())
