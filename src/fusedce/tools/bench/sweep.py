"""The CPU memory sweep of ``fusedce bench``: the LM head + loss, stock against fused, at training shapes, each
configuration measured in a fresh process (``harness.run_isolated``)."""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from . import goals, harness
from .inputs import Inputs
from .paths import BenchPath


@dataclass(frozen=True)
class SweepShape:
    name: str
    tokens: int   # BT
    hidden: int   # H
    vocab: int    # V


SHAPES = (
    SweepShape("smollm2", 4096, 576, 49152),         # SmolLM2-135M's LM head
    SweepShape("llama3-vocab", 4096, 256, 128256),   # Llama-3's vocabulary, H cut to 256 to fit a CPU
)
IGNORE_FRACTIONS = (0.0, 0.5)
STOCK, FUSED, TILED = "linear-torch", "linear-fusedce-torch", "linear-fusedce-torch-tiled"
TORCH_LCE, TRL = "linear-torch-lce", "linear-trl"    # the peers (``peers.py``)
LABELS = ((STOCK, "stock"), (FUSED, "fused"), (TILED, "tiled"), (TORCH_LCE, "torch-lce"), (TRL, "trl"))
PEERS = ("torch-lce", "trl")
WEIGHT_STD = 0.02
SEED = 0
REPEATS = 2   # 5 paths x 4 configurations, each 1 + REPEATS fwd+bwd: ~7 min of the bench on 2 quiet cores

# (ignore fraction -> test on the ratios stock / fusedce chunked ("fused" in the rows' labels), as text and
# as a predicate)
MEMORY_TARGET = ("stock/chunked >= 3", lambda ratio: ratio >= 3.0)
# (text, threshold, strict): judged on the runs' spread (``goals.ratio_verdict``), never on the medians alone
TIME_TARGETS = {
    0.0: ("stock/chunked >= 1/1.10 (chunked <= 1.10x stock)", 1 / 1.10, False),
    0.5: ("stock/chunked > 1 (chunked faster)", 1.0, True),
}
# method="tiled": its peak within 1.5x of the floor, the gradients the loss must return
TILED_TARGET = ("tiled/floor <= 1.5", lambda ratio: ratio <= 1.5)
TARGETS = ("peak memory: fusedce chunked at least 3x under stock at every shape; time: chunked no worse than "
           "1.10x stock at 0% ignored, faster than stock at 50% ignored; method='tiled': peak within 1.5x "
           "of the floor (V + BT) x H x 4 bytes")


def floor_bytes(tokens: int, hidden: int, vocab: int) -> int:
    """The loss's least memory beyond its inputs and ``.grad`` buffers: the fp32 gradients it returns
    (weight V x H and hidden BT x H) before autograd adds them into ``.grad``."""
    return (vocab + tokens) * hidden * 4
METHOD = {
    "data": f"fp32, seeded: hidden ~ N(0, 1), weight ~ N(0, 1) * {WEIGHT_STD}, targets uniform, the "
            "ignored fraction at random positions",
    "memory": "peak RSS during one fwd+bwd minus RSS once the inputs and zero-filled hidden.grad / "
              "weight.grad exist (autograd accumulates into them in place; checked), fresh process "
              "per configuration",
    "time": "median of {repeats} fwd+bwd, time.perf_counter, after 1 untimed warm-up fwd+bwd (the memory run); "
            ".grad zeroed in place outside the timing",
    "targets": TARGETS,
}


def source(shape: SweepShape, ignore_fraction: float) -> dict:
    """The ``inputs`` source of one configuration."""
    return {"kind": "random", "tokens": shape.tokens, "hidden": shape.hidden, "vocab": shape.vocab,
            "ignore_fraction": ignore_fraction, "weight_std": WEIGHT_STD, "seed": SEED}


def jobs(repeats: int = REPEATS, shapes=None, fractions=None) -> list:
    """(row, worker spec, extra env) per shape x ignored fraction x ``LABELS``, in that order;
    ``shapes`` / ``fractions`` default to ``SHAPES`` / ``IGNORE_FRACTIONS``."""
    out = []
    for shape in SHAPES if shapes is None else shapes:
        for fraction in IGNORE_FRACTIONS if fractions is None else fractions:
            for path, label in LABELS:
                spec = {"sweep": True, "path": path, "mode": "timed", "device": "cpu", "dtype": "float32",
                        "source": source(shape, fraction), "repeats": repeats, "warmup": 0}
                row = {"shape": shape.name, "tokens": shape.tokens, "hidden": shape.hidden,
                       "vocab": shape.vocab, "ignore_fraction": fraction, "path": path, "label": label}
                out.append((row, spec, None))
    return out


