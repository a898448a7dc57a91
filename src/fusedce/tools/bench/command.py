"""``fusedce bench``: stock PyTorch cross-entropy (on logits, and fused with the LM head) against every fusedce path on
one device, then (CPU) the memory sweep of the fused LM head (``sweep.py``)."""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

from ..help_format import DefaultsFormatter

HELP = "compare fused and stock cross-entropy: parity vs float64, time, peak memory"
DESCRIPTION = """\
Compare the stock PyTorch cross-entropy with every fusedce path available on the device, for two ops:
cross_entropy on logits, and linear_cross_entropy (the LM head fused with the loss, next to the peers'
fused heads: torch's F.linear_cross_entropy with LinearCrossEntropyOptions() and TRL's
ChunkedLogProbFunction, and a table of fusedce against them): loss and gradient parity against float64,
forward+backward time, peak memory and (timed rows) GB/s over the byte floor. By default on real input:
SmolLM2-135M-Instruct's final hidden states on King James Bible
verses (SFT-style masking; built once, then cached under .cache/), 1024 tokens on CPU and 4096 on CUDA
(--tokens). On CPU the Triton kernels run under the interpreter on a slice of rows, for parity only.
With --sweep (CPU) a memory sweep follows: stock, fused (chunked, tiled) and the peers' linear
cross-entropy at SmolLM2's and Llama-3's vocabulary shapes, 0% and 50% of targets ignored, peak memory
and time with their ratios; --sweep only runs it alone. On the real input
an RL-precision table follows (--no-rl-precision skips it): per-token log-prob and entropy error vs float64
of a bf16 head for stock, an fp32 head copy (TRL's cast_lm_head_to_fp32), TRL's kernel, torch's LCE and
fusedce, and how many of 12 placements of a row in other batches change its result, with and without
batch_invariant=True. Writes OUT/bench.json and OUT/bench.png."""
DTYPES = ("float32", "bfloat16")
# --tokens by device: on a 2-core CPU one fwd+bwd of the LM head at the real shape (H=576, V=49152) is
# ~6 * BT * V * H FLOPs, 2-3 s at 1024 tokens, 10-20 s at 4096; with parity, peak memory and timed runs in
# each of the ten linear rows, 4096 tokens took the main job past 20 minutes.
TOKENS = {"cpu": 1024, "cuda": 4096}
LOAD_SAMPLE_SECONDS = 5.0
# The names --paths accepts (``paths.PATHS``, which imports torch; tests/tools/test_bench_report_cli.py keeps the two
# equal), by op: fusedce's paths, stock PyTorch's and the peers'.
PATH_NAMES = {
    "cross_entropy": ("torch", "fusedce-torch", "fusedce-triton"),
    "linear_cross_entropy": ("linear-torch", "linear-fusedce-torch", "linear-fusedce-triton",
                             "linear-fusedce-torch-tiled", "linear-fusedce-triton-tiled",
                             "linear-torch-lce", "linear-trl"),
}
# fusedce's chunked and tiled paths per device, judged against the peers (``goals.real_goals``)
# The distillation row's paths (``distill.PATHS``, ``distill_soft.PATHS``; tests/tools/test_bench_distill_soft.py
# keeps them equal): --paths naming only these runs the distillation row alone (no main table, no sweep).
DISTILL_NAMES = ("distill-stock", "distill-fusedce-chunked", "distill-fusedce-tiled", "distill-trl",
                 "softce-stock", "softce-fusedce-chunked", "softce-fusedce-tiled", "softce-torch-chunked")
