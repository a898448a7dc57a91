"""``fusedce bench``'s distillation row: stock full-logits distillation vs fusedce's ``linear_distillation_loss``
(chunked, tiled) on the real input, each in a fresh process (``worker``)."""
from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from typing import Optional

import torch
import torch.nn.functional as F

from .inputs import IGNORE_INDEX
from .names import path_name

TOKENS = 512          # rows of the real input used (stock: ~1.2 GB of logits and intermediates at V = 49152)
BETA, TEMPERATURE = 0.5, 1.0
NOISE = 0.25          # student head = W + NOISE * std(W) * N(0, 1)
SEED = 0
REPEATS = 2           # timed fwd+bwd per path on CPU, the peak-memory run included (~5-10 s each here)
TIME_METHOD = {"cpu": "median of {repeats} fwd+bwd (the first is the peak-memory run), time.perf_counter",
               "cuda": "triton.testing.do_bench, median, fwd+bwd"}
REFERENCE_ROWS = 128  # rows per float64 chunk of the reference (128 x 49152 x 8 B = 50 MB per logits chunk)
PATHS = {  # name -> (what it runs (display name: ``names.path_name``), fusedce method or None for stock)
    "distill-stock": ("stock: full logits of both + F.kl_div JSD (fp32)", None),
    "distill-fusedce-chunked": ("fusedce linear_distillation_loss (chunked)", "chunked"),
    "distill-fusedce-tiled": ("fusedce linear_distillation_loss (tiled)", "tiled"),
    "distill-trl": ("TRL DistillationTrainer's _chunked_divergence_loss", "trl"),
}


def load(source_file: str, tokens: int, seed: int = SEED) -> dict:
    """Student and teacher tensors (fp32, CPU) of the first ``tokens`` rows of the real input file:
    ``hidden`` (N, H), ``teacher_weight`` (V, H), ``student_weight`` (V, H) (perturbed), ``target`` (N,)."""
    data = torch.load(source_file, map_location="cpu", weights_only=True)
    weight = data["weight"].float()
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed))
    return {"hidden": data["hidden"][:tokens].float().contiguous(), "teacher_weight": weight,
            "student_weight": weight + NOISE * float(weight.std()) * noise,
            "target": data["target"][:tokens].clone()}


