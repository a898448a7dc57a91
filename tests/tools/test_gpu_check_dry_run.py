"""``benchmarks/gpu_check.sh --dry-run`` starts and finishes on CPU (Triton interpreter, small shapes).

The real run needs a lent GPU; this keeps the script from rotting between such loans: every section
(parity, timing paths, CUDA-graph step, sync-debug hot path, the linear section's stock / chunked / tiled
paths and log-probs) runs its code with tiny inputs, and the summary table is printed last. The
``fusedce.tools.bench`` helpers the script is a driver over (the ``"random"`` source's direct logits, the
row-subset parity) are checked here too.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fusedce.tools.bench import inputs, parity
from versions import TORCH_LCE

ROOT = Path(__file__).resolve().parents[2]
# the linear section's peers -> whether they run on this machine's CPU (Liger, CCE and quack need a GPU)
PEERS = {"torch-lce": TORCH_LCE, "trl": importlib.util.find_spec("trl") is not None, "liger": False,
         "cce": False, "quack": False}


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
    for shape in ("32x96x1000", "32x40x520"):               # the linear section's summary rows
        for path in ("stock", "chunked", "tiled", "tiled-det"):
            assert any(line.split()[:2] == [shape, path] and " OK " in line for line in lines), (shape, path)
        for path in PEERS:                                  # the peers: measured or not, never in the verdict
            assert any(line.split()[:2] == [shape, path] for line in lines), (shape, path)
    report = json.loads(out.read_text())
    table = out.with_suffix(".md").read_text()              # the markdown tables, written beside the JSON
    assert "| 32x96x1000 | tiled-det |" in table and "log-probs+entropy stock" in table
    assert set(report["vocabs"]) == {"1000", "4112"} and report["cuda_graph"]["ok"]
    linear = report["linear"]
    assert linear["ok"] and set(linear["shapes"]) == {"32x96x1000", "32x40x520"}
    for shape in linear["shapes"].values():
        assert set(shape["paths"]) == {"stock", "chunked", "tiled", "tiled-det", *PEERS}
        assert all(m["ok"] and m["ms"] > 0 and m["parity"]["scored_rows"] > 0 for name, m in shape["paths"].items()
                   if name not in PEERS)
        for name, available in PEERS.items():
            m = shape["paths"][name]
            assert m["peer"]
            if available:       # installed here: measured on CPU like the others
                assert m["ms"] > 0 and m["parity"]["grad_rel_err"] < 2e-2, (name, m)
            else:               # missing, or its kernels need a GPU: a row that says so, outside the verdict
                assert "ms" not in m and ("unavailable" in m or "error" in m), (name, m)
        if TORCH_LCE:
            assert shape["paths"]["torch-lce"]["resolved"]["acc_policy"] == "accurate"   # CPU bf16's "auto"
    assert linear["determinism"]["ok"] and linear["determinism"]["tiled-det"]["bitwise_equal"]
    methods = linear["log_probs"]["methods"]
    assert set(methods) == {"chunked", "tiled", "stock"} and all(m["ok"] for m in methods.values())
    assert methods["tiled"]["grad_rel_diff_vs_chunked"] < 1e-2


def _logits_source(ignore_fraction):
    return {"kind": "random", "tokens": 64, "vocab": 300, "logit_std": 2.0, "ignore_fraction": ignore_fraction,
            "seed": 3, "draw": "device"}


def test_random_source_draws_logits_directly():
    data = inputs.build(_logits_source(0.25), ("logits",), torch.float32, "cpu")
    assert data.hidden is None and data.logits.shape == (64, 300) and data.logits.requires_grad
    assert 1.8 < float(data.logits.detach().std()) < 2.2
    assert int((data.target == -100).sum()) == 16
    assert torch.equal(inputs.build(_logits_source(0.25), (), torch.float32, "cpu").target, data.target)


def test_subset_rows_has_ignored_and_scored_rows():
    target = torch.arange(40)
    target[25] = -100                                   # the only ignored row, not on the even spread
    rows = parity.subset_rows(target, 4)
    assert rows.shape == (4,) and bool((target[rows] == -100).any()) and bool((target[rows] != -100).any())
    assert parity.subset_rows(target, None).shape == (40,)


def test_cross_entropy_rows_measures_torch_in_the_logits_dtype():
    data = inputs.build(_logits_source(0.25), ("logits",), torch.bfloat16, "cpu")
    logits, target = data.logits.detach(), data.target
    x = logits.clone().requires_grad_()
    row_loss = F.cross_entropy(x.float(), target, reduction="none")   # fp32 math: better than torch bf16
    row_loss.sum().backward()
    mean = F.cross_entropy(logits.float(), target)
    rows = parity.subset_rows(target, 16)
    good = parity.cross_entropy_rows(logits, target, row_loss.detach(), x.grad, rows, mean=mean)
    assert good["mean_rel_err_vs_fp32"] == 0.0 and good["loss_rel_err_vs_fp64"] < 1e-6
    assert good["torch_grad_err_vs_fp64"] > 0 and good["grad_err_ratio"] <= 1.0 and good["rows"] == 16
    bad = parity.cross_entropy_rows(logits, target, row_loss.detach(), x.grad * 1.5, rows)
    assert bad["grad_err_ratio"] > 4.0 and "mean_rel_err_vs_fp32" not in bad


def test_linear_token_log_probs_reference_is_exact_in_float64():
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(12, 8, generator=gen, dtype=torch.float64), torch.randn(50, 8, generator=gen,
                                                                                          dtype=torch.float64)
    target = torch.randint(0, 50, (12,), generator=gen)
    target[3] = -100
    logp = torch.log_softmax(hidden @ weight.T / 0.7, dim=-1)
    log_probs = logp.gather(1, target.clamp_min(0)[:, None]).squeeze(1).where(target != -100, 0.0)
    entropy = (-(logp.exp() * logp).sum(-1)).where(target != -100, 0.0)
    res = parity.linear_token_log_probs(hidden, weight, target, log_probs, entropy, temperature=0.7)
    assert res["log_probs_max_abs_err"] < 1e-12 and res["entropy_max_abs_err"] < 1e-12 and res["rows"] == 12
    off = parity.linear_token_log_probs(hidden, weight, target, log_probs + 0.1, None, temperature=0.7)
    assert abs(off["log_probs_max_abs_err"] - 0.1) < 1e-9 and off["entropy_max_abs_err"] is None


def test_gpu_check_without_torch_says_what_it_needs(tmp_path):
    """Issue 27 item 9: a Python without torch died with ``ModuleNotFoundError``; the script now says what
    it needs (a Python with torch: ``PYTHON=`` or ``make install``) and exits 2 before running anything."""
    bare = tmp_path / "python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S -I -c 'import sys; sys.modules[\"torch\"] = None; "
                    f"exec(sys.argv[1])' \"$2\"\n")
    bare.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=ROOT,
                          env=dict(os.environ, PYTHON=str(bare)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "has no torch" in proc.stderr and "PYTHON=" in proc.stderr and "make install" in proc.stderr


def test_a_peer_that_raises_is_its_own_row_and_never_a_fusedce_failure():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check_linear as linear
    assert set(PEERS) == set(linear.PEERS)
    missing = linear._failure("torch-lce", AttributeError("module 'torch.nn' has no attribute 'X'"))
    broken = linear._failure("liger", RuntimeError("triton: out of resources"))
    ours = linear._failure("tiled", ImportError("no triton"))     # fusedce's own path: always a failure
    assert missing["peer"] and "unavailable" in missing and "error" not in missing
    assert broken["peer"] and broken["error"].startswith("RuntimeError") and "unavailable" not in broken
    assert "peer" not in ours and ours["error"].startswith("ImportError")
    assert linear._why(broken).startswith("peer failed (not in the verdict)") and linear._why(ours).startswith("FAILED")
    good = dict(ok=True, ms=1.0)
    shapes = {"s": dict(paths={"stock": good, "chunked": good, "liger": dict(broken, peer=True),
                               "torch-lce": missing, "quack": dict(good, ok=False, peer=True)})}
    assert linear.verdict(dict(shapes=shapes, log_probs=None)) == (True, 0)
    shapes["s"]["paths"]["tiled"] = ours
    assert linear.verdict(dict(shapes=shapes, log_probs=None)) == (False, 0)


def test_gpu_check_without_a_gpu_stops_first(tmp_path):
    """A fresh user's run without a GPU compiled and printed the whole inspect table before saying that no
    CUDA device was there: the script now checks first (exit 2, pointing to --dry-run)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], cwd=ROOT,
                          env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "sees no CUDA device" in proc.stderr and "--dry-run" in proc.stderr and proc.stdout == ""


def test_a_hung_peer_ends_the_linear_section_after_saving(tmp_path):
    """The 2026-12-06 H100 run lost 7+ minutes to one peer (quack's CuTe linear in its JIT): a peer still
    running after ``PEER_LIMIT_S`` records itself as hung, saves through ``progress`` and exits the process
    (rc 3), so gpu_check.sh goes on; fusedce's own paths run before any peer (``run``'s two passes)."""
    code = f"""
import json, sys, time
sys.path.insert(0, {str(ROOT / 'benchmarks')!r})
import gpu_check_linear as g
g.PEER_LIMIT_S = 0.2
out = dict(paths={{}})
save = lambda: open({str(tmp_path / 'saved.json')!r}, 'w').write(json.dumps(out))
with g._PeerWatchdog("quack", 1000, save, out):
    time.sleep(30)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "still running after" in proc.stdout
    saved = json.loads((tmp_path / "saved.json").read_text())
    assert saved["paths"]["quack"]["error"].startswith("hung")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check_linear as linear   # the order: every own path before the first peer
    assert linear.OWN and not set(linear.OWN) & set(linear.PEERS)
