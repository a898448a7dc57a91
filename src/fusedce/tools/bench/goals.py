"""fusedce against its peers (``peers.py``: PyTorch's ``F.linear_cross_entropy``, TRL's fused head) on the same inputs
in the same run: the goals the bench reports (shown, never enforced)."""
from __future__ import annotations

from typing import Optional

WANT = {
    "chunked_faster": "fusedce chunked faster than every peer",
    "chunked_leaner": "fusedce chunked peak memory <= the leanest peer's",
    "tiled_least": "fusedce tiled: the least peak memory of all paths",
}
MIB = 2.0 ** -20


def _ok(row: Optional[dict]) -> bool:
    return bool(row) and row.get("status") == "ok" and row.get("time_ms") is not None \
        and row.get("peak_bytes") is not None


def _goal(key: str, met, detail: str, verdict: Optional[str] = None) -> dict:
    verdict = verdict or {True: "met", False: "MISSED", None: "n/a"}[met]
    return {"want": WANT[key], "met": met, "verdict": verdict, "detail": detail}


def times(row: dict) -> list:
    """Every timed run of ``row`` in ms (``times_ms``), else its one ``time_ms`` (a CUDA median, an old
    result)."""
    return list(row.get("times_ms") or [row["time_ms"]])


def spread(values) -> dict:
    """min / median / max and the count of ``values``."""
    import statistics
    values = sorted(values)
    return {"min": values[0], "median": statistics.median(values), "max": values[-1], "n": len(values)}


def ratio_verdict(numerator, denominator, threshold: float, strict: bool = False) -> dict:
    """The goal ``numerator / denominator >= threshold`` (``> threshold`` if ``strict``) judged on runs: ``numerator``
    / ``denominator`` are the two rows' timed runs (ms)."""
    a, b = spread(numerator), spread(denominator)
    holds = (lambda r: r > threshold) if strict else (lambda r: r >= threshold)  # noqa: E731
    low, high = a["min"] / b["max"], a["max"] / b["min"]
    verdict = "met" if holds(low) else "MISSED" if not holds(high) else "inconclusive"
    return {"ratio": a["median"] / b["median"], "low": low, "high": high, "runs": [a["n"], b["n"]],
            "verdict": verdict, "met": {"met": True, "MISSED": False}.get(verdict)}


def interval_text(judged: dict) -> str:
    """``"1.23x, range 1.10-1.30x over 3 x 3 runs"``: the ratio, its interval and the runs it rests on."""
    runs = " x ".join(str(n) for n in judged["runs"])
    return f"{judged['ratio']:.2f}x, range {judged['low']:.2f}-{judged['high']:.2f}x over {runs} runs"


def _combined(judged: list) -> str:
    """One verdict for "every one of these holds": MISSED if one is missed, inconclusive if one is."""
    verdicts = [j["verdict"] for j in judged]
    return "MISSED" if "MISSED" in verdicts else "inconclusive" if "inconclusive" in verdicts else "met"


def versus_peers(chunked: Optional[dict], tiled: Optional[dict], peers: dict, others: dict) -> dict:
    """The three goals from result rows (dicts with ``status``, ``time_ms``, ``peak_bytes``):
    ``chunked`` / ``tiled`` fusedce's rows, ``peers`` {label: row}, ``others`` {label: row} (stock...)."""
    peers = {label: row for label, row in peers.items() if _ok(row)}
    out = {}
    if not _ok(chunked) or not peers:
        out["chunked_faster"] = _goal("chunked_faster", None, "no measured chunked row or no peer")
        out["chunked_leaner"] = _goal("chunked_leaner", None, "no measured chunked row or no peer")
    else:
        judged = {label: ratio_verdict(times(row), times(chunked), 1.0, strict=True)
                  for label, row in peers.items()}
        verdict = _combined(list(judged.values()))
        own = spread(times(chunked))
        leanest = min(peers, key=lambda label: peers[label]["peak_bytes"])
        out["chunked_faster"] = _goal(
            "chunked_faster", {"met": True, "MISSED": False}.get(verdict),
            f"{chunked['time_ms']:.0f} ms ({own['min']:.0f}-{own['max']:.0f} over {own['n']} runs); " + ", ".join(
                f"{label} {row['time_ms']:.0f} ms ({interval_text(judged[label])})"
                for label, row in peers.items()), verdict)
        out["chunked_faster"]["intervals"] = judged   # {peer: ratio_verdict of peer time / chunked time}
        out["chunked_leaner"] = _goal(
            "chunked_leaner", chunked["peak_bytes"] <= peers[leanest]["peak_bytes"],
            f"{chunked['peak_bytes'] * MIB:.2f} MiB; leanest peer {leanest} "
            f"{peers[leanest]['peak_bytes'] * MIB:.2f} MiB")   # 2 decimals: a miss never reads as a tie
    rest = {label: row for label, row in {**others, **peers, "chunked": chunked}.items() if _ok(row)}
    if not _ok(tiled) or not rest:
        out["tiled_least"] = _goal("tiled_least", None, "no measured tiled row")
    else:
        next_label = min(rest, key=lambda label: rest[label]["peak_bytes"])
        out["tiled_least"] = _goal(
            "tiled_least", tiled["peak_bytes"] <= rest[next_label]["peak_bytes"],
            f"{tiled['peak_bytes'] * MIB:.0f} MiB; next {next_label} {rest[next_label]['peak_bytes'] * MIB:.0f} MiB")
    return out


def real_goals(rows: list[dict], chunked: str, tiled: str) -> list[dict]:
    """One entry per (shape, dtype) of the bench's timed ``linear_cross_entropy`` rows that have a peer:
    ``{"shape", "dtype", "goals"}``; ``chunked`` / ``tiled`` are the fusedce path names."""
    out = []
    timed = [r for r in rows if r.get("op") == "linear_cross_entropy" and r.get("mode") == "timed"]
    for shape, dtype in dict.fromkeys((r["shape"], r["dtype"]) for r in timed):
        group = [r for r in timed if (r["shape"], r["dtype"]) == (shape, dtype)]
        peers = {r["label"]: r for r in group if r.get("peer")}
        if not peers:
            continue
        by_path = {r["path"]: r for r in group}
        others = {r["label"]: r for r in group if not r.get("peer") and r["path"] not in (chunked, tiled)}
        out.append({"shape": shape, "dtype": dtype,
                    "goals": versus_peers(by_path.get(chunked), by_path.get(tiled), peers, others)})
    return out


MARKS = {"met": "[green]met[/]", "MISSED": "[red]MISSED[/]", "inconclusive": "[yellow]inconclusive[/]",
         "n/a": "[yellow]n/a[/]"}


def verdict_mark(goal: dict) -> str:
    """A goal's or target's verdict in rich markup, colored (an old result without ``verdict``: from ``met``)."""
    verdict = goal.get("verdict") or {True: "met", False: "MISSED", None: "n/a"}[goal["met"]]
    return MARKS[verdict]
