"""The K-class log-probabilities on one vocabulary slice: which of a row's K entries it holds, their logits,
their exchange and the slice's gradient."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fusedce.core.options import LossOptions
from fusedce.core.row_math import transform
from fusedce.distributed.layout import VocabLayout
from fusedce.distributed.shard_rows import shard_grad
from fusedce.rl.kclass_head import Entries, column_grads, scatter_columns_


def local_entries(e: Entries, layout: VocabLayout) -> Entries:
    """The entries of ``e`` this rank's slice holds: ``valid`` (n, K), ``safe`` their local column (0 elsewhere),
    ``first`` and ``any`` per row."""
    local = e.valid & (e.safe >= layout.start) & (e.safe < layout.end)
    col = torch.where(local, e.safe - layout.start, 0)
    first = local.to(torch.uint8).argmax(dim=1, keepdim=True)
    return Entries(local, col, e.rep, first, local.any(dim=1))


def gather_local(logits: torch.Tensor, loc: Entries) -> torch.Tensor:
    """The logits (n, V_r) at the local entries' columns, (n, K) in fp32 (0 elsewhere; an empty slice gives
    zeros)."""
    if logits.shape[1] == 0:
        return torch.zeros(loc.safe.shape, dtype=torch.float32, device=logits.device)
    return logits.gather(1, loc.safe).float()


def exchange_target_logits(x: torch.Tensor, loc: Entries, layout: VocabLayout, opts: LossOptions) -> torch.Tensor:
    """Every entry's transformed logit ``z_k`` (n, K) fp32 on every rank: this slice's (0 where it holds
    none), summed over the ranks (``all_reduce(SUM)`` of 4 n K bytes; none with n == 0)."""
    z = torch.where(loc.valid, transform(x, opts), 0.0)
    if z.numel() > 0:
        dist.all_reduce(z, op=dist.ReduceOp.SUM, group=layout.group)
    return z


def fix_local_columns_(grad: torch.Tensor, x: torch.Tensor, e: Entries, loc: Entries, g, G, lse, lse_lo,
                       k: Optional[torch.Tensor], entropy, opts: LossOptions) -> None:
    """Overwrite the local entries' columns of ``grad`` ((n, V_r), any float dtype) with the module docstring's whole
    formula in fp32, rounded once; ``x`` (n, K) fp32 the logits there (before the kernel)."""
    if grad.shape[1] == 0 or loc.safe.shape[1] == 0:
        return
    dz = column_grads(x, loc, e.any, g, G, lse, lse_lo, k, entropy, opts)
    scatter_columns_(grad, dz, loc, keep_unwritten=True)


def grad_of_slice(impl, logits, e: Entries, loc: Entries, g, G, lse, lse_lo, k, entropy, layout, opts):
    """The gradient (n, V_r) of one block of rows of this slice's logits (``logits`` may be overwritten)."""
    x = gather_local(logits, loc)   # read before the kernel may overwrite the block
    zero = G.new_zeros(()).expand(G.shape[0])
    grad = shard_grad(impl, logits, e.rep, None, None, None, lse, lse_lo, zero, -G, layout, opts,
                      grad_entropy=k, entropy=entropy if k is not None else None)
    fix_local_columns_(grad, x, e, loc, g, G, lse, lse_lo, k, entropy, opts)
    return grad
