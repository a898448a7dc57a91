"""The distillation section of ``fusedce bench``'s terminal report (``distill.summarize``'s dict)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def print_table(section: dict, console: Console) -> None:
    """One table: per path the loss, its error and the gradient error vs float64, time, peak memory."""
    meta = section["input"]
    title = (f"distillation (GKD JSD, beta={meta['beta']}, T={meta['temperature']}) on the real input: "
             f"{meta['tokens']} tokens ({meta['scored_tokens']} scored), H={meta['hidden_size']}, "
             f"V={meta['vocab_size']}\nteacher: {meta['teacher']}; student: {meta['student']}")
    table = Table(title=title, title_justify="left")
    for header in ("path", "loss", "loss rel err", "grad rel err", "fwd+bwd ms", "vs stock", "peak MiB",
                   "vs stock", "peak / floor"):
        table.add_column(header, justify="left" if header == "path" else "right")
    for row in section["results"]:
        if row.get("status") != "ok":
            table.add_row(row["label"], f"[red]{row.get('status')}: {row.get('reason', '')}", *[""] * 7)
            continue
        table.add_row(row["label"], f"{row['loss']:.6f}", f"{row['loss_rel_err']:.1e}", f"{row['grad_rel_err']:.1e}",
                      f"{row['time_ms']:.0f}", _x(row.get("time_vs_stock")), _mib(row["peak_bytes"]),
                      _x(row.get("memory_vs_stock")), f"{row['peak_over_floor']:.2f}")
    console.print(table)
    console.print(f"float64 reference loss {section['reference_loss']:.6f}; floor = {section['method']['floor']}; "
                  f"{section['wall_seconds']} s")
