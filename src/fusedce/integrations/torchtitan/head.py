"""The LM head's operands and the TP layout they come in, for torchtitan's two SPMD backends."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size
from torchtitan.distributed.utils import get_spmd_backend


def head_params(lm_head: nn.Module, where: str):
    """``(weight, bias)`` of a plain linear head; ``TypeError`` for a head whose forward is more than
    ``F.linear`` (its transform would be skipped, since the head's forward is not called)."""
    if not isinstance(lm_head, nn.Linear) or type(lm_head).forward is not nn.Linear.forward:
        raise TypeError(f"{where}: the LM head must be a plain linear layer (nn.Linear / torchtitan's Linear, "
                        f"forward not overridden); got {type(lm_head).__name__}, whose forward would be skipped. "
                        "Use torchtitan's ChunkedLossWrapper for this model")
    return lm_head.weight, lm_head.bias


def spmd_tp_group():
    """The TP process group when torchtitan's ``spmd_types`` backend runs TP > 1 (plain local shards), else
    None."""
    if get_spmd_backend() == "spmd_types" and spmd_mesh_size("tp") > 1:
        return current_spmd_mesh().get_group("tp")
    return None


class _ToPartial(torch.autograd.Function):
    """Identity forward; backward keeps the (complete, replicated) gradient on rank 0 of ``group`` and
    zeros on the others, so a later all-reduce over ``group`` gives it back exactly."""

    @staticmethod
    def forward(ctx, hidden, group):
        ctx.group = group
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        if dist.get_rank(ctx.group) != 0:
            grad = torch.zeros_like(grad)
        return grad, None


def to_partial(hidden: torch.Tensor, group) -> torch.Tensor:
    """``hidden`` whose gradient is handed back as this rank's share of a sum over ``group``."""
    return _ToPartial.apply(hidden, group)


def local_view(t: torch.Tensor, name: str, where: str):
    """``(local tensor, placements or None)``: a DTensor's local shard when it is not split along its last
    dimension nor partial (batch / sequence shards are local rows: a token-sum loss is their sum)."""
    from torch.distributed.tensor import DTensor
    if not isinstance(t, DTensor):
        return t, None
    for p in t.placements:
        if p.is_partial() or (p.is_shard() and name == "pred" and p.dim % t.ndim == t.ndim - 1):
            raise ValueError(f"{where}: {name} must be replicated or sharded over batch / sequence, got "
                             f"placements {t.placements}")
    return t.to_local(), t
