"""The distillation section of ``fusedce bench``'s terminal report (``distill.summarize``'s dict)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _rows_table(title: str, section: dict) -> Table:
    table = Table(title=title, title_justify="left")
    for header in ("path", "loss", "loss rel err", "grad rel err", "fwd+bwd ms", "vs stock", "peak MiB",
                   "vs stock", "peak / floor"):
        table.add_column(header, justify="left" if header == "path" else "right")
    for row in section["results"]:
        if row.get("status") != "ok":
            colour = "yellow" if row.get("status") == "unavailable" else "red"
            table.add_row(row["label"], f"[{colour}]{row.get('status')}: {row.get('reason', '')}", *[""] * 7)
            continue
        table.add_row(row["label"], f"{row['loss']:.6f}", f"{row['loss_rel_err']:.1e}", f"{row['grad_rel_err']:.1e}",
                      f"{row['time_ms']:.0f}", _x(row.get("time_vs_stock")), _mib(row["peak_bytes"]),
                      _x(row.get("memory_vs_stock")), f"{row['peak_over_floor']:.2f}")
    return table


def _footer(section: dict) -> str:
    return (f"float64 reference loss {section['reference_loss']:.6f}; floor = {section['method']['floor']}; "
            f"{section['wall_seconds']} s")


def print_table(section: dict, console: Console) -> None:
    """Per path the loss, its error and the gradient error vs float64, time, peak memory: the GKD JSD
    table, then (``section["soft_ce"]``) the soft-target cross-entropy table."""
    meta = section["input"]
    if meta is not None:
        title = (f"distillation (GKD JSD, beta={meta['beta']}, T={meta['temperature']}) on the real input: "
                 f"{meta['tokens']} tokens ({meta['scored_tokens']} scored), H={meta['hidden_size']}, "
                 f"V={meta['vocab_size']}\nteacher: {meta['teacher']}; student: {meta['student']}")
        console.print(_rows_table(title, section))
        console.print(_footer(section))
    soft = section.get("soft_ce")
    if soft is not None:
        meta = soft["input"]
        title = (f"distillation, soft-target linear cross-entropy on the real input: {meta['tokens']} tokens, "
                 f"H={meta['hidden_size']}, V={meta['vocab_size']}\ntarget: {meta['target']}; "
                 f"student: {meta['student']}")
        console.print(_rows_table(title, soft))
        console.print(_footer(soft))
