"""The memory sweep's part of the report (``sweep.py`` measures it): a rich table and two PNG panels.

Reads ``report["sweep"]`` only: ``results`` (one row per configuration and path), ``summary`` (stock and
fused side by side with their ratios and targets) and ``method``.
"""
from __future__ import annotations

from rich.table import Table

MIB = 2.0 ** -20
# header, justify; the shapes' sizes go to the caption, so that the table fits 220 columns (the bench's
# width in logs and pipes)
COLUMNS = (
    ("shape", "left"), ("ignored", "right"), ("base\nMiB", "right"), ("stock\nMiB", "right"),
    ("fused\nMiB", "right"), ("memory\nstock/fused", "right"), ("stock\nms", "right"),
    ("fused\nms", "right"), ("time\nstock/fused", "right"), ("Δloss", "right"), ("tiled\nMiB", "right"),
    ("tiled\n/floor", "right"), ("tiled\nms", "right"), ("targets", "left"))


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _mark(target: dict) -> str:
    return {True: "[green]met[/]", False: "[red]MISSED[/]", None: "[yellow]n/a[/]"}[target["met"]]


def sweep_table(report: dict) -> Table:
    """Stock vs fused (chunked and tiled) linear cross-entropy per configuration; failures and methods in
    the caption."""
    sweep, machine = report["sweep"], report["machine"]
    out = Table(title="memory sweep: linear_cross_entropy, stock F.linear + F.cross_entropy vs fusedce "
                      f"(backend='torch'), fp32\n{report['device']}: {machine['name']}",
                title_justify="left", caption_justify="left")
    for name, justify in COLUMNS:
        out.add_column(name, justify=justify, no_wrap=True)
    base = {(r["shape"], r["ignore_fraction"]): r.get("base_rss_bytes") for r in sweep["results"]
            if r["label"] == "stock"}
    for s in sweep["summary"]:
        mem_bytes = (s["stock_peak_bytes"], s["fused_peak_bytes"])
        out.add_row(
            s["shape"], f"{s['ignore_fraction']:.0%}",
            _num(None if base.get((s["shape"], s["ignore_fraction"])) is None
                 else base[(s["shape"], s["ignore_fraction"])] * MIB, ".0f"),
            *(_num(None if b is None else b * MIB, ".0f") for b in mem_bytes),
            _num(s["memory_ratio"], ".1f") + ("x" if s["memory_ratio"] is not None else ""),
            _num(s["stock_ms"], ".0f"), _num(s["fused_ms"], ".0f"),
            _num(s["time_ratio"], ".2f") + ("x" if s["time_ratio"] is not None else ""),
            _num(s["loss_abs_diff"], ".1e"),
            _num(None if s.get("tiled_peak_bytes") is None else s["tiled_peak_bytes"] * MIB, ".0f"),
            _num(s.get("tiled_floor_ratio"), ".2f") + ("x" if s.get("tiled_floor_ratio") is not None else ""),
            _num(s.get("tiled_ms"), ".0f"),
            f"mem {_mark(s['targets']['memory'])}, time {_mark(s['targets']['time'])}, "
            f"tiled {_mark(s['targets'].get('tiled', {'met': None}))}")
    method = sweep["method"]
    sizes = dict.fromkeys(f"{s['shape']}: BT={s['tokens']}, H={s['hidden']}, V={s['vocab']}"
                          for s in sweep["summary"])
    notes = ["; ".join(sizes),
             f"targets (of the memory sweep; shown, not enforced): {method['targets']}",
             f"data: {method['data']}",
             f"stock/fused MiB: {method['memory']}; base MiB: RSS with inputs and .grad buffers",
             f"ms: {method['time']}",
             "Δloss: |stock loss - fused loss|, the two runs' own losses (same seeded data)",
             "tiled: method='tiled' (no logits tensor); /floor: its MiB over the floor, the fp32 gradients "
             "it must return, (V + BT) x H x 4 bytes"]
    reasons = [f"{r['shape']} {r['ignore_fraction']:.0%} {r['label']}: {r.get('reason', r['status'])}"
               for r in sweep["results"] if r["status"] != "ok"]
    load, cores = machine.get("load_average_1min"), machine.get("cpu_cores")
    if load and cores and load > cores:
        notes.append(f"warning: the machine was busy (load average {load} on {cores} cores); "
                     "times are noisy, ratios less so (stock and fused run back to back).")
    cpu = [r["process_cpu_s"] for r in sweep["results"] if r.get("process_cpu_s") is not None]
    if sweep.get("wall_seconds") is not None and cpu:
        notes.append(f"sweep: {sweep['wall_seconds']:.0f} s wall, its processes used {sum(cpu):.0f} CPU "
                     f"seconds on {cores} cores")
    out.caption = "\n".join(notes + reasons)
    return out


def plot_sweep(sweep: dict, axes) -> None:
    """Grouped bars, stock (gray), fused chunked (blue) and tiled (green) per configuration, on ``axes`` =
    (memory, time)."""
    summary = sweep["summary"]
    for ax, (stock_key, fused_key, tiled_key, scale, unit, ratio_key) in zip(axes, (
            ("stock_peak_bytes", "fused_peak_bytes", "tiled_peak_bytes", MIB,
             "peak memory over inputs + .grad (MiB)", "memory_ratio"),
            ("stock_ms", "fused_ms", "tiled_ms", 1.0, "fwd+bwd time (ms)", "time_ratio"))):
        for offset, key, color, name in ((-0.27, stock_key, "tab:gray", "stock"),
                                         (0.0, fused_key, "tab:blue", "fused (chunked)"),
                                         (0.27, tiled_key, "tab:green", "fused (tiled)")):
            values = [0.0 if s.get(key) is None else s[key] * scale for s in summary]
            ax.barh([i + offset for i in range(len(summary))], values, height=0.27, color=color, label=name)
            for i, v in enumerate(values):
                ax.text(v, i + offset, f" {v:.0f}", va="center", fontsize=7)
        labels = [f"{s['shape']}\n{s['ignore_fraction']:.0%} ignored\nstock/fused "
                  + ("-" if s[ratio_key] is None else f"{s[ratio_key]:.2f}x") for s in summary]
        ax.set_yticks(range(len(summary)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.margins(x=0.12)
        ax.set_xlabel(unit)
        ax.set_title(f"memory sweep (fp32, CPU): {unit}", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