CHUNKED_TILED = {"cpu": ("linear-fusedce-torch", "linear-fusedce-torch-tiled"),
                 "cuda": ("linear-fusedce-triton", "linear-fusedce-triton-tiled")}


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsFormatter
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the paths run: cpu (the Triton kernels under the interpreter, for parity "
                             "only) or cuda (every path timed)")
    parser.add_argument("--shapes", default="real",
                        help="comma list: 'real' (SmolLM2 on KJV), a named shape (smollm2, llama3-8b, "
                             "gemma2-2b, qwen2.5-7b, ... synthetic data) or HxV such as 64x1000")
    parser.add_argument("--dtype", default=None,
                        help=f"comma list of {', '.join(DTYPES)} (default: both, except on a CPU without bf16 "
                             "units (no AMX, no AVX512-BF16), where torch's bf16 GEMMs are emulated and one bf16 "
                             "row takes minutes: float32 there, and the table says so)")
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"BT, tokens per batch (default: {TOKENS['cpu']} with --device cpu, {TOKENS['cuda']} "
                             "with cuda; every table title says how many)")
    parser.add_argument("--repeats", type=int, default=5, help="timed forward+backward runs (CPU)")
    parser.add_argument("--warmup", type=int, default=0,
                        help="untimed runs before timing (CPU), besides the peak-memory run, which is one")
    parser.add_argument("--paths", default=None,
                        help="comma list of bench paths to run (default: every path that runs on the "
                             "device); " + "; ".join(f"{op}: {', '.join(names)}"
                                                   for op, names in PATH_NAMES.items())
                             + f"; distillation row (real input): {', '.join(DISTILL_NAMES)}"
                             + ". 'torch' / 'linear-torch' are stock PyTorch, 'linear-torch-lce' and "
                             "'linear-trl' the peers (torch F.linear_cross_entropy, TRL); '-triton' paths "
                             "are timed with --device cuda only; on CPU the chunked ones (not the tiled) run "
                             "under the Triton interpreter on --interpret-rows rows, for parity, untimed")
    parser.add_argument("--interpret-rows", type=int, default=32,
                        help="rows of the Triton interpreter's parity check (CPU)")
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for bench.json/png")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="real-input cache folder; None: $FUSEDCE_CACHE_DIR, else the checkout's .cache/")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per measurement")
    parser.add_argument("--sweep", nargs="?", const="after", choices=("after", "only"), default=None,
                        help="also run the CPU memory sweep of the fused LM head after the main job ('--sweep'), "
                             "or the sweep alone ('--sweep only', `make bench-sweep`); about 10-20 min on 2 CPU "
                             "cores, more under load (default: no sweep)")
    parser.add_argument("--no-sweep", action="store_true", help=argparse.SUPPRESS)   # the default now
    parser.add_argument("--no-rl-precision", action="store_true",
                        help="skip the RL-precision table (real input only; about 30-60 s on 2 CPU cores)")
    parser.add_argument("--sweep-repeats", type=int, default=2,
                        help="timed fwd+bwd runs per sweep row (after its peak-memory run)")


def _check_args(args) -> list[str]:
    bad = [d for d in _csv(args.dtype) if d not in DTYPES]
    if bad or not _csv(args.dtype):
        raise ValueError(f"--dtype: unknown {bad}; choose from {', '.join(DTYPES)}")
    if args.tokens < 1 or args.repeats < 1 or args.warmup < 0 or args.interpret_rows < 1 \
            or args.sweep_repeats < 1:
        raise ValueError("--tokens, --repeats, --sweep-repeats and --interpret-rows must be >= 1, "
                         "--warmup >= 0")
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


def _measure_all(jobs, args, console, describe) -> list[dict]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, \
        TimeElapsedColumn
    from . import harness
    rows = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("measuring", total=len(jobs))
        for i, (row, spec, env) in enumerate(jobs, 1):
            progress.update(task, description=describe(row))
            row.update(harness.run_isolated(spec, env=env, timeout=args.timeout))
            rows.append(row)
            progress.advance(task)
            if not console.is_terminal:   # a log (CI, `| tee`): no live bar, so one line per measurement
                console.print(f"  {i}/{len(jobs)} {describe(row)}: {row.get('status', 'done')}")
    return rows


