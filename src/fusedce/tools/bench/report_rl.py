"""The RL-precision section of ``fusedce bench``'s terminal report (``rl_precision.measure``'s dict)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from . import legend
from .names import path_name

HEADERS = ("path", "log-prob err", "entropy err", "ms", "MiB", "status")


def _err(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def _ms(row: dict) -> str:
    ms = row.get("time_ms")
    if ms is None and row.get("fwd_bwd_s") is not None:   # a bench.json from before time_ms
        ms = row["fwd_bwd_s"] * 1e3
    return "-" if ms is None else f"{ms:.0f}"


def table(section: dict, machine_line: str = "") -> Table:
    """Per path: log-prob and entropy error vs float64, fwd+bwd time, peak memory beyond the inputs;
    ``machine_line`` (``machine.header``) under the title."""
    meta, method = section["input"], section["method"]
    title = (f"RL precision on the real input, bf16 hidden + head: {meta['tokens']} tokens "
             f"({meta['scored_tokens']} scored), H={meta['hidden_size']}, V={meta['vocab_size']}"
             + (f"\n{machine_line}" if machine_line else ""))
    out = Table(title=title, title_justify="left", caption_justify="left")
    for header in HEADERS:
        out.add_column(header, justify="left" if header in ("path", "status") else "right")
    for row in section["results"]:
        name = path_name(row["path"])
        if row.get("status") != "ok":
            out.add_row(name, "", "", "", "", f"[red]{row.get('status')}: {row.get('reason', '')}")
            continue
        out.add_row(name, _err(row["log_probs_max_abs_err"]), _err(row["entropy_max_abs_err"]), _ms(row),
                    f"{row['peak_bytes'] / 2**20:.0f}", "ok")
    paths = "; ".join(f"{path_name(r['path'])} = {r['what']}" for r in section["results"] if r.get("what"))
    error = (f"{method['error']}, absolute, in nats, on {meta['reference_rows']} rows")
    out.caption = "\n".join(([f"paths: {paths}"] if paths else []) + legend.lines(HEADERS, {
        "log-prob err": f"per-token log-prob error: {error}",
        "entropy err": f"per-token entropy error: {error}; '-': the path returns no entropy",
        "ms": method["time"], "MiB": method["memory"]}))
    return out


def print_table(section: dict, console: Console, machine_line: str = "") -> None:
    """The table (``machine_line`` under its title), then the batch-invariance line."""
    if section.get("status") != "ok":
        console.print(f"[red]RL precision: {section.get('status')}: {section.get('reason', '')}")
        return
    console.print(table(section, machine_line))
    changed = ", ".join(f"{label} {n}" for label, n in section["placements_changed"].items())
    console.print(f"batch invariance: placements (of {section['placements']}: {section['method']['placements']}) "
                  f"that change row {section['row']}'s result: {changed}; {section['input']['threads']} threads.")
    for note in section.get("notes") or []:
        console.print(f"note: {note}.")
