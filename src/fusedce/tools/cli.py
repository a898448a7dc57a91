"""The ``fusedce`` command: a thin dispatcher over subcommands, importing only the one it runs."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from .help_format import DefaultsFormatter, plain

COMMANDS = {
    "bench": ("fusedce.tools.bench.command",
              "compare fused and stock cross-entropy: parity vs float64, time, peak memory"),
    "inspect": ("fusedce.tools.inspect.report",
                "static GPU report of the Triton kernels (registers, spills, smem, 128-bit loads), no GPU needed"),
    "finetune": ("fusedce.tools.finetune.command",
                 "fine-tune SmolLM2-135M on KJV text, stock vs patch_causal_lm: loss curves, time, memory"),
}


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (its arguments added), the others are listed."""
    from .. import __version__
    parser = argparse.ArgumentParser(prog="fusedce", description="fused cross-entropy for LLM training")
    parser.add_argument("--version", action="version", version=f"fusedce {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_line) in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_line)
            continue
        module = importlib.import_module(module_name)
        parser_ = sub.add_parser(name, help=module.HELP, description=plain(module.DESCRIPTION),
                                 formatter_class=DefaultsFormatter)
        module.add_arguments(parser_)
        for action in parser_._actions:   # a terminal shows no reStructuredText
            if action.help and action.help is not argparse.SUPPRESS:
                action.help = plain(action.help)
        parser_.set_defaults(handler=module.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)   # the first positional: the subcommand
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
