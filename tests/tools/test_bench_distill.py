"""``fusedce bench``'s distillation row (``bench/distill.py``) at a tiny shape standing in for the real
input file (48 tokens, H=16, V=300: not a power of two; a third of the rows ignored as SFT prompts):
its float64 reference equals the tests' formula oracle, each path's worker result (in process; two of them also
in fresh processes through the command's plumbing) agrees with it, and the table and JSON section render."""
from argparse import Namespace

import pytest
import torch
from rich.console import Console

from fusedce.tools.bench import command, distill, worker
from fusedce.tools.bench.report_distill import print_table
from reference64_distill import linear_distillation_loss64

N, H, V = 48, 16, 300


@pytest.fixture()
def real_file(tmp_path):
    g = torch.Generator().manual_seed(1)
    target = torch.randint(0, V, (N,), generator=g)
    target[::3] = -100
    path = tmp_path / "real.pt"
    torch.save({"hidden": torch.randn(N, H, generator=g), "weight": torch.randn(V, H, generator=g) * 0.5,
                "target": target, "meta": {}}, path)
    return str(path)


def test_reference_is_the_formula(real_file):
    prepared = distill.prepare(real_file, tokens=40)
    try:
        data = distill.load(real_file, 40)
        assert data["hidden"].shape == (40, H) and not torch.equal(data["student_weight"], data["teacher_weight"])
        w_s = data["student_weight"].double().requires_grad_()
        expected = linear_distillation_loss64(data["hidden"], w_s, data["hidden"], data["teacher_weight"],
                                              data["target"], beta=distill.BETA, temperature=distill.TEMPERATURE)
        expected.backward()
        ref = torch.load(prepared["reference_file"], weights_only=True)
        assert ref["loss"] == pytest.approx(float(expected), rel=1e-12) and float(expected) > 1e-3
        torch.testing.assert_close(ref["student_weight"], w_s.grad, rtol=1e-10, atol=1e-14)
        assert prepared["input"]["scored_tokens"] == int((data["target"] != -100).sum()) < 40
    finally:
        distill.cleanup(prepared)
    assert not __import__("os").path.exists(prepared["reference_file"])


@pytest.mark.parametrize("name", list(distill.PATHS))
def test_each_path_matches_the_reference(real_file, name):
    prepared = distill.prepare(real_file, tokens=40)
    try:
        (_row, spec, _env), = distill.jobs(prepared, "cpu", repeats=2, names=[name])
        result = worker.run_spec(spec)
    finally:
        distill.cleanup(prepared)
    assert result["status"] == "ok", result
    assert result["loss_rel_err"] < 1e-5 and result["grad_rel_err"] < 1e-5
    assert set(result["grad_rel_err_by_leaf"]) == {"hidden", "student_weight"}
    assert result["time_ms"] > 0 and len(result["times_ms"]) == 2 and result["peak_bytes"] >= 0
    assert result["floor_bytes"] == (40 * H + V * H) * 4


def test_command_runs_the_row_in_fresh_processes_and_renders(real_file, monkeypatch):
    monkeypatch.setattr(distill, "TOKENS", 40)
    monkeypatch.setattr(distill.prepare, "__defaults__", (40,))
    args = Namespace(device="cpu", timeout=300)
    console = Console(record=True, width=200)
    assert command._distillation(args, console, {}) is None          # no real input: no row
    other = Namespace(device="cpu", timeout=300, paths="linear-fusedce-torch")
    assert command._distillation(other, console, {"real": {"cache_file": real_file}}) is None   # not asked for
    # Two paths through the plumbing (stock, the ratios' base, and one fusedce path): every path's numbers are
    # test_each_path_matches_the_reference's, the soft-target rows test_bench_distill_soft's.
    asked = Namespace(device="cpu", timeout=300, paths="distill-stock,distill-fusedce-tiled")
    section = command._distillation(asked, console, {"real": {"cache_file": real_file}})
    assert "soft_ce" not in section                                   # no soft-target path asked for
    rows = section["results"]
    assert [r["path"] for r in rows] == ["distill-stock", "distill-fusedce-tiled"], rows
    assert all(r["status"] == "ok" for r in rows), rows
    assert rows[0]["stock_over_path_time"] == 1.0 and all("stock_over_path_memory" in r for r in rows)
    assert section["input"]["tokens"] == 40 and section["input"]["vocab_size"] == V
    print_table(section, console)
    text = console.export_text()
    assert "distillation (GKD JSD" in text and "fusedce tiled" in text
