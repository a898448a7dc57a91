"""``fusedce bench``'s RL-precision table (``bench/rl_precision.py``, issue 29) at a tiny stand-in for the
real input file (64 tokens, H=16, V=300, a third of the rows ignored): fusedce's fp32 logits are within
fp32 rounding of float64 where the bf16 compositions are not, ``batch_invariant=True`` changes no bit in
any placement, and the command runs it in a fresh process and prints its table."""
from argparse import Namespace

import pytest
import torch
from rich.console import Console

from fusedce.tools.bench.names import path_name
from fusedce.tools.bench import command, rl_precision
from fusedce.tools.bench.report_rl import print_table

N, H, V = 64, 16, 300


@pytest.fixture()
def real_file(tmp_path):
    g = torch.Generator().manual_seed(3)
    target = torch.randint(0, V, (N,), generator=g)
    target[::3] = -100
    path = tmp_path / "real.pt"
    torch.save({"hidden": torch.randn(N, H, generator=g) * 2, "weight": torch.randn(V, H, generator=g),
                "target": target, "meta": {}}, path)
    return str(path)


def test_errors_and_placements(real_file):
    out = rl_precision.measure({"device": "cpu", "source_file": real_file, "tokens": N})
    assert out["status"] == "ok"
    rows = {r["path"]: r for r in out["results"]}
    assert set(rows) == set(rl_precision.PATHS)
    for name in ("stock-bf16", "fp32-head-copy", "fusedce", "fusedce-input"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["peak_bytes"] >= 0 and rows[name]["fwd_bwd_s"] > 0
    fused, stock = rows["fusedce"], rows["stock-bf16"]
    # fp32 logits of the bf16 values: fp32 rounding (~1e-6 nats at these magnitudes); bf16 logits ~1e-2
    assert fused["log_probs_max_abs_err"] < 1e-5 and fused["entropy_max_abs_err"] < 1e-5, fused
    assert stock["log_probs_max_abs_err"] > 100 * fused["log_probs_max_abs_err"], (stock, fused)
    assert rows["fusedce-input"]["log_probs_max_abs_err"] > 100 * fused["log_probs_max_abs_err"]
    assert rows["torch-lce"]["status"] in ("ok", "unavailable") and rows["torch-lce"]["entropy_max_abs_err"] is None
    assert out["placements"] == len(rl_precision.PLACEMENTS)
    assert out["placements_changed"]["fusedce batch_invariant=True"] == 0
    assert out["input"]["tokens"] == N and out["input"]["vocab_size"] == V
    console = Console(record=True, width=200)
    print_table(out, console)
    text = console.export_text()
    assert path_name("fusedce") in text and "batch invariance" in text


def test_trl_rows_ignore_nothing_they_should_not(real_file):
    """TRL's kernel has no ignore_index: its row is computed on valid classes and zeroed where ignored."""
    pytest.importorskip("trl")
    hidden, weight, target = rl_precision.load(real_file, N, "cpu")
    lp, ent = rl_precision.forward("trl-kernel", hidden, weight, target)
    assert bool((lp[target == -100] == 0).all()) and bool((ent[target == -100] == 0).all())
    ours = rl_precision.forward("fusedce-input", hidden, weight, target)
    assert float((lp - ours[0]).abs().max()) < 5e-2   # both round the logits to bf16 (other orders)


def test_command_runs_it_in_a_fresh_process(real_file):
    args = Namespace(no_rl_precision=False, device="cpu", timeout=600)
    console = Console(record=True, width=200)
    row = command._rl_precision(args, console, {"real": {"cache_file": real_file}})
    assert row["status"] == "ok", row.get("reason")
    assert row["placements_changed"]["fusedce batch_invariant=True"] == 0
    assert command._rl_precision(Namespace(no_rl_precision=True, device="cpu", timeout=600), console,
                                 {"real": {"cache_file": real_file}}) is None
    assert command._rl_precision(args, console, {}) is None   # synthetic shapes only: no table


def test_without_bf16_units_the_stock_placements_are_left_out_and_said(real_file, monkeypatch):
    """Issue 47 item 1: on an AVX2-only CPU the stock bf16 path's 12 placements (2,758 rows of emulated bf16
    forward+backward) took minutes of the main job; there they are not counted, and the table says so."""
    from fusedce.tools.bench import machine
    caps = {"amx": False, "avx512_bf16": False, "bf16_gemm_mode": False, "avx2": True, "avx512f": False}
    monkeypatch.setattr(machine, "cpu_capabilities", lambda: caps)
    _row, spec, _env = rl_precision.job(real_file, "cpu")
    assert spec["stock_placements"] is False
    out = rl_precision.measure({**spec, "tokens": N})
    assert path_name("stock-bf16") not in out["placements_changed"] and out["notes"]
    assert out["placements_changed"]["fusedce batch_invariant=True"] == 0
    console = Console(record=True, width=200)
    print_table(out, console)
    assert "stock bf16 placements not counted" in console.export_text()
    monkeypatch.setattr(machine, "cpu_capabilities", lambda: dict(caps, amx=True))
    assert rl_precision.job(real_file, "cpu")[1]["stock_placements"] is True


def _verl_folder():
    """verl's installed files: the main venv's (make install: --no-deps), else make test-verl's venv's."""
    from pathlib import Path
    from fusedce.tools.bench import rl_verl
    try:
        return rl_verl._verl_dir()
    except ImportError:
        found = sorted(Path(__file__).resolve().parents[2].glob(".cache/verl/venv/lib/python3*/site-packages/verl"))
        if not found:
            pytest.skip("verl's files are not installed (make install adds verl 0.9.1 with --no-deps)")
        return found[0]


def test_verl_kernels_and_top_p_rows(real_file, monkeypatch):
    """Issue 45 item 4: verl's torch backend (its module file loaded without importing verl) is off by its
    bf16 logits where fusedce is within fp32 rounding; verl's Triton kernel is reported unavailable on CPU
    with the reason; the top-p row is within fp32 rounding of float64 of the truncated distribution."""
    from fusedce.tools.bench import rl_verl
    folder = _verl_folder()
    monkeypatch.setattr(rl_verl, "_verl_dir", lambda: folder)
    monkeypatch.setattr(rl_verl, "_loaded", {})
    out = rl_precision.measure({"device": "cpu", "source_file": real_file, "tokens": N, "stock_placements": False})
    rows = {r["path"]: r for r in out["results"]}
    fused, theirs, top_p = rows["fusedce"], rows["verl-torch"], rows["fusedce-top-p"]
    assert theirs["status"] == "ok", theirs
    assert theirs["log_probs_max_abs_err"] > 100 * fused["log_probs_max_abs_err"], (theirs, fused)
    assert theirs["entropy_max_abs_err"] > 100 * fused["entropy_max_abs_err"], (theirs, fused)
    assert rows["verl-triton"]["status"] == "unavailable" and "CUDA" in rows["verl-triton"]["reason"]
    assert top_p["status"] == "ok", top_p
    assert top_p["log_probs_max_abs_err"] < 1e-5 and top_p["entropy_max_abs_err"] < 1e-5, top_p
    console = Console(record=True, width=240)
    print_table(out, console)
    assert path_name("verl-torch") in console.export_text()


def test_top_p_reference_keeps_the_contracts_set():
    """The bench's float64 top-p reference against the sort-free one of the tests (pairwise comparisons),
    ties included: the same kept sets, log-probs and entropy."""
    import truncated_reference64 as trunc64
    from fusedce.tools.bench import rl_top_p
    x = torch.randn(6, 40, dtype=torch.float64)
    x[2, :5] = x[2, 5]            # a tie group at the top
    x[3] = torch.linspace(-1, 1, 40, dtype=torch.float64)
    target = torch.randint(0, 40, (6,))
    lp, ent, _margin, _keep = rl_top_p.reference(x, target, 0.7)
    ref_lp, ref_ent = trunc64.reference(x, target, [0] * 6, [0.7] * 6)
    assert torch.equal(torch.isfinite(lp), torch.isfinite(ref_lp))
    finite = torch.isfinite(lp)
    torch.testing.assert_close(lp[finite], ref_lp[finite].detach())
    torch.testing.assert_close(ent, ref_ent.detach())
