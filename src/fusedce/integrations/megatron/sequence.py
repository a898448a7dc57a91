"""Sequence parallel at the head: the output layer's ``[s/TP, b, H]`` hidden-state shard gathered to the
``[s, b, H]`` the loss needs, as megatron-core's ``ColumnParallelLinear`` gathers it (``all_gather`` along
the first dimension over the tensor-parallel group).

Backward: the fused vocabulary-parallel ops already all-reduce the hidden-state gradient over the group
(every rank then holds the sum of every rank's contribution for the whole sequence), so this rank's
``[s/TP, b, H]`` slice of it is the stock layer's reduce-scattered gradient; no further collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class GatherSequence(torch.autograd.Function):
    """``[s/TP, ...]`` -> ``[s, ...]`` over ``group``; backward: this rank's rows of the (already reduced)
    gradient."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group) -> torch.Tensor:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        out = shard.new_empty((shard.shape[0] * world, *shard.shape[1:]))
        dist.all_gather_into_tensor(out, shard.contiguous(), group=group)
        ctx.rows, ctx.rank = shard.shape[0], rank
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.rank * ctx.rows
        return grad[start:start + ctx.rows].contiguous(), None


def gather_sequence(shard: torch.Tensor, group) -> torch.Tensor:
    """``shard`` ``[s/TP, b, H]`` gathered to ``[s, b, H]`` over ``group`` (module docstring)."""
    return GatherSequence.apply(shard, group)
