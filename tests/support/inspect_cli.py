"""``fusedce inspect`` run in a subprocess without ``TRITON_INTERPRET`` (``tests/tools/test_inspect*.py``)."""
import json
import os
import subprocess
import sys


def _inspect(tmp_path, *argv) -> list:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "inspect.json"
    proc = subprocess.run([sys.executable, "-m", "fusedce.tools.inspect", *argv, "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "configs," in proc.stdout        # the table and its summary were printed
    return json.loads(out.read_text())["rows"]
