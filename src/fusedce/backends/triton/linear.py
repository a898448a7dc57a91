"""What the Triton backend plugs into the LM head (``fusedce.lm_head``): its per-chunk cross-entropy
(``TritonChunkCE``) and its tiled LM head + loss (``TritonTiledCE``, the kernels of ``tiled.py``)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from fusedce.core.options import LossOptions
from ..protocol import TiledRows
from . import custom_ops
from . import tiled as _tiled  # noqa: F401 - registers fusedce::tiled_forward / tiled_backward
from .token_stats import chunk_token_stats, tiled_forward_token_stats

Opt = Optional[torch.Tensor]


def _w(w, weight_sum):
    return (None, None) if w is None else (w.contiguous(), weight_sum.reshape(1))


class TritonChunkCE:
    """``ChunkCE`` with the Triton kernels (CUDA, or the interpreter in tests)."""
    NAME = "triton"   # the backend's name (lm_head/loop.py finds this class by it)


    @staticmethod
    def loss(logits, target, w, weight_sum, opts, stats, entropy=False):
        if entropy:
            return custom_ops.forward_entropy(logits, target, *_w(w, weight_sum), opts, stats)
        return custom_ops.forward(logits, target, *_w(w, weight_sum), opts, stats)

    @staticmethod
    def token_stats(logits, target, lse, lse_lo, opts):
        return chunk_token_stats(logits, target, lse, lse_lo, opts)

    @staticmethod
    def loss_and_grad_(logits, target, w, weight_sum, grad_row, z_grad_row, opts, stats):
        return custom_ops.loss_and_grad_(logits, target, *_w(w, weight_sum), grad_row, z_grad_row, opts, stats)

    @staticmethod
    def grad_(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, opts, grad_entropy=None,
              entropy=None, out=None):
        custom_ops.backward_(logits, target, *_w(w, weight_sum), lse, lse_lo, grad_row, grad_lse, opts,
                             grad_entropy, entropy, out)


class TritonTiledCE:
    """``TiledCE`` (``backends/protocol.py``) with the tiled Triton kernels (CUDA, or the interpreter
    in tests). ``hidden`` (n, H), ``weight`` (V, H), ``bias`` (V,) or None: one float dtype."""

    @staticmethod
    def invariant_rows(n_classes: int) -> int:
        """64: the tiles (``tuning.tiled_config``) never depend on n, a partial token tile's missing rows are masked
        zeros that enter no other row's dot (no split over H or V), and every row meets the vocabulary tiles in
        order; with ``deterministic`` the hidden gradient too (its own program, no atomics)."""
        return 64

    @staticmethod
    def forward(hidden, weight, bias, target, w, weight_sum, opts: LossOptions, stats: bool,
                entropy: bool = False, token_stats: bool = False, batch_invariant: bool = False) -> TiledRows:
        # batch_invariant: nothing to select, the tiles are fixed (``invariant_rows``)
        if token_stats:   # the RL ops: no class weights, no argmax of the raw logits
            if w is not None or stats:
                raise AssertionError("token_stats goes with the RL ops' options only")
            loss, lse, lse_lo, target_logit, ent, tstats = tiled_forward_token_stats(hidden, weight, bias, target,
                                                                                    opts, entropy)
            return TiledRows(loss, lse, lse_lo, torch.full_like(target, -1, dtype=torch.int64), target_logit, ent,
                             tstats)
        loss, lse, lse_lo, predicted, target_logit, ent = torch.ops.fusedce.tiled_forward(
            hidden, weight, bias, target, w, weight_sum, *opts.op_args(), stats, entropy)
        if not stats:
            predicted = torch.full_like(target, -1, dtype=torch.int64)
        return TiledRows(loss, lse, lse_lo, predicted, target_logit, ent if entropy else None)

    @staticmethod
    def backward(hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse: Opt,
                 opts: LossOptions, needs: Tuple[bool, bool, bool], accum_dtype: torch.dtype,
                 grad_entropy: Opt = None, entropy: Opt = None, deterministic: bool = False,
                 batch_invariant: bool = False) -> Tuple[Opt, Opt, Opt]:
        deterministic = deterministic or batch_invariant   # the hidden gradient without atomics
        needs_b = bool(needs[2]) and bias is not None
        gh, gw, gb = torch.ops.fusedce.tiled_backward(
            hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse,
            grad_entropy, entropy if grad_entropy is not None else None, *opts.op_args(),
            bool(needs[0]), bool(needs[1]), needs_b, accum_dtype, bool(deterministic))
        return gh if needs[0] else None, gw if needs[1] else None, gb if needs_b else None


TRITON_TILED = TritonTiledCE()   # the backend's TILED_CE
