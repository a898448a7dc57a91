"""The CuTe backend's per-chunk cross-entropy, plugged into the chunked LM head (``fusedce.lm_head``)."""
from __future__ import annotations

import torch

from . import custom_ops  # noqa: F401 - registers the fusedce_cute ops


def _w(w, weight_sum):
    return (None, None) if w is None else (w.contiguous(), weight_sum.reshape(1))


def _no_entropy(asked: bool) -> None:
    if asked:
        raise RuntimeError("backend='cute' has no entropy kernels yet (token_log_probs); use backend='triton'")


class CuteChunkCE:
    """``ChunkCE`` (``backends/protocol.py``) with the CuTe kernels (CUDA), through the
    ``fusedce_cute`` custom ops (``custom_ops.py``). No entropy kernels yet: the RL ops refuse this
    backend (``fusedce/rl/log_probs.py``)."""
    NAME = "cute"   # the backend's name (lm_head/loop.py finds this class by it)


    @staticmethod
    def loss(logits, target, w, weight_sum, opts, stats, entropy=False):
        _no_entropy(entropy)
        return torch.ops.fusedce_cute.ce_forward(logits, target, *_w(w, weight_sum), *opts.op_args(), stats, False)

    @staticmethod
    def loss_and_grad_(logits, target, w, weight_sum, grad_row, z_grad_row, opts, stats):
        loss, lse, lse_lo, predicted, token_weight = torch.ops.fusedce_cute.ce_chunk_(
            logits, target, *_w(w, weight_sum), grad_row, z_grad_row, *opts.op_args(), stats)
        return loss, lse, lse_lo, predicted, token_weight if opts.use_token_scaling else None

    @staticmethod
    def grad_(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, opts, grad_entropy=None, entropy=None,
              out=None):
        _no_entropy(grad_entropy is not None)
        if out is not None and out is not logits:
            out.copy_(logits)   # the in-place kernel then writes the gradient over the copy
        torch.ops.fusedce_cute.ce_backward_inplace(logits if out is None else out, target, *_w(w, weight_sum), lse,
                                                   lse_lo, grad_row, grad_lse, *opts.op_args())

