"""The memory sweep's part of the report (``sweep.py`` measures it): a rich table and two PNG panels."""
from __future__ import annotations

from rich.table import Table

from . import legend
from .goals import interval_text, verdict_mark
from .colors import path_color
from .machine import busy_warning, header
from .names import TORCH_LCE, TRL, path_name
from .plot_axes import value_axis

MIB = 2.0 ** -20
# One line per configuration and path; the shapes' sizes go to the caption, so that the table fits 220
# columns (the bench's width in logs and pipes).
COLUMNS = (
    ("shape", "left"), ("ignored", "right"), ("path", "left"), ("MiB", "right"), ("peak/floor", "right"),
    ("ms", "right"), ("stock/path\nmemory", "right"), ("stock/path\ntime", "right"),
    ("Δloss\nvs stock", "right"), ("status", "left"), ("targets", "left"))


def _num(value, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def _mark(target: dict) -> str:
    return verdict_mark(target)


def _targets(s: dict) -> list[str]:
    """The configuration's verdicts, one line each (a line per path row of the table); each time verdict
    with the interval of runs it rests on (``goals.ratio_verdict``)."""
    t, goals = s["targets"], s.get("peer_goals", {})
    time = t["time"]
    lines = [f"vs stock: mem {_mark(t['memory'])}; tiled/floor {_mark(t.get('tiled', {'met': None}))}",
             f"vs stock: time {_mark(time)}" + (f", stock/chunked {time['detail']}" if time.get("detail") else "")]
    names = {"chunked_leaner": "chunked <= leanest peer", "tiled_least": "tiled least"}
    if goals:
        lines.append("vs peers: " + ", ".join(f"{names[k]} {_mark(g)}" for k, g in goals.items() if k in names))
        if "chunked_faster" in goals:
            g = goals["chunked_faster"]
            lines.append(f"vs peers: chunked fastest {_mark(g)}" + "".join(
                f", {label}/chunked {interval_text(judged)}" for label, judged in g.get("intervals", {}).items()))
    return lines


def sweep_table(report: dict) -> Table:
    """Every path of every configuration (stock, fusedce chunked and tiled, the peers) with its memory,
    time, ratios to stock and loss difference; targets and goals per configuration; failures and methods
    in the caption."""
    sweep, machine = report["sweep"], report["machine"]
    out = Table(title="memory sweep: linear_cross_entropy, stock F.linear + F.cross_entropy, fusedce "
                      f"(backend='torch', chunked and tiled) and the peers {TORCH_LCE} and {TRL}, fp32\n"
                      f"{header(report['device'], machine)}", title_justify="left", caption_justify="left")
    for name, justify in COLUMNS:
        out.add_column(name, justify=justify, no_wrap=True)
    for s in sweep["summary"]:
        rows = [r for r in sweep["results"] if (r["shape"], r["ignore_fraction"]) == (s["shape"], s["ignore_fraction"])]
        stock = next((r for r in rows if r["path"] == "linear-torch" and r["status"] == "ok"), None)
        targets = _targets(s)
        for i, r in enumerate(rows):
            ok = r["status"] == "ok"
            peak, ms = (r.get("peak_bytes"), r.get("time_ms")) if ok else (None, None)
            out.add_row(
                s["shape"] if i == 0 else "", f"{s['ignore_fraction']:.0%}" if i == 0 else "", path_name(r["path"]),
                _num(None if peak is None else peak * MIB, ".0f"),
                _num(None if peak is None else peak / s["floor_bytes"], ".2f", "x"), _num(ms, ".0f"),
                _num(None if not (stock and peak) else stock["peak_bytes"] / peak, ".1f", "x"),
                _num(None if not (stock and ms) else stock["time_ms"] / ms, ".2f", "x"),
                _num(None if not (stock and ok) else abs(r["loss"] - stock["loss"]), ".1e"),
                r["status"], targets[i] if i < len(targets) else "",
                style={"error": "red", "unavailable": "yellow"}.get(r["status"]))
        out.add_section()
    method = sweep["method"]
    sizes = dict.fromkeys(f"{s['shape']}: BT={s['tokens']}, H={s['hidden']}, V={s['vocab']}"
                          for s in sweep["summary"])
    notes = ["; ".join(sizes), f"data: {method['data']}"] + legend.lines(legend.of_table(out), {
        "shape": "the configuration (sizes above)",
        "ignored": "share of the targets set to ignore_index (-100)",
        "MiB": method["memory"],
        "peak/floor": "the floor here: the fp32 gradients a loss must return, (V + BT) x H x 4 bytes",
        "ms": method["time"],
        "Δloss vs stock": "|loss - stock's loss|, absolute, in nats: the runs' own losses on the same seeded data",
        "targets": f"of the memory sweep (shown, not enforced): {method['targets']}; vs peers: fusedce chunked "
                   "faster than every peer and no more memory than the leanest, tiled the least memory of all "
                   "paths; a time verdict gives the medians' ratio, then its interval from the extreme runs "
                   "(slowest against fastest) and the runs it rests on: met / MISSED only when the whole interval "
                   "is on one side of the goal, else inconclusive (these few runs cannot tell)"})
    resolved = list(dict.fromkeys(f"{r['shape']}: {TORCH_LCE}'s 'auto' resolved to " + ", ".join(
        f"{k}={v}" for k, v in r["extra"].items()) for r in sweep["results"]
        if r["path"] == "linear-torch-lce" and r.get("extra")))
    reasons = [f"{r['shape']} {r['ignore_fraction']:.0%} {path_name(r['path'])}: {r.get('reason', r['status'])}"
               for r in sweep["results"] if r["status"] != "ok"]
    cores, busy = machine.get("cpu_cores"), busy_warning(machine)
    if busy:
        notes.append(busy + ", ratios less so (the paths of a configuration run back to back).")
    cpu = [r["process_cpu_s"] for r in sweep["results"] if r.get("process_cpu_s") is not None]
    if sweep.get("wall_seconds") is not None and cpu:
        notes.append(f"sweep: {sweep['wall_seconds']:.0f} s wall, its processes used {sum(cpu):.0f} CPU "
                     f"seconds on {cores} cores")
    out.caption = "\n".join(notes + resolved + reasons)
    return out


def plot_sweep(sweep: dict, axes) -> None:
    """Grouped bars per configuration, one per path, each path in its ``colors.path_color`` (as in the
    other panels), on ``axes`` = (memory, time); times in ms, as every panel and table."""
    summary = sweep["summary"]
    labels = list(dict.fromkeys((path_name(r["path"]), r["path"]) for r in sweep["results"]))
    height = 0.8 / max(1, len(labels))
    # time on a log axis: one slow row (a peer at Llama-3's V: minutes) would flatten every other bar
    panels = (("peak_bytes", MIB, "peak memory over inputs + .grad (MiB)", ",.0f", False),
              ("time_ms", 1.0, "fwd+bwd time (ms), log scale", ",.0f", True))
    for ax, (key, scale, unit, fmt, log) in zip(axes, panels):
        for j, (label, path) in enumerate(labels):
            offset = (j - (len(labels) - 1) / 2) * height
            values = []
            for s in summary:
                row = next((r for r in sweep["results"] if r["path"] == path and r["status"] == "ok"
                            and (r["shape"], r["ignore_fraction"]) == (s["shape"], s["ignore_fraction"])), None)
                values.append(0.0 if row is None or row.get(key) is None else row[key] * scale)
            if log:   # a bar from 1 ms; a missing row (0) draws nothing
                starts = [1.0] * len(values)
                ax.barh([i + offset for i in range(len(summary))], [max(v - 1.0, 0.0) for v in values],
                        left=starts, height=height, color=path_color(path), label=label)
            else:
                ax.barh([i + offset for i in range(len(summary))], values, height=height,
                        color=path_color(path), label=label)
            for i, v in enumerate(values):
                if v > 0 or not log:
                    ax.text(v, i + offset, f" {v:{fmt}}", va="center", fontsize=6)
        ax.set_yticks(range(len(summary)), [f"{s['shape']}\n{s['ignore_fraction']:.0%} ignored" for s in summary],
                      fontsize=8)
        ax.invert_yaxis()
        if log:
            from matplotlib.ticker import FuncFormatter, NullFormatter
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:,.10g}"))
            drawn = [r[key] * scale for r in sweep["results"] if r.get("status") == "ok" and r.get(key)]
            if drawn:
                ax.set_xlim(left=min(drawn) / 3, right=max(drawn) * 8)
        else:
            ax.margins(x=0.15)
            value_axis(ax)
        ax.set_xlabel(unit)
        ax.set_title(f"memory sweep (fp32, CPU): {unit}", fontsize=9)
    # one legend, beside the panels, so that no bar is hidden under it
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