def _jsd_rows(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-row generalized JSD from log-probabilities (any float dtype): TRL's ``generalized_jsd_loss``
    recipe (``F.kl_div`` with ``log_target``), beta 0 / 1 the forward / reverse KL."""
    if beta == 0.0:
        return F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1)
    if beta == 1.0:
        return F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
    return (beta * F.kl_div(log_m, log_t, reduction="none", log_target=True)
            + (1 - beta) * F.kl_div(log_m, log_s, reduction="none", log_target=True)).sum(-1)


def stock_loss(hidden, student_weight, teacher_hidden, teacher_weight, target, beta=BETA,
               temperature=TEMPERATURE) -> torch.Tensor:
    """The stock composition: both logits in full, fp32, the formula; mean over the scored rows."""
    z_s = F.linear(hidden, student_weight).float()
    with torch.no_grad():
        z_t = F.linear(teacher_hidden, teacher_weight).float()
    rows = _jsd_rows(torch.log_softmax(z_s / temperature, -1), torch.log_softmax(z_t / temperature, -1), beta)
    valid = target != IGNORE_INDEX
    return torch.where(valid, rows, 0.0).sum() / valid.sum().clamp_min(1)


def trl_loss(hidden, student_weight, teacher_hidden, teacher_weight, target) -> torch.Tensor:
    """TRL 1.16's ``DistillationTrainer`` head + loss on the same rows (mean over the scored rows);
    ``ImportError`` (the row is "unavailable") without that TRL function."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss
    mask = (target != IGNORE_INDEX)[None]
    loss, _entropy, _count = _chunked_divergence_loss(hidden[None], teacher_hidden[None], student_weight,
                                                      teacher_weight, mask, BETA, temperature=TEMPERATURE)
    return loss


def forward(name: str, leaves: dict, data: dict) -> torch.Tensor:
    """The loss of path ``name`` on the student ``leaves`` (hidden, student_weight) and teacher ``data``."""
    method = PATHS[name][1]
    teacher_hidden = data["hidden"]   # the same hidden states, no gradient
    if method is None:
        return stock_loss(leaves["hidden"], leaves["student_weight"], teacher_hidden, data["teacher_weight"],
                          data["target"])
    if method == "trl":
        return trl_loss(leaves["hidden"], leaves["student_weight"], teacher_hidden, data["teacher_weight"],
                        data["target"])
    from fusedce.distill.distillation import linear_distillation_loss
    backend = "torch" if leaves["hidden"].device.type == "cpu" else None
    return linear_distillation_loss(leaves["hidden"], leaves["student_weight"], teacher_hidden,
                                    data["teacher_weight"], data["target"], beta=BETA, temperature=TEMPERATURE,
                                    method=method, backend=backend)


def reference(data: dict) -> dict:
    """Float64 loss and student gradients (``hidden``, ``student_weight``) of the formula, ``REFERENCE_ROWS``
    rows at a time (no N x V float64 tensor)."""
    h = data["hidden"].double()
    w_s, w_t = data["student_weight"].double().requires_grad_(), data["teacher_weight"].double()
    valid = data["target"] != IGNORE_INDEX
    count = max(int(valid.sum()), 1)
    total, grad_h = 0.0, torch.zeros_like(h)
    for start in range(0, h.shape[0], REFERENCE_ROWS):
        rows = slice(start, start + REFERENCE_ROWS)
        h_rows = h[rows].clone().requires_grad_()
        log_s = torch.log_softmax(h_rows @ w_s.T / TEMPERATURE, -1)
        log_t = torch.log_softmax(h[rows] @ w_t.T / TEMPERATURE, -1)
        loss = torch.where(valid[rows], _jsd_rows(log_s, log_t, BETA), 0.0).sum() / count
        loss.backward()
        total += float(loss.detach())
        grad_h[rows] = h_rows.grad
    return {"loss": total, "hidden": grad_h, "student_weight": w_s.grad}


def prepare(source_file: str, tokens: int = TOKENS) -> dict:
    """The float64 reference, saved to a temporary file for the workers; returns what ``jobs`` needs.
    ``cleanup`` removes the file."""
    data = load(source_file, tokens)
    ref = reference(data)
    handle, path = tempfile.mkstemp(prefix="fusedce-distill-ref-", suffix=".pt")
    os.close(handle)
    torch.save(ref, path)
    scored = int((data["target"] != IGNORE_INDEX).sum())
    n, h = data["hidden"].shape
    return {"source_file": source_file, "tokens": n, "reference_file": path, "reference_loss": ref["loss"],
            "input": {"tokens": n, "scored_tokens": scored, "hidden_size": h,
                      "vocab_size": data["teacher_weight"].shape[0], "beta": BETA, "temperature": TEMPERATURE,
                      "teacher": "SmolLM2-135M's own hidden states and LM head (real input)",
                      "student": f"the same hidden states through W + {NOISE} * std(W) * N(0, 1) (seed {SEED})"}}


def cleanup(prepared: dict) -> None:
    try:
        os.remove(prepared["reference_file"])
    except OSError:
        pass


def jobs(prepared: dict, device: str, repeats: int = REPEATS, names: Optional[list] = None) -> list:
    """(row, worker spec, extra env) per path, for ``command._measure_all`` / ``harness.run_isolated``."""
    out = []
    for name in names or list(PATHS):
        spec = {"distill": True, "path": name, "device": device, "source_file": prepared["source_file"],
                "tokens": prepared["tokens"], "reference_file": prepared["reference_file"], "repeats": repeats}
        row = {"path": name, "label": path_name(name), "what": PATHS[name][0], "baseline": PATHS[name][1] is None}
        out.append((row, spec, None))
    return out


def describe(row: dict) -> str:
    return f"distillation: {row['label']}"


def measure(spec: dict) -> dict:
    """One path in this (fresh) process: a tiny warm-up, the first full forward+backward's peak memory,
    then ``repeats`` timed runs, then parity against the reference file. Never raises on a path error."""
    data = {k: v.to(spec["device"]) for k, v in load(spec["source_file"], spec["tokens"]).items()}
    tiny_data = {"hidden": data["hidden"][:16], "teacher_weight": data["teacher_weight"][:16],
                 "target": torch.where(data["target"][:16] >= 16, 0, data["target"][:16])}
    return measure_student(spec, data, forward, tiny_data)


def measure_student(spec: dict, data: dict, forward_fn, tiny_data: dict) -> dict:
    """The measurement shared by the distillation rows: a warm-up, the first forward+backward's peak memory (and
    time on CPU), ``repeats`` timed runs, and parity against the reference file."""
    from . import harness
    device = spec["device"]
    leaves = {k: data[k].clone().requires_grad_() for k in ("hidden", "student_weight")}
    tiny = {k: v[:16].detach().clone().requires_grad_() for k, v in leaves.items()}
    forward_fn(spec["path"], tiny, tiny_data).backward()

    def run():
        loss = forward_fn(spec["path"], leaves, data)
        loss.backward()
        return loss.detach()

    def reset():
        for t in leaves.values():
            t.grad = None
    box = {}

    def first():   # the first full forward+backward: its peak memory, and on CPU its time too
        began = time.perf_counter()
        box["loss"] = run()
        box["ms"] = (time.perf_counter() - began) * 1e3
    peak, memory_method = harness.peak_memory(first, device)
    loss, grads = float(box["loss"]), {k: t.grad.detach().double().cpu() for k, t in leaves.items()}
    if device == "cuda":
        time_ms, times = harness.median_ms(run, reset, device, spec["repeats"], 0,
                                           grad_to_none=list(leaves.values()))
    else:   # seconds per run on a CPU: the first run counts as one of the ``repeats``
        more = harness.median_ms(run, reset, device, spec["repeats"] - 1, 0)[1] if spec["repeats"] > 1 else []
        times = [box["ms"], *more]
        time_ms = statistics.median(times)
    ref = torch.load(spec["reference_file"], map_location="cpu", weights_only=True)
    grad_rel = {k: float((grads[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-300)) for k in grads}
    n, h = data["hidden"].shape
    floor = (n * h + data["student_weight"].numel()) * 4
    return {"status": "ok", "loss": loss, "loss_ref": ref["loss"],
            "loss_rel_err": abs(loss - ref["loss"]) / abs(ref["loss"]), "grad_rel_err": max(grad_rel.values()),
            "grad_rel_err_by_leaf": grad_rel, "time_ms": time_ms, "times_ms": times, "peak_bytes": peak,
            "floor_bytes": floor, "peak_over_floor": peak / floor,
            "method": {"memory": memory_method, "time": TIME_METHOD[device].format(repeats=spec["repeats"])}}


def summarize(prepared: dict, rows: list, wall_seconds: float) -> dict:
    """The JSON section: the input, the method, the rows (with time and memory relative to stock)."""
    stock = next((r for r in rows if r.get("baseline") and r.get("status") == "ok"), None)
    for row in rows:
        if stock and row.get("status") == "ok":
            # stock / path, as the memory sweep's ratios: > 1 means the path is faster / leaner
            row["stock_over_path_time"] = stock["time_ms"] / row["time_ms"]
            row["stock_over_path_memory"] = stock["peak_bytes"] / max(row["peak_bytes"], 1)
    return {"input": prepared["input"], "reference_loss": prepared["reference_loss"],
            "method": {"parity": "float64 formula in the parent process; loss rel err = |loss - ref| / |ref|; "
                                 "grad rel = ||g - g64|| / ||g64||, worst of student hidden and head",
                       "memory": "peak RSS of the first fwd+bwd minus RSS with the inputs, fresh process "
                                 "(CPU); torch.cuda.max_memory_allocated (CUDA)",
                       "floor": "student gradients returned: (N*H + V*H) * 4 bytes"},
            "results": rows, "wall_seconds": round(wall_seconds, 1)}
