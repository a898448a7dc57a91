"""``fusedce bench``'s RL-precision table: how far each way of computing per-token log-probs and entropy
from a bf16 LM head is from float64, what it holds in memory, and whether a row's result depends on the rest of its
batch."""
from __future__ import annotations

import time
import torch
import torch.nn.functional as F

from . import parity, rl_top_p, rl_verl
from .inputs import IGNORE_INDEX
from .names import path_name

TOKENS = 512
REFERENCE_ROWS = 256
# (batch size, position of the row, chunk_size or None, ignore every other neighbour)
PLACEMENTS = ((2, 1, None, False), (7, 3, None, False), (64, 0, None, False), (64, 63, None, False),
              (65, 64, None, False), (150, 17, None, False), (150, 17, 32, False), (256, 100, None, True),
              (400, 399, None, False), (400, 200, 100, False), (600, 0, None, True), (600, 311, 64, False))
PATHS = {
    "stock-bf16": "stock: bf16 F.linear, fp32 log_softmax",
    "fp32-head-copy": "fp32 copies of hidden + head (TRL cast_lm_head_to_fp32)",
    "trl-kernel": "TRL ChunkedLogProbFunction (bf16)",
    "torch-lce": "torch F.linear_cross_entropy (reduction='none')",
    "fusedce": "fusedce linear_token_log_probs (fp32 logits, default)",
    "fusedce-input": "fusedce linear_token_log_probs (logits_dtype='input')",
    **rl_verl.PATHS,
    **rl_top_p.PATHS,
}


def _stats(logits: torch.Tensor, target: torch.Tensor):
    logp = torch.log_softmax(logits.float(), dim=-1)
    keep = target != IGNORE_INDEX
    lp = logp.gather(1, target.clamp_min(0)[:, None]).squeeze(1).where(keep, 0.0)
    return lp, (-(logp.exp() * logp).sum(-1)).where(keep, 0.0)


def _trl(hidden, weight, target):
    """TRL's kernel has no ignore_index (its trainers drop or mask those rows): every row is computed with
    a valid class and ignored rows are zeroed after, as the other paths give them."""
    from trl.kernels import ChunkedLogProbFunction
    from .peers import TRL_VOCAB_TILE
    keep = target != IGNORE_INDEX
    out = ChunkedLogProbFunction.apply(hidden, weight, None, target.clamp_min(0), 1.0, TRL_VOCAB_TILE, None, 1.0,
                                       ("entropy",))
    return out[0].where(keep, 0.0), out[1].where(keep, 0.0)


def _torch_lce(hidden, weight, target):
    if not hasattr(F, "linear_cross_entropy"):
        raise ImportError("torch.nn.functional.linear_cross_entropy needs torch >= 2.13")
    nll = F.linear_cross_entropy(hidden, weight, target, ignore_index=IGNORE_INDEX, reduction="none")
    return -nll.float(), None


def forward(name: str, hidden, weight, target, **fusedce_options):
    """``(log_probs (N,) fp32, entropy (N,) fp32 or None)`` of path ``name``, differentiable."""
    import fusedce
    if name == "stock-bf16":
        return _stats(F.linear(hidden, weight), target)
    if name == "fp32-head-copy":
        return _stats(F.linear(hidden.float(), weight.float()), target)
    if name == "trl-kernel":
        return _trl(hidden, weight, target)
    if name == "torch-lce":
        return _torch_lce(hidden, weight, target)
    if name in ("fusedce", "fusedce-input"):
        if name == "fusedce-input":
            fusedce_options["logits_dtype"] = "input"
        out = fusedce.linear_token_log_probs(hidden, weight, target, ignore_index=IGNORE_INDEX,
                                             return_entropy=True, **fusedce_options)
        return out.log_probs, out.entropy
    if name in rl_verl.PATHS:
        return rl_verl.forward(name, hidden, weight, target)
    if name in rl_top_p.PATHS:
        return rl_top_p.forward(hidden, weight, target, **fusedce_options)
    raise KeyError(name)


def _objective(lp, ent, up_lp, up_ent):
    total = (lp.where(torch.isfinite(lp), 0.0) * up_lp).sum()   # top-p: -inf for a target outside the set
    return total if ent is None else total + (ent * up_ent).sum()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _path_row(name: str, hidden, weight, target, up, rows, device: str) -> dict:
    from . import harness
    h = hidden.detach()[:8].clone().requires_grad_()
    lp, ent = forward(name, h, weight, target[:8])
    _objective(lp, ent, up[0][:8], up[1][:8]).backward()          # warm-up: imports, first-call set-up
    leaf = hidden.detach().clone().requires_grad_()
    box = {}

    def run():
        _sync(device)
        began = time.perf_counter()
        lp, ent = forward(name, leaf, weight, target)
        _objective(lp, ent, *up).backward()
        _sync(device)
        box["s"] = time.perf_counter() - began
        box["out"] = (lp.detach(), None if ent is None else ent.detach())
    peak, _ = harness.peak_memory(run, device)
    lp, ent = box["out"]
    if name in rl_top_p.PATHS:
        err = rl_top_p.errors(hidden, weight, target, lp, ent, rows)
    else:
        err = parity.linear_token_log_probs(hidden, weight, target, lp, ent, rows, IGNORE_INDEX)
    what = PATHS[name] + (f" ({err['note']})" if err.get("note") else "")
    return {"path": name, "label": path_name(name), "what": what, "status": "ok",
            "log_probs_max_abs_err": err["log_probs_max_abs_err"],
            "entropy_max_abs_err": err["entropy_max_abs_err"], "fwd_bwd_s": box["s"], "time_ms": box["s"] * 1e3,
            "peak_bytes": peak}


