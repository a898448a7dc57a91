"""The RL-precision section of ``fusedce bench``'s terminal report (``rl_precision.measure``'s dict)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _err(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def print_table(section: dict, console: Console) -> None:
    """One table (per path: log-prob and entropy error vs float64, fwd+bwd time, peak memory beyond the
    inputs), then the batch-invariance line."""
    if section.get("status") != "ok":
        console.print(f"[red]RL precision: {section.get('status')}: {section.get('reason', '')}")
        return
    meta = section["input"]
    title = (f"RL precision on the real input, bf16 hidden + head: {meta['tokens']} tokens "
             f"({meta['scored_tokens']} scored), H={meta['hidden_size']}, V={meta['vocab_size']}; errors are "
             f"max |x - x64| (nats) on {meta['reference_rows']} rows, float64 of the same bf16 values")
    table = Table(title=title, title_justify="left")
    for header in ("path", "log-prob err", "entropy err", "fwd+bwd s", "peak MiB"):
        table.add_column(header, justify="left" if header == "path" else "right")
    for row in section["results"]:
        if row.get("status") != "ok":
            table.add_row(row["label"], f"[red]{row.get('status')}: {row.get('reason', '')}", "", "", "")
            continue
        table.add_row(row["label"], _err(row["log_probs_max_abs_err"]), _err(row["entropy_max_abs_err"]),
                      f"{row['fwd_bwd_s']:.2f}", f"{row['peak_bytes'] / 2**20:.0f}")
    console.print(table)
    changed = ", ".join(f"{label} {n}" for label, n in section["placements_changed"].items())
    console.print(f"batch invariance: placements (of {section['placements']}: {section['method']['placements']}) "
                  f"that change row {section['row']}'s result: {changed}; {meta['threads']} threads. "
                  f"Entropy '-': the path has none.")
