"""``fusedce bench``'s distillation row, soft-target cross-entropy part (``bench/distill_soft.py``), at a tiny
shape standing in for the real input file (48 tokens, H=16, V=300: not a power of two): its float64
reference is the probability-target formula, each fusedce / stock path agrees with it in a fresh-process
spec, torch's chunked path is "unavailable" exactly when it would fall back to the full logits, and the
command renders the table (and --paths naming only distillation paths skips the main table)."""
import warnings
from argparse import Namespace

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from fusedce.tools.bench import command, distill, distill_soft, worker
from fusedce.tools.bench.report_distill import print_table

N, H, V = 48, 16, 300


@pytest.fixture()
def real_file(tmp_path):
    g = torch.Generator().manual_seed(2)
    target = torch.randint(0, V, (N,), generator=g)
    target[::3] = -100
    path = tmp_path / "real.pt"
    torch.save({"hidden": torch.randn(N, H, generator=g), "weight": torch.randn(V, H, generator=g) * 0.5,
                "target": target, "meta": {}}, path)
    return str(path)


def test_reference_is_the_formula(real_file):
    prepared = distill_soft.prepare(real_file, tokens=40)
    try:
        data = distill_soft.load(real_file, 40)
        assert data["q"].dtype == torch.bfloat16 and data["q"].shape == (40, V)
        w_s = data["student_weight"].double().requires_grad_()
        z = data["hidden"].double() @ w_s.T
        expected = F.cross_entropy(z, data["q"].double())   # torch's probability-target mean, float64
        expected.backward()
        ref = torch.load(prepared["reference_file"], weights_only=True)
        assert ref["loss"] == pytest.approx(float(expected.detach()), rel=1e-12) and float(expected.detach()) > 1e-3
        torch.testing.assert_close(ref["student_weight"], w_s.grad, rtol=1e-10, atol=1e-14)
    finally:
        distill_soft.cleanup(prepared)


def _torch_takes_probabilities() -> bool:
    h, w = torch.randn(4, 8), torch.randn(16, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.linear_cross_entropy(h, w, torch.softmax(torch.randn(4, 16), -1),
                               options=torch.nn.LinearCrossEntropyOptions())
    return not any("ignored" in str(c.message) for c in caught)


@pytest.mark.parametrize("name", list(distill_soft.PATHS))
def test_each_path_matches_the_reference(real_file, name):
    prepared = distill_soft.prepare(real_file, tokens=40)
    try:
        (_row, spec, _env), = distill_soft.jobs(prepared, "cpu", repeats=2, names=[name])
        result = worker.run_spec(spec)
    finally:
        distill_soft.cleanup(prepared)
    if name == "softce-torch-chunked" and not _torch_takes_probabilities():
        assert result["status"] == "unavailable" and "int64 targets" in result["reason"], result
        return
    assert result["status"] == "ok", result
    assert result["loss_rel_err"] < 1e-5 and result["grad_rel_err"] < 1e-5
    assert result["time_ms"] > 0 and len(result["times_ms"]) == 2 and result["peak_bytes"] >= 0
    assert result["floor_bytes"] == (40 * H + V * H) * 4


def test_command_runs_the_soft_rows_and_renders(real_file, monkeypatch):
    monkeypatch.setattr(distill, "TOKENS", 40)
    console = Console(record=True, width=220)
    args = Namespace(device="cpu", timeout=300, paths="softce-stock,softce-fusedce-tiled")
    section = command._distillation(args, console, {"real": {"cache_file": real_file}})
    assert section["input"] is None and section["results"] == []        # no GKD path asked for
    rows = section["soft_ce"]["results"]
    assert [r["path"] for r in rows] == ["softce-stock", "softce-fusedce-tiled"]
    assert all(r["status"] == "ok" for r in rows) and rows[0]["stock_over_path_time"] == 1.0
    assert section["soft_ce"]["input"]["tokens"] == 40
    print_table(section, console)
    text = console.export_text()
    assert "soft-target linear cross-entropy" in text and "fusedce tiled" in text
    assert "GKD JSD" not in text


def test_distill_names_match_the_paths():
    assert set(command.DISTILL_NAMES) == set(distill.PATHS) | set(distill_soft.PATHS)
