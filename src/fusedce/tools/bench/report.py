"""The bench's outputs: rich tables on the terminal (one per shape and op, then the memory sweep), ``bench.json`` and
``bench.png``."""
from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from . import legend
from .goals import verdict_mark
from .machine import busy_warning, header
from .names import row_name

INTERPRETER_NOTE = ("(interp.) rows: the Triton kernels under TRITON_INTERPRET=1 on a slice of rows, for "
                    "parity only; (slice): stock torch on the same rows, the yardstick for their errors. "
                    "The interpreter runs kernels in numpy on the CPU: its times mean nothing, so none "
                    "are shown.")


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _over(ms, floor_ms) -> str:
    """``ms / floor_ms`` as ``"1.34x"``, or "-" when either is missing."""
    return "-" if ms is None or not floor_ms else f"{ms / floor_ms:.2f}x"


def _gbps(gbps, peak) -> str:
    """Achieved GB/s over the byte floor, with the share of the datasheet bandwidth when known."""
    if gbps is None:
        return "-"
    return f"{gbps:.3g}" if not peak else f"{gbps:.0f} ({100 * gbps / peak:.0f}%)"


OP_TITLES = {
    "cross_entropy": "cross_entropy on the logits (BT, V)",
    "linear_cross_entropy": "linear_cross_entropy: LM head + loss from hidden (BT, H) and weight (V, H)",
}


# Ops bound by arithmetic, not memory traffic (the LM head: 6 * BT * V * H FLOPs over (BT + V) * H elements):
# on a CPU their GB/s over the byte floor says nothing (a few GB/s of a compute-bound run), so that column is
# shown for them on a GPU only (where it is set against the datasheet bandwidth).
COMPUTE_BOUND_OPS = ("linear_cross_entropy",)


def shows_gbps(device: str, op: str) -> bool:
    """Whether the main table of ``op`` on ``device`` has the GB/s column: on a GPU, or a memory-bound op."""
    return device == "cuda" or op not in COMPUTE_BOUND_OPS


def _title(shape: str, op: str, rows: list[dict], inputs: dict) -> str:
    if shape == "real" and "real" in inputs:
        meta = inputs["real"]
        data = (f"real: SmolLM2-135M hidden states on KJV verses, {meta['tokens']} tokens "
                f"({meta['scored_tokens']} scored), H={meta['hidden_size']}, V={meta['vocab_size']}")
    else:
        timed = [r for r in rows if r.get("inputs")]
        size = timed[0]["inputs"] if timed else {}
        data = f"{shape}: synthetic, " + (", ".join(
            f"{k[:-len('_shape')]} {v}" for k, v in size.items() if k.endswith("_shape")) or "?")
    return f"{data}\n{OP_TITLES.get(op, op)}"


def _groups(report: dict) -> list[tuple[str, str]]:
    """(shape, op) in the order the rows ran."""
    return list(dict.fromkeys((r["shape"], r.get("op", "cross_entropy")) for r in report["results"]))


def _per_op(method, op: str) -> str:
    return method.get(op, "-") if isinstance(method, dict) else method


COLUMNS = (  # header, justify; the caption says what each error column means
    ("path", "left"), ("dtype", "left"), ("rows", "right"), ("loss", "right"), ("Δloss", "right"),
    ("max Δgrad", "right"), ("grad rel", "right"), ("ms", "right"), ("GB/s", "right"),
    ("MiB", "right"), ("status", "left"))
DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _fact(value) -> str:
    return format(value, ".1e") if isinstance(value, float) else str(value)