def _one_placement(name: str, hidden, weight, target, r: int, placement, **options):
    """``(log_prob, entropy, grad_hidden row)`` of row ``r`` of the real rows in one placement."""
    size, pos, chunk_size, ignore_neighbours = placement
    others = [i for i in range(hidden.shape[0]) if i != r][: max(size - 1, 0)]
    pos = min(pos, len(others))   # fewer rows than the placement asks (a small input): the row goes last
    order = others[:pos] + [r] + others[pos:]
    h = hidden.detach()[order].clone().requires_grad_()
    t = target[order].clone()
    if ignore_neighbours:
        t[torch.arange(len(order)) % 2 == (pos + 1) % 2] = IGNORE_INDEX
    if chunk_size is not None:
        options = {**options, "chunk_size": chunk_size}
    lp, ent = forward(name, h, weight, t, **options)
    (lp.sum() + ent.sum()).backward()
    return lp[pos].detach(), ent[pos].detach(), h.grad[pos].detach()


def placements_changed(name: str, hidden, weight, target, r: int, **options) -> int:
    """How many of ``PLACEMENTS`` give row ``r`` another log-prob, entropy or hidden-gradient row (any bit)
    than the batch of one."""
    alone = _one_placement(name, hidden, weight, target, r, (1, 0, None, False), **options)
    changed = 0
    for placement in PLACEMENTS:
        got = _one_placement(name, hidden, weight, target, r, placement, **options)
        changed += int(any(not torch.equal(a, b) for a, b in zip(alone, got)))
    return changed


# On a CPU without AMX / AVX512-BF16 torch emulates bf16 GEMMs (the backward's g @ W: ~100x fp32's time):
# the stock bf16 path's 12 placements (2,758 rows of bf16 forward+backward) alone took minutes of CPU there.
NO_STOCK_PLACEMENTS = ("stock bf16 placements not counted on this CPU (no AMX, no AVX512-BF16: torch's bf16 "
                       "GEMMs are emulated, minutes for the 12 placements); fusedce's are")


def _cpu_has_bf16_units() -> bool:
    from .machine import cpu_capabilities
    caps = cpu_capabilities()
    return bool(caps["amx"] or caps["avx512_bf16"])


def load(source_file: str, tokens: int, device: str):
    data = torch.load(source_file, map_location="cpu", weights_only=True)
    hidden = data["hidden"][:tokens].to(torch.bfloat16).contiguous().to(device)
    return hidden, data["weight"].to(torch.bfloat16).contiguous().to(device), data["target"][:tokens].to(device)


def measure(spec: dict) -> dict:
    """Every path's row, then the placement counts, in this (fresh) process. Never raises on a path error."""
    device = spec["device"]
    hidden, weight, target = load(spec["source_file"], spec.get("tokens", TOKENS), device)
    gen = torch.Generator().manual_seed(0)
    up = tuple(torch.randn(target.shape, generator=gen).to(device) for _ in range(2))
    rows = parity.subset_rows(target, REFERENCE_ROWS, IGNORE_INDEX)
    results = []
    for name in PATHS:
        try:
            results.append(_path_row(name, hidden, weight, target, up, rows, device))
        except ImportError as exc:
            results.append({"path": name, "label": path_name(name), "what": PATHS[name],
                            "status": "unavailable", "reason": f"{type(exc).__name__}: {exc}"})
        except Exception as exc:  # noqa: BLE001 - reported in the table
            results.append({"path": name, "label": path_name(name), "what": PATHS[name], "status": "error",
                            "reason": f"{type(exc).__name__}: {exc}"})
    r = int((target != IGNORE_INDEX).nonzero()[0])
    placements = {}
    counted = ((path_name("stock-bf16"), "stock-bf16", {}),) if spec.get("stock_placements", True) else ()
    for label, name, options in counted + ((path_name("fusedce"), "fusedce", {}),
                                           (f"{path_name('fusedce')} batch_invariant=True", "fusedce",
                                            {"batch_invariant": True})):
        placements[label] = placements_changed(name, hidden, weight, target, r, **options)
    n, h = hidden.shape
    notes = [] if spec.get("stock_placements", True) else [NO_STOCK_PLACEMENTS]
    return {"status": "ok", "results": results, "placements_changed": placements, "notes": notes,
            "placements": len(PLACEMENTS), "row": r,
            "input": {"tokens": n, "scored_tokens": int((target != IGNORE_INDEX).sum()), "hidden_size": h,
                      "vocab_size": weight.shape[0], "dtype": "bfloat16", "reference_rows": int(rows.numel()),
                      "threads": torch.get_num_threads()},
            "method": {"error": "max |x - x64| over the reference rows, float64 on the same bf16 values",
                       "time": "one fwd+bwd after 1 warm-up (8 rows: imports, first-call set-up), "
                               "time.perf_counter",
                       "memory": "peak beyond the inputs of that fwd+bwd (harness.peak_memory)",
                       "placements": "batch sizes 2-600, positions, chunk_size, ignored neighbours vs the "
                                     "batch of one: log-prob, entropy or hidden-gradient row differs in a bit"}}


def job(source_file: str, device: str) -> tuple:
    """(row, worker spec, extra env) for ``command._measure_all``; on a CPU without bf16 units the stock
    bf16 placements are not counted (``NO_STOCK_PLACEMENTS``)."""
    spec = {"rl": True, "device": device, "source_file": source_file, "tokens": TOKENS,
            "stock_placements": device != "cpu" or _cpu_has_bf16_units()}
    return {"label": "RL precision (log-probs, entropy, batch invariance)"}, spec, None


def describe(row: dict) -> str:
    return row["label"]