def measure(path: BenchPath, inputs: Inputs, repeats: int = REPEATS, warmup: int = 0) -> dict:
    """Peak memory (over inputs + preallocated ``.grad``) and fwd+bwd time of ``path`` on CPU."""
    harness.tiny_run(path, inputs, SEED)
    leaves = {name: getattr(inputs, name) for name in path.op.leaves}
    for tensor in leaves.values():
        tensor.grad = torch.zeros_like(tensor)
    # Held (not just their addresses): a replaced buffer cannot then be freed and its address reused.
    buffers = {name: tensor.grad for name, tensor in leaves.items()}
    run = lambda: harness.forward_backward(path, inputs)  # noqa: E731
    gc.collect()
    with harness.CpuPeakMemory() as mem:
        loss = run()
    in_place = all(t.grad is not None and t.grad.data_ptr() == buffers[n].data_ptr()
                   for n, t in leaves.items())
    norms = {name: float(tensor.grad.norm()) for name, tensor in leaves.items()}
    time_ms, times = harness.median_ms(run, lambda: [t.grad.zero_() for t in leaves.values()], "cpu",
                                       repeats, warmup)
    in_place = in_place and all(t.grad.data_ptr() == buffers[n].data_ptr() for n, t in leaves.items())
    result = {"status": "ok", "loss": float(loss), "grad_norms": norms, "grad_in_place": in_place,
              **({"extra": harness.extra_facts(path, inputs)} if path.extra is not None else {}),
              "peak_bytes": mem.bytes, "peak_rss_bytes": mem.peak, "base_rss_bytes": mem.base,
              "time_ms": time_ms, "times_ms": times,
              "method": {"what": path.method, "memory": mem.method,
                         "time": METHOD["time"].format(repeats=repeats)}}
    if not in_place:
        result.update(status="error", reason="a .grad buffer was replaced instead of accumulated into: "
                                             "the memory baseline does not hold")
    return result


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per shape x ignored fraction: stock and fused side by side, ratios stock / fused, the
    tiled and peer rows' memory and time, whether each target is met (None when a row failed) and the
    goals against the peers (``peer_goals``, ``goals.versus_peers``)."""
    out = []
    keys = dict.fromkeys((r["shape"], r["ignore_fraction"]) for r in rows)
    for shape, fraction in keys:
        pair = {r["label"]: r for r in rows if (r["shape"], r["ignore_fraction"]) == (shape, fraction)}
        stock, fused, tiled = pair.get("stock", {}), pair.get("fused", {}), pair.get("tiled", {})
        ok = stock.get("status") == "ok" and fused.get("status") == "ok"
        entry = {"shape": shape, "ignore_fraction": fraction,
                 **{k: stock.get(k, fused.get(k)) for k in ("tokens", "hidden", "vocab")},
                 "stock_peak_bytes": stock.get("peak_bytes"), "fused_peak_bytes": fused.get("peak_bytes"),
                 "stock_ms": stock.get("time_ms"), "fused_ms": fused.get("time_ms"),
                 "tiled_peak_bytes": tiled.get("peak_bytes"), "tiled_ms": tiled.get("time_ms"),
                 "memory_ratio": None, "time_ratio": None, "loss_abs_diff": None, "tiled_floor_ratio": None}
        entry["floor_bytes"] = floor_bytes(entry["tokens"], entry["hidden"], entry["vocab"])
        tiled_ok = tiled.get("status") == "ok"
        if tiled_ok:
            entry["tiled_floor_ratio"] = tiled["peak_bytes"] / entry["floor_bytes"]
        if ok:
            entry["memory_ratio"] = stock["peak_bytes"] / max(fused["peak_bytes"], 1)
            entry["time_ratio"] = stock["time_ms"] / fused["time_ms"]
            entry["loss_abs_diff"] = abs(stock["loss"] - fused["loss"])
        time_text, threshold, strict = TIME_TARGETS.get(fraction, ("none", 0.0, False))
        judged = goals.ratio_verdict(goals.times(stock), goals.times(fused), threshold, strict) if ok else None
        entry["targets"] = {
            "memory": {"want": MEMORY_TARGET[0],
                       "met": None if not ok else bool(MEMORY_TARGET[1](entry["memory_ratio"]))},
            "time": {"want": time_text, "met": None, "verdict": "n/a"} if not ok else {
                "want": time_text, **judged, "detail": goals.interval_text(judged)},
            "tiled": {"want": TILED_TARGET[0],
                      "met": None if not tiled_ok else bool(TILED_TARGET[1](entry["tiled_floor_ratio"]))},
        }
        for label in PEERS:
            row = pair.get(label, {})
            key = label.replace("-", "_")
            entry[f"{key}_peak_bytes"], entry[f"{key}_ms"] = row.get("peak_bytes"), row.get("time_ms")
            entry[f"{key}_status"] = row.get("status")
        entry["peer_goals"] = goals.versus_peers(
            pair.get("fused"), pair.get("tiled"), {label: pair[label] for label in PEERS if label in pair},
            {"stock": stock} if stock else {})
        out.append(entry)
    return out