def main_legend(report: dict, op: str) -> dict:
    """What the main table's columns mean for ``op`` (``legend.lines``' specifics), from its methods."""
    methods = report["methods"]
    reference = _per_op(methods["parity"], op).split("; grad rel")[0]   # the reference alone
    return {
        "rows": "rows (tokens) the path ran on: the whole batch, or the interpreter's slice",
        "loss": "the path's own loss, mean over the scored tokens (nats)",
        "Δloss": "|loss - loss_ref|, the absolute loss error in nats; loss_ref: " + reference,
        "max Δgrad": ("max |g - g_ref| over the gradient's elements, absolute, against the same reference (the "
                      "linear op: the larger of the hidden and the weight gradient's)"),
        "grad rel": "||g - g_ref|| / ||g_ref||, relative, same reference (linear op: the larger of the two)",
        "ms": _per_op(methods["time"], op),
        "x GEMMs": ("the path's ms / the ms of the matrix products a linear cross-entropy cannot avoid, in one "
                    "run: h @ W.T, g @ W and g.T @ h in the row's dtype on the scored rows (an ignored row needs "
                    "no logits), timed in the stock path's worker "
                    "(1.0 = nothing beyond them; fusedce's bf16 / fp16 default forms fp32 logits: torch's CPU "
                    "kernels have no fp32-output low-precision GEMM, so it upcasts the weight in blocks, and its "
                    "fp32 products run on the bf16 units where the CPU has them (bf16 only), else at fp32 speed; "
                    "benchmarks/cpu_floor.py)"),
        "GB/s": _per_op(methods["floor"], op),
        "MiB": methods["memory"],
    }


def table(report: dict, shape: str, op: str = "cross_entropy") -> Table:
    """The rich table of one shape's rows of one op; long reasons go to numbered notes in the caption."""
    rows = [r for r in report["results"] if r["shape"] == shape and r.get("op", "cross_entropy") == op]
    machine = report["machine"]
    out = Table(title=f"{_title(shape, op, rows, report['inputs'])}\n{header(report['device'], machine)}",
                title_justify="left", caption_justify="left")
    floors = {r["dtype"]: r["gemm_floor_ms"] for r in rows if r.get("gemm_floor_ms")}
    columns = COLUMNS if not floors else COLUMNS[:8] + (("x GEMMs", "right"),) + COLUMNS[8:]
    gbps = shows_gbps(report["device"], op)
    if not gbps:
        columns = tuple(c for c in columns if c[0] != "GB/s")
    for name, justify in columns:
        out.add_column(name, justify=justify, no_wrap=name != "path")
    reasons = []
    for r in rows:
        status = r["status"]
        if r.get("reason"):
            reasons.append(f"[{len(reasons) + 1}] {row_name(r)} {r['dtype']}: {r['reason']}")
            status += f" [{len(reasons)}]"
        peak = r.get("peak_bytes")
        out.add_row(row_name(r),
                    DTYPE_SHORT.get(r["dtype"], r["dtype"]),
                    _num(r.get("inputs", {}).get("rows"), "d"), _num(r.get("loss"), ".6f"),
                    _num(r.get("loss_abs_err"), ".1e"), _num(r.get("grad_max_abs_err"), ".1e"),
                    _num(r.get("grad_rel_err"), ".1e"), _num(r.get("time_ms"), ".1f"),
                    *([_over(r.get("time_ms"), floors.get(r["dtype"]))] if floors else []),
                    *([_gbps(r.get("floor_gbps"), machine.get("peak_gbps"))] if gbps else []),
                    _num(None if peak is None else peak / 2**20, ".0f"),
                    status, style={"error": "red", "unavailable": "yellow"}.get(r["status"]))
    facts = []
    for r in rows:
        if r.get("extra"):
            reasons.append(f"{row_name(r)} {r['dtype']}: " + ", ".join(
                f"{k}={_fact(v)}" for k, v in r["extra"].items()))
            facts += list(r["extra"])
    reasons += legend.extra_lines(facts)
    notes = legend.lines(legend.of_table(out), main_legend(report, op))
    if any(r["mode"] == "parity" for r in rows):
        notes.append(INTERPRETER_NOTE)
    busy = busy_warning(machine)
    if report["device"] == "cpu" and busy:
        notes.append(busy + ".")
    notes += [note + "." for note in report.get("notes") or []]   # e.g. why the bf16 rows are not here
    out.caption = "\n".join(notes + reasons)
    return out


GOALS_LEGEND = {
    "shape": "the main table's input (real: SmolLM2 on KJV)",
    "goal": "what fusedce should do against the peers (torch LCE, TRL ChunkedLogProb) on that input",
    "met": ("met / MISSED; inconclusive: a time goal whose interval (see numbers) covers its threshold, so "
            "these few runs cannot tell; n/a: a row it needs failed or is missing"),
    "numbers": "the rows' ms (median, min-max over the timed runs) and MiB; (x): the peer's time / fusedce "
               "chunked's (stock/path's direction: > 1 means fusedce is faster), the medians' ratio, then its "
               "interval from the extreme runs (slowest peer run / fastest chunked run ...) and the runs it rests "
               "on: met only if the whole interval is > 1",
}


