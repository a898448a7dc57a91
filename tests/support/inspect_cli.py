"""``fusedce inspect`` run without ``TRITON_INTERPRET`` (``tests/tools/test_inspect*.py``, ``tests/cute``).

This test process has ``TRITON_INTERPRET=1`` (its ``@triton.jit`` functions are interpreted, not compilable), so
the command runs in a child Python: one per test process, started at its first use and kept, which runs
``fusedce.tools.inspect.report.main(argv)`` for each call. The command's own memo (``report._CACHE``: one
compilation per specialization) then also spans the calls, and the torch / Triton / fusedce imports are paid
once; ``tests/tools/test_cli.py`` runs the command itself in fresh processes.
"""
import atexit
import json
import os
import subprocess
import sys

_SERVE = r"""
import contextlib, io, json, sys, traceback
from fusedce.tools.inspect.report import main
reply = sys.stdout
for line in sys.stdin:
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(json.loads(line))
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        err.write(traceback.format_exc())
        rc = 1
    reply.write(json.dumps({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}) + "\n")
    reply.flush()
"""
_child = None


def _server() -> subprocess.Popen:
    global _child
    if _child is None or _child.poll() is not None:
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUTE_DSL_ARCH")}
        _child = subprocess.Popen([sys.executable, "-c", _SERVE], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        atexit.register(_child.stdin.close)
    return _child


def inspect_command(*argv) -> tuple:
    """``(exit status, stdout, stderr)`` of ``fusedce inspect *argv``."""
    child = _server()
    child.stdin.write(json.dumps(list(argv)) + "\n")
    child.stdin.flush()
    line = child.stdout.readline()
    assert line, f"the inspect process ended (rc {child.wait()})"
    reply = json.loads(line)
    return reply["rc"], reply["stdout"], reply["stderr"]


def _inspect(tmp_path, *argv) -> list:
    out = tmp_path / "inspect.json"
    rc, stdout, stderr = inspect_command(*argv, "--json", str(out))
    assert rc == 0, stdout + stderr
    assert "configs," in stdout        # the table and its summary were printed
    return json.loads(out.read_text())["rows"]
