"""The PyTorch backend on a vocabulary slice (vocab parallelism), the same interface as
``backends/triton/slices.py``: partial row statistics out, the slice's gradient from the global
statistics in, in row chunks of fp32 temporaries (``tuning.chunk_rows``); the math is ``core/row_math.py``'s."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.options import LossOptions
from fusedce.core.types import SliceStats
from fusedce.core.row_math import rows_grad, transform
from .tuning import chunk_rows


def slice_stats(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor], opts: LossOptions,
                col_start: int, entropy: bool = False) -> SliceStats:
    """Partial statistics of ``logits`` ((n, V_r); global columns from ``col_start``), see ``SliceStats``
    (``tsum``, the entropy's partial sum, only with ``entropy``)."""
    n, n_local = logits.shape
    dev = logits.device
    xmax, zmax = torch.full((n,), float("-inf"), device=dev), torch.full((n,), float("-inf"), device=dev)
    argmax = torch.full((n,), col_start, dtype=torch.int64, device=dev)
    sumexp, target_logit = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    zsum = torch.zeros(n, device=dev) if opts.label_smoothing > 0.0 else None
    tsum = torch.zeros(n, device=dev) if entropy else None
    if n_local == 0:
        return SliceStats(xmax, argmax, zmax, sumexp, target_logit, zsum, tsum)
    w = None if weight is None else weight.float()
    valid = opts.kept(target)
    owned = valid & (target >= col_start) & (target < col_start + n_local)
    col = torch.where(owned, target.long() - col_start, 0)
    step = chunk_rows(n_local)
    for start in range(0, n, step):
        r = slice(start, start + step)
        x = logits[r].float()
        z = transform(x, opts)
        xmax[r], arg = x.max(dim=1)                 # first index among ties, like argmax
        argmax[r] = arg + col_start
        zmax[r] = m = transform(xmax[r], opts)     # = max_c z_c: the transform is increasing
        shift = torch.where(m == float("-inf"), 0.0, m)   # an all -inf row: sum 0, not NaN
        d = z - shift[:, None]
        e = torch.exp(d)
        sumexp[r] = e.sum(dim=1)
        if tsum is not None:   # sum exp(z - m) (z - m); a -inf logit adds 0, not 0 * -inf
            tsum[r] = torch.where(z == float("-inf"), 0.0, e * d).sum(dim=1)
        target_logit[r] = torch.where(owned[r], z.gather(1, col[r, None])[:, 0], 0.0)
        if zsum is not None:
            zsum[r] = z.sum(dim=1) if w is None else z @ w
    return SliceStats(xmax, argmax, zmax, sumexp, target_logit, zsum, tsum)


def slice_grad(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
               weight_sum: Optional[torch.Tensor], target_weight: Optional[torch.Tensor], lse: torch.Tensor,
               lse_lo: torch.Tensor, grad_row: torch.Tensor, grad_lse: Optional[torch.Tensor],
               opts: LossOptions, col_start: int, n_total: int, grad_entropy: Optional[torch.Tensor] = None,
               entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The slice's gradient in the logits' dtype, from the GLOBAL statistics (see the Triton twin);
    ``grad_entropy`` (n,) with the global ``entropy`` (n,): the entropy's term too."""
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    w = None if weight is None else weight.float()
    step = chunk_rows(max(logits.shape[1], 1))
    for start in range(0, logits.shape[0], step):
        r = slice(start, start + step)
        grad[r] = rows_grad(logits[r].float(), target[r], w, weight_sum, lse[r], lse_lo[r], grad_row[r],
                            None if grad_lse is None else grad_lse[r], opts, n_classes=n_total,
                            col_start=col_start,
                            target_weight=None if target_weight is None else target_weight[r],
                            grad_entropy=None if grad_entropy is None else grad_entropy[r],
                            entropy=None if grad_entropy is None else entropy[r])
    return grad