def goals_table(report: dict) -> Table:
    """fusedce against the peers on the bench's own inputs (``report["goals"]``, ``goals.real_goals``)."""
    out = Table(title=f"fusedce vs the peers (same run; shown, not enforced)\n"
                      f"{header(report['device'], report['machine'])}", title_justify="left", caption_justify="left")
    for name in ("shape", "dtype", "goal", "met", "numbers"):
        out.add_column(name, no_wrap=name != "numbers")
    for entry in report.get("goals") or []:
        for i, goal in enumerate(entry["goals"].values()):
            out.add_row(entry["shape"] if i == 0 else "", DTYPE_SHORT.get(entry["dtype"], entry["dtype"])
                        if i == 0 else "", goal["want"], verdict_mark(goal), goal["detail"])
    out.caption = "\n".join(legend.lines(legend.of_table(out), GOALS_LEGEND))
    return out


def loss_lines(real: dict) -> list[str]:
    """The real input's loss check: label, loss, relative difference to the model's loss; the labels
    padded to the longest one plus two spaces, so that none runs into its number."""
    entries = [("model(input_ids, labels=...)", real["model_loss"], None),
               ("F.cross_entropy(hidden @ W.T), float64, at caching", real["reproduced_loss"],
                real["loss_rel_diff"])]
    entries += [(f"this run, {c['op']}: {c['what']}", c["loss"], c["rel_diff"]) for c in real.get("recheck", [])]
    width = max(len(what) for what, _loss, _rel in entries) + 2
    return [f"SmolLM2-135M loss on this batch ({real['scored_tokens']} scored tokens; loss in nats, then "
            f"(its relative difference to the model's loss, limit {real['loss_rtol']:g})):"] + [
        f"  {what:<{width}}{loss:.6f}" + ("" if rel is None else f"  ({rel:.1e})") for what, loss, rel in entries]


def print_report(report: dict, console: Console) -> None:
    """Every table of ``report`` (main, goals, the real input's loss check, memory sweep, distillation, RL
    precision), then the run's wall time."""
    for shape, op in _groups(report):
        console.print(table(report, shape, op))
        console.print()
    if report.get("goals"):
        console.print(goals_table(report))
        console.print()
    real = report["inputs"].get("real")
    if real:
        console.print("\n".join(loss_lines(real)))
    if report.get("sweep"):
        from .report_sweep import sweep_table
        console.print()
        console.print(sweep_table(report))
    if report.get("distillation"):
        from .report_distill import print_table
        print_table(report["distillation"], console, header(report["device"], report["machine"]))
    if report.get("rl_precision"):
        from .report_rl import print_table as print_rl
        print_rl(report["rl_precision"], console, header(report["device"], report["machine"]))
    if report.get("wall_seconds") is not None:   # the last line, after every table
        sweep = report.get("sweep") or {}
        cpu = [r["process_cpu_s"] for r in report["results"] + sweep.get("results", [])
               if r.get("process_cpu_s") is not None]
        console.print(f"bench wall time {report['wall_seconds']:.0f} s"
                      + ("" if sweep.get("wall_seconds") is None else
                         f" (memory sweep {sweep['wall_seconds']:.0f} s)")
                      + (f"; the measuring processes used {sum(cpu):.0f} CPU seconds" if cpu else "")
                      + _cpu_text(report))


def _cpu_text(report: dict) -> str:
    """The run's CPU seconds and the wall time they need at least on idle cores (``cpu_seconds``)."""
    used, cores = report.get("cpu_seconds"), report.get("machine", {}).get("cpu_cores")
    if not used or not cores:
        return ""
    total = sum(used.values())
    return (f"; the whole run {total:.0f} CPU seconds (this process {used['self']:.0f}, its workers "
            f"{used['workers']:.0f}): at least {total / cores / 60:.1f} min on {cores} idle cores")


def write_json(report: dict, out: Path) -> Path:
    path = out / "bench.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def write_png(report: dict, out: Path) -> Path:
    """``bench.png`` (``report_plot``): every table's numbers as bars, the busy-machine warning on top."""
    from .report_plot import write_png as write
    return write(report, out)
