"""``fusedce bench``'s distillation row, second part: the linear cross-entropy with probability ("soft") targets, the
teacher's distribution as the target (``linear_cross_entropy(hidden, W_s, q)``), each path in a fresh process
(``worker``), on the same input as ``distill.py``."""
from __future__ import annotations

import os
import tempfile
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from . import distill
from .names import path_name

TARGET_DTYPE = torch.bfloat16
# name -> (what it runs (display name: ``names.path_name``), fusedce method; None for stock, "torch" for
# torch's chunked path)
PATHS = {
    "softce-stock": ("stock: full logits + F.cross_entropy(prob. target) (fp32)", None),
    "softce-fusedce-chunked": ("fusedce linear_cross_entropy, prob. target (chunked)", "chunked"),
    "softce-fusedce-tiled": ("fusedce linear_cross_entropy, prob. target (tiled)", "tiled"),
    "softce-torch-chunked": ("torch F.linear_cross_entropy + LinearCrossEntropyOptions()", "torch"),
}


def load(source_file: str, tokens: int) -> dict:
    """``distill.load``'s tensors plus ``q`` (N, V) bfloat16: the teacher's softmax (fp32, then rounded)."""
    data = distill.load(source_file, tokens)
    with torch.no_grad():
        data["q"] = torch.softmax(data["hidden"] @ data["teacher_weight"].T, -1).to(TARGET_DTYPE)
    return data


class Unavailable(ImportError):
    """The path does not exist in this environment (the row says why); an ``ImportError`` so that the
    worker reports it as ``"unavailable"``."""


def _torch_chunked(hidden, weight, q):
    """torch's chunked linear CE, or ``Unavailable`` when it would silently run the full-logits reference."""
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options is None or not hasattr(F, "linear_cross_entropy"):
        raise Unavailable(f"torch {torch.__version__} has no F.linear_cross_entropy / LinearCrossEntropyOptions")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = F.linear_cross_entropy(hidden, weight, q.to(hidden.dtype), options=options())
    fallback = [str(w.message) for w in caught if "ignored" in str(w.message)]
    if fallback:
        raise Unavailable(f"n/a in torch {torch.__version__}: its chunked path takes int64 targets only (a "
                          "probability target: it warns and runs the full-logits reference)")
    return loss


def forward(name: str, leaves: dict, data: dict) -> torch.Tensor:
    method = PATHS[name][1]
    hidden, weight, q = leaves["hidden"], leaves["student_weight"], data["q"]
    if method is None:
        return F.cross_entropy(F.linear(hidden, weight).float(), q.float())
    if method == "torch":
        return _torch_chunked(hidden, weight, q)
    import fusedce
    backend = "torch" if hidden.device.type == "cpu" else None
    return fusedce.linear_cross_entropy(hidden, weight, q, method=method, backend=backend)


def reference(data: dict) -> dict:
    """Float64 loss and student gradients, ``distill.REFERENCE_ROWS`` rows at a time."""
    h, q = data["hidden"].double(), data["q"].double()
    w_s = data["student_weight"].double().requires_grad_()
    total, grad_h, n = 0.0, torch.zeros_like(h), h.shape[0]
    for start in range(0, n, distill.REFERENCE_ROWS):
        rows = slice(start, start + distill.REFERENCE_ROWS)
        h_rows = h[rows].clone().requires_grad_()
        loss = -(q[rows] * torch.log_softmax(h_rows @ w_s.T, -1)).sum() / n
        loss.backward()
        total += float(loss.detach())
        grad_h[rows] = h_rows.grad
    return {"loss": total, "hidden": grad_h, "student_weight": w_s.grad}


def prepare(source_file: str, tokens: Optional[int] = None) -> dict:
    """The float64 reference in a temporary file (``cleanup`` removes it) and the input's description."""
    tokens = distill.TOKENS if tokens is None else tokens
    data = load(source_file, tokens)
    ref = reference(data)
    handle, path = tempfile.mkstemp(prefix="fusedce-softce-ref-", suffix=".pt")
    os.close(handle)
    torch.save(ref, path)
    n, h = data["hidden"].shape
    return {"source_file": source_file, "tokens": n, "reference_file": path, "reference_loss": ref["loss"],
            "input": {"tokens": n, "hidden_size": h, "vocab_size": data["teacher_weight"].shape[0],
                      "target": f"the teacher's softmax (T = 1, fp32) cached in {str(TARGET_DTYPE)[6:]}, "
                                "(N, V); every row counted",
                      "teacher": "SmolLM2-135M's own hidden states and LM head (real input)",
                      "student": f"the same hidden states through W + {distill.NOISE} * std(W) * N(0, 1) "
                                 f"(seed {distill.SEED})"}}


cleanup = distill.cleanup


def jobs(prepared: dict, device: str, repeats: int = distill.REPEATS, names: Optional[list] = None) -> list:
    out = []
    for name in names or list(PATHS):
        spec = {"distill_soft": True, "path": name, "device": device, "source_file": prepared["source_file"],
                "tokens": prepared["tokens"], "reference_file": prepared["reference_file"], "repeats": repeats}
        row = {"path": name, "label": path_name(name), "what": PATHS[name][0], "baseline": PATHS[name][1] is None}
        out.append((row, spec, None))
    return out


def describe(row: dict) -> str:
    return f"distillation (soft-target CE): {row['label']}"


def measure(spec: dict) -> dict:
    """One path in this (fresh) process, as ``distill.measure`` (``distill.measure_student``): a tiny warm-up
    (16 rows, 16 classes), the first full fwd+bwd's peak memory (and time on CPU), ``repeats`` timed runs,
    parity against the reference file."""
    data = {k: v.to(spec["device"]) for k, v in load(spec["source_file"], spec["tokens"]).items()}
    return distill.measure_student(spec, data, forward, {"q": data["q"][:16, :16]})


def summarize(prepared: dict, rows: list, wall_seconds: float) -> dict:
    """The JSON sub-section ``distillation["soft_ce"]``: the input, the method, the rows (vs stock)."""
    section = distill.summarize(prepared, rows, wall_seconds)
    section["method"]["parity"] = ("float64 formula (-sum q log softmax, the bf16 q's values) in the parent; "
                                   "loss rel err, grad rel = worst of student hidden and head")
    return section
