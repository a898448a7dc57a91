"""Axis conventions shared by the panels of ``bench.png``: times in seconds once they reach 10 s, and
value axes with few, thousands-separated ticks (so that "80000100000120000" never runs together)."""
from __future__ import annotations

SECONDS_FROM_MS = 10_000   # a panel whose longest time is at least this many ms is drawn in seconds
MAX_TICKS = 5


def time_unit(times_ms) -> tuple[float, str, str]:
    """``(scale, unit, fmt)`` for a panel of times given in ms: ``value_ms * scale`` in ``unit``,
    labelled with ``fmt`` (seconds with one decimal at 10 s and more, else whole milliseconds)."""
    longest = max((t for t in times_ms if t is not None), default=0.0)
    return (1e-3, "s", ".1f") if longest >= SECONDS_FROM_MS else (1.0, "ms", ".0f")


def value_axis(ax) -> None:
    """At most ``MAX_TICKS`` ticks on ``ax``'s x axis, labelled ``12,000`` style."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(MAX_TICKS))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:,.10g}"))
