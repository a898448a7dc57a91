"""Axis conventions shared by the panels of ``bench.png``: times always in ms and memory in MiB (one unit
per quantity in every panel and table, as ``legend`` says), and value axes with few, thousands-separated
ticks (so that "80000100000120000" never runs together, and 57,282 ms stays readable without seconds)."""
from __future__ import annotations

MAX_TICKS = 5


def value_axis(ax) -> None:
    """At most ``MAX_TICKS`` ticks on ``ax``'s x axis, labelled ``12,000`` style."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(MAX_TICKS))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:,.10g}"))
