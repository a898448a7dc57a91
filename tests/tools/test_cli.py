"""The ``fusedce`` command imports only the subcommand it runs: ``fusedce --version`` and ``fusedce
inspect --help`` import neither the bench nor the fine-tune code, nor matplotlib / transformers (each
subcommand used to be imported up front to build the parser: 13-15 s on a busy 2-core machine).
Checked in a fresh interpreter per command, from ``sys.modules`` after the command ran."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fusedce.tools import cli

PROBE = """
import json, sys
from fusedce.tools.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("fusedce.tools", "matplotlib", "transformers")))),
      file=sys.stderr)
"""
HEAVY = ("fusedce.tools.bench", "fusedce.tools.finetune", "matplotlib", "transformers")


def _imported(argv) -> tuple:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True,
                          timeout=300)
    return proc.stdout, json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--version"], ["inspect", "--help"], ["--help"]])
def test_a_command_imports_only_its_subcommand(argv):
    out, modules = _imported(argv)
    assert "fusedce" in out   # the version line or the help text was printed
    assert [m for m in modules if m.startswith(HEAVY)] == []
    if argv[0] == "inspect":
        assert "fusedce.tools.inspect.report" in modules and "--every-variant" in out
    else:
        assert [m for m in modules if m.startswith("fusedce.tools.inspect")] == []


def test_bench_help_lists_its_arguments():
    out, modules = _imported(["bench", "--help"])
    assert "--shapes" in out and "fusedce.tools.bench.command" in modules
    assert [m for m in modules if m.startswith(("fusedce.tools.finetune", "fusedce.tools.inspect"))] == []


def test_the_listed_help_is_the_subcommand_help():
    """``fusedce --help`` lists each subcommand with the one line its module declares."""
    import importlib
    for name, (module_name, help_line) in cli.COMMANDS.items():
        assert importlib.import_module(module_name).HELP == help_line, name


def _subparser(command: str):
    parser = cli.build_parser(command)
    return next(a for a in parser._actions if a.dest == "command").choices[command]


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_option_says_what_it_does_and_its_default_in_plain_text(command):
    """Issue 47 item 8: ``inspect --help`` printed reStructuredText backticks, ``finetune --seed`` had no
    help and ``bench --device`` no default shown."""
    import argparse
    sub = _subparser(command)
    text = sub.format_help()
    assert "``" not in text and ":func:" not in text, command
    formatter = sub._get_formatter()
    for action in sub._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, (command, action.option_strings, "no help")
        if action.default not in (None, argparse.SUPPRESS):
            assert "default" in formatter._get_help_string(action), (command, action.option_strings)


def test_inspect_says_how_long_and_how_to_narrow_it():
    text = _subparser("inspect").format_help()
    assert "--all" in text and "under a minute" in text and "about 10 min" in text


def test_inspect_without_options_compiles_a_quick_set():
    """Issue 47 item 8: a bare ``fusedce inspect`` compiled every kernel's representative variants at five
    vocabularies for two archs (636 s, 2,973 lines); now sm_90, one vocabulary, each kernel's first variant,
    and ``--all`` the full set. Explicit options keep their meaning."""
    from fusedce.tools.inspect import report, variants
    parse = _subparser("inspect").parse_args
    quick = report.selection(parse([]))
    assert quick == {"archs": (90,), "vocabs": (128256,), "variants": None, "first": True}
    full = report.selection(parse(["--all"]))
    assert full == {"archs": variants.ARCHS, "vocabs": variants.DEFAULT_VOCABS, "variants": None, "first": False}
    chosen = report.selection(parse(["--arch", "100", "--variant", "all"]))
    assert chosen["archs"] == (100,) and chosen["variants"] == ["all"] and not chosen["first"]
    assert not report.selection(parse(["--every-variant"]))["first"]
    # the quick set: one configuration per kernel and dtype (32 table rows, not ~1,500)
    per_kernel = [list(variants.VARIANTS[k])[:1] for k in variants.ALL_KERNELS]
    assert all(len(names) == 1 for names in per_kernel) and len(per_kernel) * len(variants.DTYPES) == 32


@pytest.mark.parametrize("value", ["-5", "0", "x"])
def test_inspect_refuses_a_vocabulary_below_one(value, capsys):
    """A fresh user's ``--vocab -5`` ended in a traceback from the launch builder and ``--vocab 0`` compiled and
    reported a false "not 128-bit" problem: argparse now names the option."""
    with pytest.raises(SystemExit):
        _subparser("inspect").parse_args(["--vocab", value])
    assert "argument --vocab: V must be" in capsys.readouterr().err
