"""TRL's per-token statistics (``types.TokenStats``) of a chunk of logits, in plain PyTorch: the
``ChunkCE.token_stats`` of this backend (``backends/protocol.py``), run on a chunk whose lse pair the forward has
just computed."""
from __future__ import annotations

import torch

from fusedce.core.options import LossOptions
from .launch import for_row_blocks
from fusedce.core.row_math import token_stats, transform


def chunk_token_stats(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, lse_lo: torch.Tensor,
                      opts: LossOptions):
    """``(log_sum_sq_probs, mean_logits, is_top1)`` of ``logits`` ((n, V), any float dtype) against
    ``target`` (n,), from the forward's lse pair (n,) fp32: (n,) fp32, fp32, bool; 0 / False on ignored
    rows. fp32 temporaries of one row sub-chunk at a time."""
    n_rows = logits.shape[0]
    log_sum_sq = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    mean = torch.empty_like(log_sum_sq)
    top1 = torch.empty(n_rows, dtype=torch.bool, device=logits.device)
    def each(rows, block, _work):
        z = transform(block, opts)
        t = target[rows]
        log_sum_sq[rows], mean[rows], top1[rows] = token_stats(z, t, lse[rows], lse_lo[rows], opts.kept(t))

    for_row_blocks(logits, each)
    return log_sum_sq, mean, top1