def _recheck_real(rows, inputs_meta) -> list[str]:
    """On the real input, the losses of this run must still match the model's own loss: the float64 reference of the
    fp32 logits (cross_entropy) and of the fp32 hidden states and LM head (linear_cross_entropy), and every timed
    fp32 linear_cross_entropy path's own loss."""
    from . import real_input
    meta, failures = inputs_meta.get("real"), []
    if not meta:
        return failures
    meta["recheck"] = []
    for row in rows:
        if row["shape"] != "real" or row["dtype"] != "float32" or row["mode"] != "timed" \
                or row["status"] != "ok":
            continue
        checks = []
        if not any(c["op"] == row["op"] and c["what"] == "float64 reference" for c in meta["recheck"]):
            checks.append(("float64 reference", row["loss_ref"]))
        if row["op"] == "linear_cross_entropy":
            checks.append((f"{row['label']} (fp32)", row["loss"]))
        for what, loss in checks:
            try:
                rel = real_input.check_loss(meta, loss)
            except real_input.RealInputError as exc:
                failures.append(f"{row['op']}, {what}: {exc}")
                rel = abs(loss - meta["model_loss"]) / abs(meta["model_loss"])
            meta["recheck"].append({"op": row["op"], "what": what, "loss": loss, "rel_diff": rel})
    return failures


def _distillation(args, console, inputs_meta):
    """The distillation row on the real input (``distill``) with its soft-target cross-entropy part
    (``distill_soft``, under the key ``"soft_ce"``), or None without real input (or when ``--paths`` names
    none of ``distill.PATHS`` / ``distill_soft.PATHS``)."""
    from . import distill, distill_soft
    asked = _csv(args.paths) if getattr(args, "paths", None) else None
    names = None if asked is None else [name for name in asked if name in distill.PATHS]
    soft_names = None if asked is None else [name for name in asked if name in distill_soft.PATHS]
    if "real" not in inputs_meta or (names == [] and soft_names == []):
        return None
    source, began = inputs_meta["real"]["cache_file"], time.perf_counter()
    section = {"input": None, "results": []}
    if names != []:
        prepared = distill.prepare(source)
        try:
            rows = _measure_all(distill.jobs(prepared, args.device, names=names), args, console, distill.describe)
        finally:
            distill.cleanup(prepared)
        section = distill.summarize(prepared, rows, time.perf_counter() - began)
    if soft_names != []:
        began_soft, prepared = time.perf_counter(), distill_soft.prepare(source)
        try:
            rows = _measure_all(distill_soft.jobs(prepared, args.device, names=soft_names), args, console,
                                distill_soft.describe)
        finally:
            distill_soft.cleanup(prepared)
        section["soft_ce"] = distill_soft.summarize(prepared, rows, time.perf_counter() - began_soft)
    return section


def _rl_precision(args, console, inputs_meta):
    """The RL-precision table on the real input (``rl_precision``, one fresh process), or None."""
    from . import rl_precision
    if "real" not in inputs_meta or getattr(args, "no_rl_precision", False):
        return None
    began = time.perf_counter()
    row, spec, env = rl_precision.job(inputs_meta["real"]["cache_file"], args.device)
    [row] = _measure_all([(row, spec, env)], args, console, rl_precision.describe)
    row["wall_seconds"] = round(time.perf_counter() - began, 1)
    return row


def _describe_row(row) -> str:
    return f"{row['shape']} {row['dtype']} {row['op']}: {row['label']}"


def _describe_sweep_row(row) -> str:
    return (f"sweep {row['shape']} (BT={row['tokens']}, H={row['hidden']}, V={row['vocab']}), "
            f"{row['ignore_fraction']:.0%} ignored: {row['label']}")


def _sweep(args, console) -> dict:
    """The memory sweep (CPU): every configuration in a fresh process, then the stock/chunked ratios."""
    from . import sweep
    began = time.perf_counter()
    rows = _measure_all(sweep.jobs(args.sweep_repeats), args, console, _describe_sweep_row)
    return {"method": {**sweep.METHOD, "time": sweep.METHOD["time"].format(repeats=args.sweep_repeats)},
            "results": rows, "summary": sweep.summarize(rows),
            "wall_seconds": round(time.perf_counter() - began, 1)}


