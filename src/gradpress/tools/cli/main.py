"""The ``gradpress`` command: argument parsing and dispatch to subcommands.

Each subcommand module exposes ``register(subparsers)`` (adds its parser and sets ``func``, a callable
``func(args) -> int``) so that new commands plug in with one line in :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["COMMANDS", "ArgumentParser", "build_parser", "main"]

#: Subcommand modules (of :mod:`gradpress.tools.cli`), in the order ``gradpress --help`` lists them. Imported
#: when the parser is built, not before: ``gradpress --version`` must not wait for torch.
COMMANDS = ("demo", "inspect", "bench", "check")


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` with one-line errors: ``gradpress demo: error: ... (see 'gradpress demo --help')``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> ArgumentParser:
    """The top-level parser with every subcommand registered."""
    from ... import __version__

    parser = ArgumentParser(
        prog="gradpress",
        description="Communication-efficient data-parallel training for PyTorch (PowerSGD as DDP hooks).",
    )
    parser.add_argument("--version", action="version", version=f"gradpress {__version__}")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__package__}.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gradpress`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status.

    Argument errors return 2 (with a one-line message on stderr); ``--help`` returns 0.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:  # answered before the subcommands (and torch) are imported
        from ... import __version__

        print(f"gradpress {__version__}")
        return 0
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help, --version and errors; report as a status
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_usage(sys.stderr)
        print("gradpress: error: choose a command, e.g. 'gradpress demo' (see 'gradpress --help')",
              file=sys.stderr)
        return 2
    args.argv = argv[argv.index(args.command) + 1:]  # the subcommand's own arguments, to record in reports
    try:
        return int(func(args))
    except KeyboardInterrupt:
        print("gradpress: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
