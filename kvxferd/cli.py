"""The ``kvxferd`` command line: argparse subcommands, one module each in :mod:`kvxferd.commands`.

Add a command by writing ``kvxferd/commands/<name>.py`` (``add_parser`` and ``run``, see
:class:`kvxferd.commands.Command`) and one entry in :data:`COMMANDS`.

Exit statuses: what the command's ``run`` returns (0 ok, 1 refused or invalid request); 2 for
usage errors and for any :class:`~kvxferd.errors.KvxferdError` a command raises, printed as
``kvxferd: error: <message>`` on stderr, never as a traceback; 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvxferd import __version__
from kvxferd.commands import Command
from kvxferd.commands import bench as _bench
from kvxferd.commands import demo as _demo
from kvxferd.commands import plan as _plan
from kvxferd.commands import serve as _serve
from kvxferd.errors import KvxferdError

COMMANDS: tuple[Command, ...] = (_demo, _serve, _plan, _bench)
"""Every subcommand, in the order ``kvxferd --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvxferd",
        description="KV cache transfer daemon for disaggregated LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers).set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvxferd`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors: argparse already printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_usage(sys.stderr)
        print("kvxferd: error: a command is required (see kvxferd --help)", file=sys.stderr)
        return 2
    try:
        status: int = run(args)
    except KvxferdError as exc:
        print(f"kvxferd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvxferd plan ... | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return status
