"""The bench's outputs: rich tables on the terminal (one per shape and op, then the memory sweep),
``bench.json`` and ``bench.png``.

Every saved result names its machine (``machine.describe``) and its method (per row and overall).
Everything here reads the result dict only, so a saved ``bench.json`` can be rendered again.
"""
from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .colors import legend_text, path_color
from .machine import busy_warning
from .plot_axes import time_unit, value_axis

INTERPRETER_NOTE = ("(interp.) rows: the Triton kernels under TRITON_INTERPRET=1 on a slice of rows, for "
                    "parity only; (slice): stock torch on the same rows, the yardstick for their errors. "
                    "The interpreter runs kernels in numpy on the CPU: its times mean nothing, so none "
                    "are shown.")


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _gbps(gbps, peak) -> str:
    """Achieved GB/s over the byte floor, with the share of the datasheet bandwidth when known."""
    if gbps is None:
        return "-"
    return f"{gbps:.2f}" if not peak else f"{gbps:.0f} ({100 * gbps / peak:.0f}%)"


OP_TITLES = {
    "cross_entropy": "cross_entropy on the logits (BT, V)",
    "linear_cross_entropy": "linear_cross_entropy: LM head + loss from hidden (BT, H) and weight (V, H)",
}


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


def table(report: dict, shape: str, op: str = "cross_entropy") -> Table:
    """The rich table of one shape's rows of one op; long reasons go to numbered notes in the caption."""
    rows = [r for r in report["results"] if r["shape"] == shape and r.get("op", "cross_entropy") == op]
    machine = report["machine"]
    out = Table(title=f"{_title(shape, op, rows, report['inputs'])}\n{report['device']}: {machine['name']}",
                title_justify="left", caption_justify="left")
    for name, justify in COLUMNS:
        out.add_column(name, justify=justify, no_wrap=name != "path")
    reasons = []
    for r in rows:
        status = r["status"]
        if r.get("reason"):
            reasons.append(f"[{len(reasons) + 1}] {r['label']} {r['dtype']}: {r['reason']}")
            status += f" [{len(reasons)}]"
        peak = r.get("peak_bytes")
        out.add_row(r["label"],
                    DTYPE_SHORT.get(r["dtype"], r["dtype"]),
                    _num(r.get("inputs", {}).get("rows"), "d"), _num(r.get("loss"), ".6f"),
                    _num(r.get("loss_abs_err"), ".1e"), _num(r.get("grad_max_abs_err"), ".1e"),
                    _num(r.get("grad_rel_err"), ".1e"), _num(r.get("time_ms"), ".1f"),
                    _gbps(r.get("floor_gbps"), machine.get("peak_gbps")),
                    _num(None if peak is None else peak / 2**20, ".0f"),
                    status, style={"error": "red", "unavailable": "yellow"}.get(r["status"]))
    for r in rows:
        if r.get("extra"):
            reasons.append(f"{r['label']} {r['dtype']}: " + ", ".join(
                f"{k}={_fact(v)}" for k, v in r["extra"].items()))
    methods = report["methods"]
    notes = [f"Δloss, max Δgrad, grad rel: vs {_per_op(methods['parity'], op)}",
             f"ms: {_per_op(methods['time'], op)}", f"MiB: {methods['memory']}",
             f"GB/s: {_per_op(methods['floor'], op)}"]
    if any(r["mode"] == "parity" for r in rows):
        notes.append(INTERPRETER_NOTE)
    busy = busy_warning(machine)
    if report["device"] == "cpu" and busy:
        notes.append(busy + ".")
    out.caption = "\n".join(notes + reasons)
    return out


def goals_table(report: dict) -> Table:
    """fusedce against the peers on the bench's own inputs (``report["goals"]``, ``goals.real_goals``)."""
    out = Table(title=f"fusedce vs the peers (same run; shown, not enforced)\n{report['device']}: "
                      f"{report['machine']['name']}", title_justify="left")
    for name in ("shape", "dtype", "goal", "met", "numbers"):
        out.add_column(name, no_wrap=name != "numbers")
    marks = {True: "[green]met[/]", False: "[red]MISSED[/]", None: "[yellow]n/a[/]"}
    for entry in report.get("goals") or []:
        for i, goal in enumerate(entry["goals"].values()):
            out.add_row(entry["shape"] if i == 0 else "", DTYPE_SHORT.get(entry["dtype"], entry["dtype"])
                        if i == 0 else "", goal["want"], marks[goal["met"]], goal["detail"])
    return out


