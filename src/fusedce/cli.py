"""The ``fusedce`` command: a thin dispatcher over subcommands.

Each subcommand is a module listed in ``COMMANDS`` that exposes ``HELP`` (one line), ``DESCRIPTION``,
``add_arguments(parser)`` and ``run(args) -> int`` (the exit status). Adding a subcommand is one entry.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

COMMANDS = {
    "bench": "fusedce.bench.command",
    "inspect": "fusedce.inspect.report",
    "finetune": "fusedce.finetune.command",
}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    parser = argparse.ArgumentParser(prog="fusedce", description="fused cross-entropy for LLM training")
    parser.add_argument("--version", action="version", version=f"fusedce {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(command)
        command.set_defaults(handler=module.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
