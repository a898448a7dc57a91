"""TRL's per-token statistics on Triton (``types.TokenStats``): the chunked form (a launch of
``kernels/token_stats.py`` on a chunk of logits whose lse is known) and the tiled form (the tiled forward kernel
with COMPUTE_TOKEN_STATS: the statistics in the same pass as the lse)."""
from __future__ import annotations

from typing import Optional

import torch

from ..layout import opt_contiguous, unit_stride
from fusedce.core.options import LossOptions
from .kernels.token_stats import token_stats_kernel
from .launch import _align
from .tiled import _forward_buffers, tiled_forward_launch
from .tuning import forward_config

Opt = Optional[torch.Tensor]


def token_stats_launch(logits, target, lse, lse_lo, opts: LossOptions, out: tuple):
    """``(kernel, grid, args, meta)`` of the statistics launch; ``out`` = (log_sum_sq, mean, is_top1 as
    uint8) buffers of (n,)."""
    n_rows, n_cols = logits.shape
    cfg = forward_config(n_cols)
    args = (logits, target, lse, lse_lo, *out, n_cols, logits.stride(0), target.stride(0), opts.kernel_scalars())
    meta = dict(BLOCK_V=cfg["BLOCK_V"], ALIGN=_align(logits.element_size(), n_cols, logits.stride(0)),
                FLAGS=opts.kernel_flags(False), num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"])
    return token_stats_kernel, (n_rows,), args, meta


def _stats_buffers(like: torch.Tensor, n: int):
    return (like.new_empty(n, dtype=torch.float32), like.new_empty(n, dtype=torch.float32),
            like.new_empty(n, dtype=torch.bool))


@torch.library.custom_op("fusedce::token_stats", mutates_args=())
def token_stats_op(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, lse_lo: torch.Tensor,
                   ignore_index: int, scalars: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log_sum_sq_probs, mean_logits, is_top1)`` of ``logits`` ((n, V)) from its lse pair."""
    log_sum_sq, mean, top1 = _stats_buffers(logits, logits.shape[0])
    if logits.shape[0]:
        rows = unit_stride(logits)
        kernel, grid, args, meta = token_stats_launch(rows, target, lse.contiguous(), lse_lo.contiguous(),
                                                      LossOptions.from_op_args(ignore_index, scalars),
                                                      (log_sum_sq, mean, top1.view(torch.uint8)))
        kernel[grid](*args, **meta)
    return log_sum_sq, mean, top1


@token_stats_op.register_fake
def _(logits, target, lse, lse_lo, ignore_index, scalars):
    return _stats_buffers(logits, logits.shape[0])


@torch.library.custom_op("fusedce::tiled_forward_token_stats", mutates_args=())
def tiled_forward_token_stats_op(hidden: torch.Tensor, weight: torch.Tensor, bias: Opt, target: torch.Tensor,
                                 ignore_index: int, scalars: list[float], entropy: bool
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fusedce::tiled_forward`` (no class weights, no argmax: the RL ops) plus the statistics."""
    out = _forward_buffers(hidden, False, entropy)
    stats = _stats_buffers(hidden, hidden.shape[0])
    if hidden.shape[0]:
        kernel, grid, args, meta = tiled_forward_launch(
            unit_stride(hidden), unit_stride(weight), opt_contiguous(bias), target, None, None,
            LossOptions.from_op_args(ignore_index, scalars), *out[:3], None, out[4], out[5] if entropy else None,
            token_stats=(stats[0], stats[1], stats[2].view(torch.uint8)))
        kernel[grid](*args, **meta)
    return (*out, *stats)


@tiled_forward_token_stats_op.register_fake
def _(hidden, weight, bias, target, ignore_index, scalars, entropy):
    return (*_forward_buffers(hidden, False, entropy), *_stats_buffers(hidden, hidden.shape[0]))


def chunk_token_stats(logits, target, lse, lse_lo, opts: LossOptions):
    """``ChunkCE.token_stats`` of the Triton backend."""
    return torch.ops.fusedce.token_stats(logits, target, lse, lse_lo, *opts.op_args())


def tiled_forward_token_stats(hidden, weight, bias, target, opts: LossOptions, entropy: bool):
    """``(loss, lse, lse_lo, target_logit, entropy or None, (log_sum_sq, mean, is_top1))``."""
    loss, lse, lse_lo, _, target_logit, ent, *stats = torch.ops.fusedce.tiled_forward_token_stats(
        hidden, weight, bias, target, *opts.op_args(), entropy)
    return loss, lse, lse_lo, target_logit, ent if entropy else None, tuple(stats)