def _jobs(shapes, dtypes, plan, sources, args) -> list:
    """(row, worker spec, extra env) per shape x dtype x path; rows are filled by the worker."""
    from .names import row_name
    jobs = []
    for shape in shapes:
        for dtype in dtypes:
            for path, mode in plan:
                spec = {"path": path.name, "mode": mode, "device": args.device, "dtype": dtype,
                        "source": sources[shape.name], "repeats": args.repeats, "warmup": args.warmup,
                        "rows": args.interpret_rows if mode == "parity" else None}
                interpret = mode == "parity" and path.interpreter
                env = {"TRITON_INTERPRET": "1"} if interpret else None
                row = {"shape": shape.name, "dtype": dtype, "path": path.name, "op": path.op.name,
                       "mode": mode, "baseline": path.name == path.op.baseline, "peer": path.peer}
                row["label"] = row_name(row)
                jobs.append((row, spec, env))
    return jobs


def _methods(rows, plan, args) -> dict:
    """Overall methods; ``parity``, ``time`` and ``floor`` per op (keyed by op name)."""
    from . import harness
    memory = next((r["method"]["memory"] for r in rows if r.get("method", {}).get("memory")),
                  "not measured")
    cuda = args.device == "cuda"
    ops = list(dict.fromkeys(path.op for path, _mode in plan))
    repeats = {op.name: min(args.repeats, op.max_cpu_repeats) if not cuda and op.max_cpu_repeats
               else args.repeats for op in ops}
    return {
        "parity": {op.name: f"{op.parity_method}; grad rel = ||g - g_ref|| / ||g_ref||"
                            + (" (worst leaf)" if len(op.leaves) > 1 else "") for op in ops},
        "time": {op.name: harness.time_method(args.device, repeats[op.name], args.warmup) for op in ops},
        "memory": memory + ", fresh process per row; gradients included (none exist before the run)",
        "floor": {op.name: f"bytes a forward+backward must move at least ({op.floor_formula}) / median "
                           "time" + ("; (%) = share of the datasheet memory bandwidth" if cuda else "")
                  for op in ops},
    }


# Why the bf16 rows are left out by default on a CPU without bf16 units: benchmarks/README.md.
NO_BF16_UNITS = ("bf16 rows not run by default: this CPU has no bf16 units (no AMX, no AVX512-BF16), so torch's "
                 "bf16 GEMMs are emulated, up to ~100x slower than fp32 (one backward GEMM at the real shape: 58 "
                 "CPU seconds against 0.55), minutes per row; --dtype float32,bfloat16 runs them")


def default_dtypes(device: str) -> tuple[str, "str | None"]:
    """(--dtype's value, the note saying what was left out and why, or None): both dtypes on CUDA and on a
    CPU with AMX or AVX512-BF16, float32 alone elsewhere (``NO_BF16_UNITS``)."""
    if device == "cpu":
        from .machine import cpu_capabilities
        caps = cpu_capabilities()
        if not (caps["amx"] or caps["avx512_bf16"]):
            return "float32", NO_BF16_UNITS
    return ",".join(DTYPES), None


def _cpu_seconds() -> dict:
    """CPU seconds (user + system) of this process (the real input's build, the references) and of its
    finished workers: on a busy machine the wall time stretches, these do not (much); their sum over the
    cores is the least wall time the run could take on idle cores."""
    import resource
    usage = {who: resource.getrusage(flag) for who, flag in (("self", resource.RUSAGE_SELF),
                                                             ("workers", resource.RUSAGE_CHILDREN))}
    return {who: round(u.ru_utime + u.ru_stime, 1) for who, u in usage.items()}


