"""The Triton backend on a vocabulary slice (vocab parallelism): partial row statistics out, the gradient of the slice
from the global statistics in."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.options import LossOptions
from fusedce.core.types import SliceStats
from .launch import VocabSlice, ce_backward, ce_slice_stats


def _slice_stats(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor], opts: LossOptions,
                col_start: int, entropy: bool = False) -> SliceStats:
    """Partial statistics of the slice ``logits`` (n, V_r) from global column ``col_start``; one kernel launch."""
    n = logits.shape[0]
    new = lambda dtype=torch.float32: torch.empty(n, dtype=dtype, device=logits.device)   # noqa: E731
    out = (new(), new(torch.int64), new(), new(), new(), new()) + ((new(),) if entropy else ())
    if logits.shape[1] == 0:   # an empty slice holds nothing
        for t in out[:3]:
            t.fill_(float("-inf") if t.dtype == torch.float32 else col_start)
        for t in out[3:]:
            t.zero_()
    else:
        ce_slice_stats(logits, target, None if weight is None else weight.contiguous(), opts, col_start, out)
    return SliceStats(*out[:5], out[5] if opts.label_smoothing > 0.0 else None, out[6] if entropy else None)


def _slice_grad(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
               weight_sum: Optional[torch.Tensor], target_weight: Optional[torch.Tensor], lse: torch.Tensor,
               lse_lo: torch.Tensor, grad_row: torch.Tensor, grad_lse: Optional[torch.Tensor],
               opts: LossOptions, col_start: int, n_total: int, grad_entropy: Optional[torch.Tensor] = None,
               entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The slice's logits gradient in their dtype, from the GLOBAL lse pair, ``weight_sum``, ``target_weight`` and
    (with ``grad_entropy``) ``entropy``."""
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if logits.shape[1] == 0:
        return grad
    weight_sum = None if weight_sum is None else weight_sum.reshape(1).float()
    tw = None if target_weight is None else target_weight.float().contiguous()
    ce_backward(logits, target, None if weight is None else weight.contiguous(), weight_sum, lse.contiguous(),
                lse_lo.contiguous(), grad_row, grad_lse, opts, grad, VocabSlice(col_start, n_total, tw),
                grad_entropy, None if grad_entropy is None else entropy.float().contiguous())
    return grad


# ---------------------------------------------------------------- the custom ops

Opt = Optional[torch.Tensor]


def _f32(like: torch.Tensor, n: int) -> torch.Tensor:
    return like.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("fusedce::slice_stats", mutates_args=())
def _slice_stats_op(logits: torch.Tensor, target: torch.Tensor, weight: Opt, ignore_index: int,
                    scalars: list[float], col_start: int, entropy: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                               torch.Tensor]:
    st = _slice_stats(logits, target, weight, LossOptions.from_op_args(ignore_index, scalars), col_start, entropy)
    return (*st[:5], *(_f32(logits, 0) if t is None else t for t in (st.zsum, st.tsum)))


@_slice_stats_op.register_fake
def _(logits, target, weight, ignore_index, scalars, col_start, entropy):
    n = logits.shape[0]
    smoothing = LossOptions.from_op_args(ignore_index, scalars).label_smoothing > 0.0
    return (_f32(logits, n), logits.new_empty(n, dtype=torch.int64), _f32(logits, n), _f32(logits, n),
            _f32(logits, n), _f32(logits, n if smoothing else 0), _f32(logits, n if entropy else 0))


@torch.library.custom_op("fusedce::slice_grad", mutates_args=())
def _slice_grad_op(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt, target_weight: Opt,
                   lse: torch.Tensor, lse_lo: torch.Tensor, grad_row: torch.Tensor, grad_lse: Opt, ignore_index: int,
                   scalars: list[float], col_start: int, n_total: int, grad_entropy: Opt, entropy: Opt
                   ) -> torch.Tensor:
    return _slice_grad(logits, target, weight, weight_sum, target_weight, lse, lse_lo, grad_row, grad_lse,
                       LossOptions.from_op_args(ignore_index, scalars), col_start, n_total, grad_entropy, entropy)


@_slice_grad_op.register_fake
def _(logits, target, weight, weight_sum, target_weight, lse, lse_lo, grad_row, grad_lse, ignore_index, scalars,
      col_start, n_total, grad_entropy, entropy):
    return logits.new_empty(logits.shape)


def slice_stats(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor], opts: LossOptions,
                col_start: int, entropy: bool = False) -> SliceStats:
    """``_slice_stats`` as the custom op ``fusedce::slice_stats``."""
    *st, zsum, tsum = torch.ops.fusedce.slice_stats(logits, target, weight, *opts.op_args(), col_start, entropy)
    return SliceStats(*st, zsum if opts.label_smoothing > 0.0 else None, tsum if entropy else None)


def slice_grad(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
               weight_sum: Optional[torch.Tensor], target_weight: Optional[torch.Tensor], lse: torch.Tensor,
               lse_lo: torch.Tensor, grad_row: torch.Tensor, grad_lse: Optional[torch.Tensor],
               opts: LossOptions, col_start: int, n_total: int, grad_entropy: Optional[torch.Tensor] = None,
               entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``_slice_grad`` as the custom op ``fusedce::slice_grad``."""
    return torch.ops.fusedce.slice_grad(logits, target, weight, weight_sum, target_weight, lse, lse_lo, grad_row,
                                        grad_lse, *opts.op_args(), col_start, n_total, grad_entropy,
                                        None if grad_entropy is None else entropy)
