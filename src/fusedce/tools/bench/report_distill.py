"""The distillation section of ``fusedce bench``'s terminal report (``distill.summarize``'s dict): the
GKD JSD table and the soft-target cross-entropy table, each with its legend."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from . import legend
from .names import path_name

HEADERS = ("path", "loss", "loss rel", "grad rel", "ms", "stock/path\ntime", "MiB", "stock/path\nmemory",
           "peak/floor", "status")


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _legend(section: dict, reference: str) -> list[str]:
    method = section["method"]
    times = dict.fromkeys(r["method"]["time"] for r in section["results"] if r.get("method", {}).get("time"))
    paths = "; ".join(f"{path_name(r['path'])} = {r['what']}" for r in section["results"] if r.get("what"))
    return ([f"paths: {paths}"] if paths else []) + legend.lines(HEADERS, {
        "loss": f"the path's loss (nats); {reference} {section['reference_loss']:.6f}",
        "loss rel": "|loss - loss64| / |loss64|, relative to the float64 reference",
        "grad rel": "||g - g64|| / ||g64||, worst of the student's hidden and head gradients",
        "ms": "; ".join(times) or "not measured",
        "MiB": method["memory"],
        "peak/floor": f"the floor here: {method['floor']}",
    })


def _rows_table(title: str, section: dict, reference: str) -> Table:
    table = Table(title=title, title_justify="left", caption_justify="left")
    for header in HEADERS:
        table.add_column(header, justify="left" if header in ("path", "status") else "right")
    for row in section["results"]:
        name = path_name(row["path"])
        if row.get("status") != "ok":
            colour = "yellow" if row.get("status") == "unavailable" else "red"
            table.add_row(name, *[""] * 8, f"[{colour}]{row.get('status')}: {row.get('reason', '')}")
            continue
        table.add_row(name, f"{row['loss']:.6f}", f"{row['loss_rel_err']:.1e}", f"{row['grad_rel_err']:.1e}",
                      f"{row['time_ms']:.0f}", _x(row.get("stock_over_path_time")), _mib(row["peak_bytes"]),
                      _x(row.get("stock_over_path_memory")), f"{row['peak_over_floor']:.2f}", "ok")
    table.caption = "\n".join(_legend(section, reference) + [f"measured in {section['wall_seconds']} s"])
    return table


def print_table(section: dict, console: Console, machine_line: str = "") -> None:
    """Per path the loss, its error and the gradient error vs float64, time, peak memory: the GKD JSD
    table, then (``section["soft_ce"]``) the soft-target cross-entropy table; ``machine_line``
    (``machine.header``) under each title."""
    below = f"\n{machine_line}" if machine_line else ""
    meta = section["input"]
    if meta is not None:
        title = (f"distillation (GKD JSD, beta={meta['beta']}, T={meta['temperature']}) on the real input: "
                 f"{meta['tokens']} tokens ({meta['scored_tokens']} scored), H={meta['hidden_size']}, "
                 f"V={meta['vocab_size']}\nteacher: {meta['teacher']}; student: {meta['student']}{below}")
        console.print(_rows_table(title, section, "float64 reference JSD"))
    soft = section.get("soft_ce")
    if soft is not None:
        meta = soft["input"]
        title = (f"distillation, soft-target linear cross-entropy on the real input: {meta['tokens']} tokens, "
                 f"H={meta['hidden_size']}, V={meta['vocab_size']}\ntarget: {meta['target']}; "
                 f"student: {meta['student']}{below}")
        console.print(_rows_table(title, soft, "float64 reference loss"))
