"""Sequence parallel at the head: the ``[s/TP, b, H]`` shard gathered to ``[s, b, H]``; backward returns this
rank's rows of the already all-reduced gradient (docs/megatron.md)."""
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
