"""fusedce against its peers (``peers.py``: PyTorch's ``F.linear_cross_entropy``, TRL's fused head) on
the same inputs in the same run: the goals the bench reports (shown, never enforced).

- ``chunked faster``: fusedce's chunked path (``method="chunked"``) takes less time than every peer;
- ``chunked leaner``: its peak memory is at most the leanest peer's;
- ``tiled least``: ``method="tiled"`` has the least peak memory of every path measured (stock, chunked,
  the peers).

Each goal is ``{"want": text, "met": True | False | None, "detail": text}``; None when a row it needs
failed or is missing (an unavailable peer is left out; with no peer at all the peer goals are None).
"""
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


def _goal(key: str, met, detail: str) -> dict:
    return {"want": WANT[key], "met": met, "detail": detail}


def versus_peers(chunked: Optional[dict], tiled: Optional[dict], peers: dict, others: dict) -> dict:
    """The three goals from result rows (dicts with ``status``, ``time_ms``, ``peak_bytes``):
    ``chunked`` / ``tiled`` fusedce's rows, ``peers`` {label: row}, ``others`` {label: row} (stock...)."""
    peers = {label: row for label, row in peers.items() if _ok(row)}
    out = {}
    if not _ok(chunked) or not peers:
        out["chunked_faster"] = _goal("chunked_faster", None, "no measured chunked row or no peer")
        out["chunked_leaner"] = _goal("chunked_leaner", None, "no measured chunked row or no peer")
    else:
        slowest_ratio = min(row["time_ms"] / chunked["time_ms"] for row in peers.values())
        leanest = min(peers, key=lambda label: peers[label]["peak_bytes"])
        out["chunked_faster"] = _goal(
            "chunked_faster", slowest_ratio > 1.0,
            f"{chunked['time_ms']:.0f} ms; " + ", ".join(
                f"{label} {row['time_ms']:.0f} ms ({row['time_ms'] / chunked['time_ms']:.2f}x)"
                for label, row in peers.items()))
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
