"""``bench.png``: the picture of what the tables show, one row of two panels per part of the report."""
from __future__ import annotations

from pathlib import Path

from .colors import legend_text, path_color
from .machine import busy_warning, header
from .names import path_name, row_name
from .plot_axes import value_axis

MIB = 2.0 ** -20
LOG_FLOOR = 1e-12   # a log panel draws an exact 0 here (its number still says 0)
BAR_INCHES, ROW_INCHES = 0.22, 1.0   # figure height per bar, and per row of panels (titles, axis labels)
TITLE_LINE_INCHES = 0.17             # one line of the figure's 9-point title, with its leading
DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
OP_SHORT = {"cross_entropy": "CE", "linear_cross_entropy": "linear CE"}


def _bars(ax, title: str, unit: str, bars: list, fmt: str, log: bool = False) -> None:
    """Horizontal bars ``(label, value, path id)`` on ``ax``, each value written at its bar's end."""
    values = [value for _label, value, _path in bars]
    drawn = [max(v, LOG_FLOOR) if log else v for v in values]
    ax.barh(range(len(bars)), drawn, color=[path_color(path) for _l, _v, path in bars])
    ax.set_yticks(range(len(bars)), [label for label, _v, _p in bars], fontsize=7)
    ax.invert_yaxis()
    if log:   # from a decade under the smallest value, so that every bar shows; no minor tick labels
        from matplotlib.ticker import NullFormatter
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        if drawn:
            ax.set_xlim(left=min(drawn) / 10, right=max(drawn) * 30)
    else:
        ax.margins(x=0.15)
        value_axis(ax)
    ax.set_xlabel(unit)
    ax.set_title(f"{title}: {unit}", fontsize=9)
    for i, (v, d) in enumerate(zip(values, drawn)):
        ax.text(d, i, f" {v:{fmt}}", va="center", fontsize=7)
    if not bars:
        ax.text(0.5, 0.5, "no rows", ha="center", transform=ax.transAxes)


def _main_panels(report: dict) -> list:
    """(title, [(unit, bars, fmt, log), (unit, bars, fmt, log)]) per shape and op, then accuracy."""
    out = []
    groups = list(dict.fromkeys((r["shape"], r.get("op", "cross_entropy")) for r in report["results"]))
    for shape, op in groups:
        timed = [r for r in report["results"] if (r["shape"], r.get("op", "cross_entropy")) == (shape, op)
                 and r["status"] == "ok" and r.get("time_ms") is not None]
        label = lambda r: f"{row_name(r)} {DTYPE_SHORT.get(r['dtype'], r['dtype'])}"  # noqa: E731
        out.append((f"{shape}, {op}",
                    [("fwd+bwd time (ms)", [(label(r), r["time_ms"], r["path"]) for r in timed], ",.0f", False),
                     ("peak memory (MiB)", [(label(r), r["peak_bytes"] * MIB, r["path"]) for r in timed],
                      ",.0f", False)]))
    checked = [r for r in report["results"] if r["status"] == "ok" and r.get("grad_rel_err") is not None]
    if checked:
        label = lambda r: (f"{row_name(r)} {DTYPE_SHORT.get(r['dtype'], r['dtype'])}, {r['shape']} "  # noqa: E731
                           f"{OP_SHORT.get(r.get('op', 'cross_entropy'), r.get('op'))}")
        out.append(("accuracy vs float64",
                    [("grad rel ||g - g64|| / ||g64||", [(label(r), r["grad_rel_err"], r["path"]) for r in checked],
                      ".1e", True),
                     ("|Δloss| (nats)", [(label(r), r["loss_abs_err"], r["path"]) for r in checked
                                         if r.get("loss_abs_err") is not None], ".1e", True)]))
    return out


def _distill_panels(report: dict) -> list:
    section = report.get("distillation")
    if not section:
        return []
    parts = [("GKD JSD", section)] + ([("soft CE", section["soft_ce"])] if section.get("soft_ce") else [])
    rows = [(f"{what}: {path_name(r['path'])}", r) for what, part in parts if part.get("results")
            for r in part["results"] if r.get("status") == "ok"]
    return [("distillation",
             [("fwd+bwd time (ms)", [(label, r["time_ms"], r["path"]) for label, r in rows], ",.0f", False),
              ("peak memory (MiB)", [(label, r["peak_bytes"] * MIB, r["path"]) for label, r in rows],
               ",.0f", False)])]


def _rl_panels(report: dict) -> list:
    section = report.get("rl_precision")
    if not section or section.get("status") != "ok":
        return []
    rows = [r for r in section["results"] if r.get("status") == "ok"]
    return [("RL precision (bf16 head) vs float64",
             [("log-prob max error (nats)", [(path_name(r["path"]), r["log_probs_max_abs_err"], r["path"])
                                             for r in rows], ".1e", True),
              ("entropy max error (nats)", [(path_name(r["path"]), r["entropy_max_abs_err"], r["path"])
                                            for r in rows if r.get("entropy_max_abs_err") is not None],
               ".1e", True)])]


def _paths(node) -> set:
    """Every path id in a report (the ``"path"`` of its rows, wherever they are)."""
    if isinstance(node, dict):
        own = {node["path"]} if isinstance(node.get("path"), str) else set()
        return own.union(*(_paths(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_paths(v) for v in node))
    return set()


def title(report: dict) -> str:
    """The picture's title: machine, colors, methods, and the busy-machine warning when there is one."""
    text = (f"fusedce bench, {header(report['device'], report['machine'])}\n{legend_text(_paths(report))}\n"
            "time: median fwd+bwd (ms); memory: peak beyond the inputs (MiB); errors vs float64 "
            "(methods in bench.json)")
    busy = busy_warning(report["machine"])
    return text + (f"\n{busy}" if busy else "")


def figure(report: dict):
    """The matplotlib figure of ``report`` (Agg), every panel titled by what it shows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _main_panels(report) + _distill_panels(report) + _rl_panels(report)
    sweep = report.get("sweep")
    heights = [max(2, max(len(bars) for _unit, bars, _fmt, _log in pair)) for _title, pair in panels] \
        + ([max(6, len(sweep["results"]))] if sweep else [])
    size = 1.5 + BAR_INCHES * sum(heights) + ROW_INCHES * len(heights)
    fig, axes = plt.subplots(max(1, len(heights)), 2, squeeze=False, figsize=(14, size),
                             gridspec_kw={"height_ratios": [h + ROW_INCHES / BAR_INCHES for h in heights] or [1]})
    for row, (name, pair) in enumerate(panels):
        for col, (unit, bars, fmt, log) in enumerate(pair):
            _bars(axes[row][col], name, unit, bars, fmt, log)
    if sweep:
        from .report_sweep import plot_sweep
        plot_sweep(sweep, axes[-1])
    busy = busy_warning(report["machine"])
    text = title(report)
    fig.suptitle(text, fontsize=9, color="darkred" if busy else "black")
    # the panels below the title's lines (9 pt ~ 0.17 inch each, and a margin), never under them
    fig.tight_layout(rect=(0, 0, 1, 1 - TITLE_LINE_INCHES * (text.count("\n") + 1) / size))
    return fig


def write_png(report: dict, out: Path) -> Path:
    import matplotlib.pyplot as plt

    path = out / "bench.png"
    fig = figure(report)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