def print_report(report: dict, console: Console) -> None:
    for shape, op in _groups(report):
        console.print(table(report, shape, op))
        console.print()
    if report.get("goals"):
        console.print(goals_table(report))
        console.print()
    real = report["inputs"].get("real")
    if real:
        lines = [f"SmolLM2-135M loss on this batch ({real['scored_tokens']} scored tokens; relative "
                 f"difference to the model's loss, limit {real['loss_rtol']:g}):",
                 f"  {'model(input_ids, labels=...)':<58}{real['model_loss']:.6f}",
                 f"  {'F.cross_entropy(hidden @ W.T), float64, at caching':<58}{real['reproduced_loss']:.6f}"
                 f"  ({real['loss_rel_diff']:.1e})"]
        for check in real.get("recheck", []):
            what = f"this run, {check['op']}: {check['what']}"
            lines.append(f"  {what:<58}{check['loss']:.6f}  ({check['rel_diff']:.1e})")
        console.print("\n".join(lines))
    if report.get("sweep"):
        from .report_sweep import sweep_table
        console.print()
        console.print(sweep_table(report))
    if report.get("wall_seconds") is not None:
        sweep = report.get("sweep") or {}
        cpu = [r["process_cpu_s"] for r in report["results"] + sweep.get("results", [])
               if r.get("process_cpu_s") is not None]
        console.print(f"bench wall time {report['wall_seconds']:.0f} s"
                      + ("" if sweep.get("wall_seconds") is None else
                         f" (memory sweep {sweep['wall_seconds']:.0f} s)")
                      + (f"; the measuring processes used {sum(cpu):.0f} CPU seconds" if cpu else ""))


def write_json(report: dict, out: Path) -> Path:
    path = out / "bench.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def write_png(report: dict, out: Path) -> Path:
    """Horizontal bars of time and peak memory per timed path, one row of panels per shape."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = out / "bench.png"
    groups = _groups(report)
    sweep = report.get("sweep")
    n_panels = max(1, len(groups)) + (1 if sweep else 0)
    fig, axes = plt.subplots(n_panels, 2, squeeze=False,
                             figsize=(12, 1.2 + 0.55 * max(4, len(report["results"]))
                                      + (3.0 if sweep else 0.0)))
    for row, (shape, op) in enumerate(groups):
        timed = [r for r in report["results"] if r["shape"] == shape and r.get("op", "cross_entropy") == op
                 and r["status"] == "ok" and r.get("time_ms") is not None]
        labels = [f"{r['label']}\n{r['dtype']}" for r in timed]
        colors = [path_color(r["path"]) for r in timed]
        t_scale, t_unit, t_fmt = time_unit(r["time_ms"] for r in timed)
        panels = (("time_ms", t_scale, f"fwd+bwd time ({t_unit})", t_fmt),
                  ("peak_bytes", 2.0**-20, "peak memory (MiB)", ".0f"))
        for col, (key, scale, unit, fmt) in enumerate(panels):
            ax = axes[row][col]
            values = [r[key] * scale for r in timed]
            ax.barh(range(len(values)), values, color=colors)
            ax.set_yticks(range(len(values)), labels, fontsize=8)
            ax.invert_yaxis()
            ax.margins(x=0.15)
            value_axis(ax)
            ax.set_xlabel(unit)
            ax.set_title(f"{shape}, {op}: {unit}", fontsize=9)
            for i, v in enumerate(values):
                ax.text(v, i, f" {v:{fmt}}", va="center", fontsize=8)
            if not values:
                ax.text(0.5, 0.5, "no timed rows", ha="center", transform=ax.transAxes)
    if sweep:
        from .report_sweep import plot_sweep
        plot_sweep(sweep, axes[-1])
    fig.suptitle(f"fusedce bench, {report['device']}: {report['machine']['name']}\n{legend_text()}\n"
                 "time: median fwd+bwd; memory: peak beyond the inputs (methods in bench.json)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