def run(args) -> int:
    from rich.console import Console
    from rich.panel import Panel
    import torch
    from . import goals, machine, paths, report, shapes as shape_table
    from .real_input import RealInputError

    began = time.perf_counter()
    err = Console(stderr=True)
    out = Console() if sys.stdout.isatty() else Console(width=220)  # logs and pipes: every column whole
    if args.tokens is None:
        args.tokens = TOKENS[args.device]
    skipped_dtypes = None
    if args.dtype is None:
        args.dtype, skipped_dtypes = default_dtypes(args.device)
    try:
        dtypes = _check_args(args)
        shapes = shape_table.parse_shapes(args.shapes)
        asked = _csv(args.paths) if args.paths else None
        unknown = sorted(set(asked or ()) - set(paths.PATHS) - set(DISTILL_NAMES))
        if unknown:
            raise ValueError(f"unknown path(s) {unknown}; valid: {', '.join(paths.PATHS)}; distillation row "
                             f"(real input): {', '.join(DISTILL_NAMES)}")
        main_paths = None if asked is None else [name for name in asked if name not in DISTILL_NAMES]
        real_only = [name for name in asked or () if name in DISTILL_NAMES]
        if real_only and not any(shape.name == shape_table.REAL for shape in shapes):
            raise ValueError(f"--paths names distillation paths ({', '.join(real_only)}), which run on the real "
                             f"input only: add 'real' to --shapes (got {args.shapes!r})")
        # --paths naming only distillation paths: that row alone (the real input is still prepared)
        plan = [] if main_paths == [] else paths.plan(args.device, main_paths)
        if args.sweep and args.device != "cpu":
            raise ValueError("--sweep: the memory sweep measures CPU memory; run it with --device cpu")
        if args.sweep == "only":   # the sweep alone: no main table, no real input
            shapes, plan = [], []
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
    with machine.LoadSampler(LOAD_SAMPLE_SECONDS) as load:   # the busy-machine warning's worst load
        rows = _measure_all(_jobs(shapes, dtypes, plan, sources, args), args, err, _describe_row)
        failures += _recheck_real(rows, inputs_meta)
        distillation = _distillation(args, err, inputs_meta)
        rl_precision = _rl_precision(args, err, inputs_meta) if plan else None
        sweep = _sweep(args, err) if args.device == "cpu" and args.sweep else None

    result = {
        "fusedce_bench": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "machine": {**machine.describe(args.device), "load_average_1min_before": load_before,
                    **load.summary()},
        "settings": {key: str(value) if isinstance(value, Path) else value
                     for key, value in vars(args).items() if key not in ("handler", "command")},
        "methods": _methods(rows, plan, args),
        "inputs": inputs_meta,
        "results": rows,
        "goals": goals.real_goals(rows, *CHUNKED_TILED[args.device]),
        "sweep": sweep,
        "distillation": distillation,
        "rl_precision": rl_precision,
        "failures": failures,
        "notes": [skipped_dtypes] if skipped_dtypes else [],
        "wall_seconds": round(time.perf_counter() - began, 1),
        "cpu_seconds": _cpu_seconds(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    report.print_report(result, out)
    written = [report.write_json(result, args.out), report.write_png(result, args.out)]
    out.print(f"wrote {', '.join(str(p) for p in written)}")
    for failure in failures:
        err.print(Panel(failure, title="real input FAILED", style="bold red"))
    errors = [r for r in rows + (sweep["results"] if sweep else [])
              + (distillation["results"] if distillation else [])
              + (rl_precision["results"] if rl_precision and rl_precision.get("status") == "ok" else [])
              + ([rl_precision] if rl_precision and rl_precision.get("status") != "ok" else [])
              + (distillation["soft_ce"]["results"] if distillation and "soft_ce" in distillation else [])
              if r["status"] == "error"]
    if errors:
        err.print(f"[red]{len(errors)} measurement(s) failed; see the status column")
    return 1 if failures or errors else 0
