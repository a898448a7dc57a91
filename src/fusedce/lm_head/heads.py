"""The two ways the LM head meets the loss, behind one interface used by ``ce/linear_function.py``, ``rl/linear_head.py`` and ``distill/linear_head.py``:

- ``ChunkedHead`` (``method="chunked"``): the logits of ``rows`` tokens at a time (``chunked.py``), the
  backend's ``ChunkCE`` on each chunk. With mean / sum its forward also makes the gradients
  (``grads_in_forward``): 3 matmuls per token in all.
- ``TiledHead`` (``method="tiled"``): the backend's ``TiledCE``, no logits tensor at all. Its forward
  computes only the row statistics; every backward recomputes the logits tile by tile from the saved
  lse: 4 matmuls per token in all (one more than chunked, in exchange for O(BT + tiles) memory).

Both: ``forward(...) -> (loss, lse, lse_lo, predicted, token_weight, entropy)`` (per row, see
``backends/protocol.py``; token_weight the detached ``p_t`` with ``use_token_scaling``, else None; entropy None
unless asked) and ``grads(...)`` as ``chunked.grads``.
"""
from __future__ import annotations

import torch

from fusedce.core.options import LossOptions
from . import invariant, loop_ops
from ..backends.protocol import ChunkCE, TiledCE
from fusedce.core.row_math import grad_lse


class ChunkedHead:
    """``chunk_size``: rows per chunk, None for the rule (``chunk_rule.chunk_rows``, decided from the real
    token count inside the loop's op, ``loop_ops.py``: a traced call does not specialize on it)."""
    grads_in_forward = True

    def __init__(self, ce: ChunkCE, chunk_size, logits: str = "float32"):
        self.ce, self.chunk_size, self.logits = ce, chunk_size, logits   # logits: chunked.logits_dtype's choice

    def invariant_rows(self, n_classes: int) -> int:
        """``batch_invariant``'s row multiple: the fixed chunk (``invariant.ROWS``; ``chunk_size`` is then it)."""
        return invariant.ROWS

    def rows_for(self, hidden, weight) -> int:
        """The rows per chunk for these operands (for loops that run outside ``loop_ops``)."""
        return loop_ops.rows_of(self.chunk_size, hidden, weight)

    def forward(self, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, stats: bool,
                entropy: bool = False):
        return loop_ops.loss_only(self.ce, self.chunk_size, hidden, weight, bias, target, w, weight_sum, opts,
                                  stats, entropy, self.logits)

    def grads(self, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, grad_row, z_grad_row, needs,
              accum_dtype, saved=None, stats: bool = False, grad_entropy=None):
        return loop_ops.grads(self.ce, self.chunk_size, hidden, weight, bias, target, w, weight_sum, opts,
                              grad_row, z_grad_row, needs, accum_dtype, saved=saved, stats=stats,
                              grad_entropy=grad_entropy, logits=self.logits)


class TiledHead:
    grads_in_forward = False

    def __init__(self, tiled: TiledCE, deterministic: bool = False, backend: str = "", batch_invariant: bool = False):
        self.tiled, self.deterministic, self.backend = tiled, deterministic, backend   # backend: its NAME
        self.batch_invariant = batch_invariant   # the backend's fixed tiles (``TiledCE.invariant_rows``)

    def invariant_rows(self, n_classes: int) -> int:
        """``batch_invariant``'s row multiple: the backend's token tile (``TiledCE.invariant_rows``)."""
        return self.tiled.invariant_rows(n_classes)

    def forward(self, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, stats: bool,
                entropy: bool = False):
        rows = self.tiled.forward(hidden, weight, bias, target, w, weight_sum, opts, stats, entropy,
                                  batch_invariant=self.batch_invariant)
        token_weight = None
        if opts.use_token_scaling:   # p_t = exp((z_t - lse) - lse_lo), as ``row_math.target_probability``
            token_weight = torch.where(opts.kept(target),
                                       torch.exp((rows.target_logit - rows.lse) - rows.lse_lo), 0.0)
        return rows.loss, rows.lse, rows.lse_lo, rows.predicted, token_weight, rows.entropy

    def grads(self, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, grad_row, z_grad_row, needs,
              accum_dtype, saved=None, stats: bool = False, grad_entropy=None):
        if saved is None:
            raise AssertionError("TiledHead.grads recomputes from a forward's saved statistics")
        lse, lse_lo, token_weight, entropy = saved
        if token_weight is not None:
            grad_row, z_grad_row = grad_row * token_weight, z_grad_row * token_weight
        g_h, g_w, g_b = self.tiled.backward(hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row,
                                            grad_lse(lse, z_grad_row, opts), opts, needs, accum_dtype,
                                            grad_entropy, entropy, deterministic=self.deterministic,
                                            batch_invariant=self.batch_invariant)
        return None, lse, lse_lo, None, token_weight, g_h, g_w, g_b
