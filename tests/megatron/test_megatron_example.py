"""examples/megatron_tp.py run as its docstring says (torchrun, 2 gloo ranks on CPU, TP = 2) with sequence
parallel and one multi-token-prediction depth, at tiny sizes: it finishes, the stock and patched models'
first-step losses agree to fp32 rounding, and the head measurement reports both runs for both ranks (on
0.16 / 0.17: it calls their ``_postprocess``; skipped from 0.18)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is installed by `make install` (the megatron extra)")

ROOT = Path(__file__).parents[2]


def test_example_sequence_parallel_mtp(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "megatron_tp.py"), "--steps", "2", "--vocab", "64", "--hidden", "16",
           "--layers", "1", "--seq", "8", "--batch", "2", "--head-vocab", "256", "--head-hidden", "16",
           "--head-tokens", "32", "--sequence-parallel", "--mtp", "1"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads((tmp_path / "results" / "megatron_tp.json").read_text())
    assert out["args"]["sequence_parallel"] and out["args"]["mtp"] == 1 and out["world"] == 2
    torch.testing.assert_close(torch.tensor(out["curves"]["fusedce"][0]), torch.tensor(out["curves"]["stock"][0]))
    from fusedce.integrations.megatron.version import check_megatron
    if check_megatron().output_processor:   # 0.18+: the example's head measurement is 0.16 / 0.17's
        assert out["head_memory_bytes_per_rank"] == [None, None]
    else:
        assert all(set(rank) >= {"stock", "fusedce"} for rank in out["head_memory_bytes_per_rank"])
