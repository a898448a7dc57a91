"""Issue 47 item 1: ``make bench`` (= ``fusedce bench``) is the main job alone and sized for a first look
(within 10 minutes on the 2-core dev machine when quiet): the main table on the real input at 1024 tokens
(the table's title says so), the peers, accuracy, RL precision and distillation; the memory sweep only
with ``--sweep`` or ``make bench-sweep``. Nothing here measures the real input; the CLI runs use tiny
synthetic shapes or stand-ins."""
import json
import re
from argparse import Namespace
from pathlib import Path

from fusedce.tools import cli
from fusedce.tools.bench import command, harness, paths, report, shapes, sweep, worker

ROOT = Path(__file__).resolve().parents[2]
TINY_SWEEP = sweep.SweepShape("tiny", 64, 16, 16384)


def _recipe(target: str) -> list[str]:
    """The recipe lines of ``target`` in the Makefile."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"{re.escape(target)}:", line))
    out = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        out.append(line.strip())
    return out


def test_make_bench_is_the_main_job_and_bench_sweep_the_sweep():
    assert _recipe("bench") == ["$(VENV)/bin/fusedce bench"]
    [sweep_line] = _recipe("bench-sweep")
    assert sweep_line.startswith("$(VENV)/bin/fusedce bench --sweep only")


def test_the_default_run_has_no_sweep_and_1024_real_tokens_on_cpu():
    args = cli.build_parser("bench").parse_args(["bench"])
    assert args.sweep is None and args.shapes == "real" and args.tokens is None
    assert command.TOKENS == {"cpu": 1024, "cuda": 4096}


def test_the_main_jobs_default_rows():
    """The rows ``make bench`` measures on CPU: both dtypes x (cross_entropy: stock and fusedce timed, the
    Triton kernel's interpreter parity next to stock on the slice; linear: stock, chunked, tiled and both
    peers timed, the Triton chunked path's parity): 22 rows, each of the real input at the CPU's tokens."""
    args = Namespace(device="cpu", repeats=5, warmup=0, interpret_rows=32, tokens=command.TOKENS["cpu"])
    source = {"real": {"kind": "real", "file": "-"}}
    jobs = command._jobs(shapes.parse_shapes("real"), list(command.DTYPES), paths.plan("cpu"), source, args)
    timed = [(row["dtype"], row["path"]) for row, _spec, _env in jobs if row["mode"] == "timed"]
    assert len(jobs) == 22 and len(timed) == 14
    assert {path for _dtype, path in timed} == {
        "torch", "fusedce-torch", "linear-torch", "linear-fusedce-torch", "linear-fusedce-torch-tiled",
        "linear-torch-lce", "linear-trl"}


def test_the_real_tables_title_says_the_tokens():
    meta = {"tokens": 1024, "scored_tokens": 700, "hidden_size": 576, "vocab_size": 49152}
    assert "1024 tokens (700 scored)" in report._title("real", "linear_cross_entropy", [], {"real": meta})


def test_sweep_only_runs_the_sweep_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "SHAPES", (TINY_SWEEP,))
    monkeypatch.setattr(sweep, "IGNORE_FRACTIONS", (0.5,))
    monkeypatch.setattr(sweep, "LABELS", sweep.LABELS[:2])    # stock and chunked: the plumbing, fast
    ran = []

    def in_process(spec, env=None, timeout=None):
        ran.append(spec)
        return worker.run_spec(spec)
    monkeypatch.setattr(harness, "run_isolated", in_process)
    assert cli.main(["bench", "--sweep", "only", "--sweep-repeats", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["results"] == [] and result["distillation"] is None and result["rl_precision"] is None
    assert [r["label"] for r in result["sweep"]["results"]] == ["stock", "fused"]
    assert all(spec.get("sweep") for spec in ran) and "real" not in result["inputs"]


def test_sweep_on_cuda_is_refused(capsys):
    assert cli.main(["bench", "--device", "cuda", "--sweep", "--shapes", "8x8"]) == 2
    assert "--sweep" in capsys.readouterr().err


def test_bf16_rows_are_left_out_by_default_only_without_bf16_units_and_the_table_says_so(monkeypatch):
    """On an AVX2-only CPU torch's bf16 GEMMs are emulated (one backward GEMM of the real shape: 58 CPU s
    against 0.55 in fp32): the default run there is fp32 alone, with a note under the table."""
    from fusedce.tools.bench import machine
    from fusedce.tools.bench.report import table
    caps = {"amx": False, "avx512_bf16": False, "bf16_gemm_mode": False, "avx2": True, "avx512f": False}
    monkeypatch.setattr(machine, "cpu_capabilities", lambda: caps)
    dtype, note = command.default_dtypes("cpu")
    assert dtype == "float32" and "--dtype float32,bfloat16" in note
    monkeypatch.setattr(machine, "cpu_capabilities", lambda: dict(caps, avx512_bf16=True))
    assert command.default_dtypes("cpu") == ("float32,bfloat16", None)
    assert command.default_dtypes("cuda") == ("float32,bfloat16", None)
    row = {"shape": "8x40", "dtype": "float32", "path": "torch", "op": "cross_entropy", "mode": "timed",
           "baseline": True, "peer": False, "label": "stock", "status": "ok"}
    result = {"device": "cpu", "machine": {"name": "x (2 cores)", "cpu_cores": 2}, "inputs": {}, "results": [row],
              "methods": command._methods([row], paths.plan("cpu", ["torch"]), Namespace(device="cpu", repeats=1,
                                                                                           warmup=0)),
              "notes": [note]}
    assert "bf16 rows not run by default" in str(table(result, "8x40", "cross_entropy").caption)
