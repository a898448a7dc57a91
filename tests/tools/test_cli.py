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
