"""``fusedce bench``: stock PyTorch cross-entropy against every fusedce path on one device.

Imports only argparse at module level, so ``fusedce --help`` stays fast; the work happens in ``run``.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

HELP = "compare fused and stock cross-entropy: parity vs float64, time, peak memory"
DESCRIPTION = """\
Compare the stock PyTorch cross-entropy with every fusedce path available on the device: loss and
gradient parity against float64, forward+backward time, peak memory and (timed rows) GB/s over the byte
floor. By default on real input: SmolLM2-135M-Instruct's final hidden states on King James Bible
verses (SFT-style masking; built once, then cached under .cache/). On CPU the Triton kernels run under
the interpreter on a slice of rows, for parity only. Writes OUT/bench.json and OUT/bench.png."""
DTYPES = ("float32", "bfloat16")


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shapes", default="real",
                        help="comma list: 'real' (SmolLM2 on KJV), a named shape (smollm2, llama3-8b, "
                             "gemma2-2b, qwen2.5-7b, ... synthetic data) or HxV such as 64x1000")
    parser.add_argument("--dtype", default=",".join(DTYPES), help=f"comma list of {', '.join(DTYPES)}")
    parser.add_argument("--tokens", type=int, default=4096, help="BT, tokens per batch")
    parser.add_argument("--repeats", type=int, default=5, help="timed forward+backward runs (CPU)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (CPU)")
    parser.add_argument("--paths", default=None,
                        help="comma list of bench paths to run; None: every registered path")
    parser.add_argument("--interpret-rows", type=int, default=32,
                        help="rows of the Triton interpreter's parity check (CPU)")
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for bench.json/png")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="real-input cache folder; None: $FUSEDCE_CACHE_DIR, else the checkout's .cache/")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per measurement")


def _check_args(args) -> list[str]:
    bad = [d for d in _csv(args.dtype) if d not in DTYPES]
    if bad or not _csv(args.dtype):
        raise ValueError(f"--dtype: unknown {bad}; choose from {', '.join(DTYPES)}")
    if args.tokens < 1 or args.repeats < 1 or args.warmup < 0 or args.interpret_rows < 1:
        raise ValueError("--tokens, --repeats and --interpret-rows must be >= 1, --warmup >= 0")
    return _csv(args.dtype)


def _sources(shapes, args, console, inputs_meta) -> dict:
    from . import real_input
    sources = {}
    for shape in shapes:
        if shape.is_real:
            meta = real_input.prepare(args.tokens, args.cache_dir, console)
            meta["loss_rtol"] = real_input.LOSS_RTOL
            inputs_meta["real"] = meta
            sources[shape.name] = {"kind": "real", "file": meta["cache_file"]}
        else:
            sources[shape.name] = {"kind": "synthetic", "hidden": shape.hidden, "vocab": shape.vocab,
                                   "tokens": args.tokens, "seed": 0}
            inputs_meta[shape.name] = {"kind": "synthetic", "hidden_size": shape.hidden,
                                       "vocab_size": shape.vocab, "tokens": args.tokens,
                                       "note": "logits N(0, 2^2), seeded; SFT target mask"}
    return sources


def _measure_all(jobs, args, console) -> list[dict]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, \
        TimeElapsedColumn
    from . import harness
    rows = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("measuring", total=len(jobs))
        for row, spec, env in jobs:
            progress.update(task, description=f"{row['shape']} {row['dtype']} {row['label']}")
            row.update(harness.run_isolated(spec, env=env, timeout=args.timeout))
            rows.append(row)
            progress.advance(task)
    return rows


def _recheck_real(rows, inputs_meta) -> None:
    """The float64 loss of this run's fp32 logits must still match the model's own loss."""
    from . import real_input
    meta = inputs_meta.get("real")
    for row in rows:
        if meta and row["shape"] == "real" and row["dtype"] == "float32" and row["mode"] == "timed" \
                and row["status"] == "ok":
            meta["recheck_loss"] = row["loss_ref"]
            real_input.check_loss(meta, row["loss_ref"])
            return


def _jobs(shapes, dtypes, plan, sources, args) -> list:
    """(row, worker spec, extra env) per shape x dtype x path; rows are filled by the worker."""
    jobs = []
    for shape in shapes:
        for dtype in dtypes:
            for path, mode in plan:
                spec = {"path": path.name, "mode": mode, "device": args.device, "dtype": dtype,
                        "source": sources[shape.name], "repeats": args.repeats, "warmup": args.warmup,
                        "rows": args.interpret_rows if mode == "parity" else None}
                interpret = mode == "parity" and path.interpreter
                env = {"TRITON_INTERPRET": "1"} if interpret else None
                suffix = " (interp.)" if interpret else " (slice)" if mode == "parity" else ""
                row = {"shape": shape.name, "dtype": dtype, "path": path.name, "label": path.label + suffix,
                       "op": path.op.name, "mode": mode}
                jobs.append((row, spec, env))
    return jobs


def _methods(rows, args) -> dict:
    from . import harness
    memory = next((r["method"]["memory"] for r in rows if r.get("method", {}).get("memory")),
                  "not measured")
    cuda = args.device == "cuda"
    return {
        "parity": "F.cross_entropy on the same logits in float64 (chunked autograd); "
                  "grad rel = ||g - g_ref|| / ||g_ref||",
        "time": harness.TIME_METHOD[args.device].format(repeats=args.repeats, warmup=args.warmup),
        "memory": memory + ", fresh process per row",
        "floor": "bytes a forward+backward must move at least (cross_entropy: 3 * BT * V * dtype_bytes)"
                 " / median time" + ("; (%) = share of the datasheet memory bandwidth" if cuda else ""),
    }


def run(args) -> int:
    from rich.console import Console
    from rich.panel import Panel
    import torch
    from . import machine, paths, report, shapes as shape_table
    from .real_input import RealInputError

    err = Console(stderr=True)
    out = Console() if sys.stdout.isatty() else Console(width=130)  # logs and pipes: no wrapping
    try:
        dtypes = _check_args(args)
        shapes = shape_table.parse_shapes(args.shapes)
        plan = paths.plan(args.device, _csv(args.paths) if args.paths else None)
    except ValueError as exc:
        err.print(f"[red]fusedce bench: {exc}")
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        err.print("[red]fusedce bench: --device cuda, but torch sees no CUDA device")
        return 2

    inputs_meta, failures = {}, []
    try:
        sources = _sources(shapes, args, err, inputs_meta)
    except RealInputError as exc:
        err.print(Panel(str(exc), title="real input FAILED", style="bold red"))
        return 1
    load_before = machine.describe(args.device).get("load_average_1min")
    rows = _measure_all(_jobs(shapes, dtypes, plan, sources, args), args, err)
    try:
        _recheck_real(rows, inputs_meta)
    except RealInputError as exc:
        failures.append(str(exc))

    result = {
        "fusedce_bench": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "machine": {**machine.describe(args.device), "load_average_1min_before": load_before},
        "settings": {key: str(value) if isinstance(value, Path) else value
                     for key, value in vars(args).items() if key not in ("handler", "command")},
        "methods": _methods(rows, args),
        "inputs": inputs_meta,
        "results": rows,
        "failures": failures,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    report.print_report(result, out)
    written = [report.write_json(result, args.out), report.write_png(result, args.out)]
    out.print(f"wrote {', '.join(str(p) for p in written)}")
    for failure in failures:
        err.print(Panel(failure, title="real input FAILED", style="bold red"))
    errors = [r for r in rows if r["status"] == "error"]
    if errors:
        err.print(f"[red]{len(errors)} measurement(s) failed; see the status column")
    return 1 if failures or errors else 0
