"""``benchmarks/gpu_check.sh --dry-run`` starts and finishes on CPU (Triton interpreter, small shapes).

The real run needs a lent GPU; this keeps the script from rotting between such loans: every section
(parity, timing paths, CUDA-graph step, sync-debug hot path) runs its code with tiny inputs, and the
summary table is printed last.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert any("DRY RUN" in line for line in lines)
    assert "overall OK" in lines[-1]                        # the summary is the last thing printed
    assert any(line.split()[:2] == ["1000", "fusedce"] for line in lines)
    assert out.exists()
