"""The `vitlab` command: parses arguments and hands over to the packages.

Each sub-command lives in its own module under `vitlab/commands/` and exposes
`register(subparsers)`, which adds its parser and sets `func(args) -> int | None`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

import vitlab
from vitlab.errors import VitlabError

# The order sub-commands are listed in `vitlab --help`; modules not named here follow.
_ORDER = ["demo", "models", "data", "train", "finetune", "evaluate", "compare", "predict", "inspect", "convert", "export"]


def _command_modules() -> list[str]:
    import vitlab.commands as pkg

    found = [m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")]
    return sorted(found, key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vitlab",
        description="The Vision Transformer of 'An Image is Worth 16x16 Words': build, load, train, evaluate, inspect.",
    )
    parser.add_argument("--version", action="version", version=f"vitlab {vitlab.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _command_modules():
        importlib.import_module(f"vitlab.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except VitlabError as exc:
        print(f"vitlab {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"vitlab {args.command}: error: no such file or folder: {exc.filename or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"vitlab {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one line for users; VITLAB_DEBUG=1 shows the traceback
        if os.environ.get("VITLAB_DEBUG"):
            raise
        print(f"vitlab {args.command}: error: {type(exc).__name__}: {exc} (set VITLAB_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
