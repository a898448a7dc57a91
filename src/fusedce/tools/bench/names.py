"""One name per bench path, in every table of ``fusedce bench`` and every panel of ``bench.png``."""
from __future__ import annotations

STOCK = "stock"
TORCH_LCE = "torch LCE"           # torch.nn.functional.linear_cross_entropy
TRL = "TRL ChunkedLogProb"        # trl.kernels.ChunkedLogProbFunction

NAMES = {
    # cross_entropy on logits, and linear_cross_entropy (main tables, memory sweep)
    "torch": STOCK, "linear-torch": STOCK,
    "fusedce-torch": "fusedce (torch)", "fusedce-triton": "fusedce (triton)",   # on logits: no method
    "linear-fusedce-torch": "fusedce chunked (torch)", "linear-fusedce-triton": "fusedce chunked (triton)",
    "linear-fusedce-torch-tiled": "fusedce tiled (torch)", "linear-fusedce-triton-tiled": "fusedce tiled (triton)",
    "linear-torch-lce": TORCH_LCE, "linear-trl": TRL,
    # distillation (GKD JSD) and soft-target cross-entropy
    "distill-stock": STOCK, "distill-fusedce-chunked": "fusedce chunked", "distill-fusedce-tiled": "fusedce tiled",
    "distill-trl": "TRL chunked divergence",
    "softce-stock": STOCK, "softce-fusedce-chunked": "fusedce chunked", "softce-fusedce-tiled": "fusedce tiled",
    "softce-torch-chunked": TORCH_LCE,
    # RL precision (per-token log-probs and entropy of a bf16 head)
    "stock-bf16": STOCK, "fp32-head-copy": "fp32 head copy", "trl-kernel": TRL, "torch-lce": TORCH_LCE,
    "fusedce": "fusedce", "fusedce-input": "fusedce (logits_dtype='input')",
    "verl-torch": "verl torch backend", "verl-triton": "verl Triton backend", "fusedce-top-p": "fusedce top_p=0.9",
}


def path_name(path: str) -> str:
    """The display name of the bench path whose id is ``path`` (the id itself for an unknown one)."""
    return NAMES.get(path, path)


def row_name(row: dict) -> str:
    """The display name of one result row: its path's name, and for a parity-only row (CPU) whether it
    ran under the Triton interpreter (``(interp.)``) or is stock on the same slice (``(slice)``)."""
    name = path_name(row["path"])
    if row.get("mode") != "parity":
        return name
    return name + (" (slice)" if row.get("baseline") else " (interp.)")
