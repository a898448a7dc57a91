"""Probability ("soft") targets on one vocabulary slice: the backend's probability-target row ops on the slice, their
partial statistics, the exchange of those statistics (O(BT) bytes, never logits or targets) and the slice's
gradient."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fusedce.core.options import LossOptions
from fusedce.core.row_math import two_sum
from fusedce.distributed.argmax_key import EMPTY_KEY, pack_max_key, unpack_max_key
from fusedce.distributed.layout import VocabLayout
from fusedce.lm_head.probs_loop import probs_ops

LOSS, MASS, EXP, SHIFT = 0, 1, 2, 3   # the columns of the SUM


class ProbsSlice:
    """The backend's probability-target ops on this rank's slice, with the slice's smoothing (module
    docstring): ``opts`` the slice's options, ``scale`` = s."""

    def __init__(self, impl, layout: VocabLayout, opts: LossOptions):
        self.forward_op, self.backward_op = probs_ops(impl)
        self.layout, self.scale, self.opts = layout, 1.0, opts
        eps = opts.label_smoothing
        if eps > 0.0 and layout.size > 0:
            f = layout.size / layout.n_classes
            self.scale = 1.0 / ((1.0 - eps) + eps * f)
            self.opts = dataclasses.replace(opts, label_smoothing=min(1.0, self.scale * eps * f))

    def fill(self, p: "ProbsPartials", rows: slice, x: torch.Tensor, q: torch.Tensor, w: Optional[torch.Tensor]):
        """Write the partial statistics of the slice logits ``x`` ((n_c, V_r), before the logit transform)
        and targets ``q`` ((n_c, V_r)) into ``p``'s rows ``rows``."""
        if self.layout.size == 0:   # nothing to contribute: sums 0, lse -inf, keys lose the MAX
            p.lse[rows], p.lo[rows] = float("-inf"), 0.0
            if p.keys is not None:
                p.keys[rows] = EMPTY_KEY
            return
        stats = p.keys is not None
        loss, lse, lo, mass, predicted = self.forward_op(x, q, w, *self.opts.op_args(), stats, False)
        p.lse[rows], p.lo[rows] = lse, lo
        p.sums[rows, LOSS] = loss if self.scale == 1.0 else loss / self.scale
        p.sums[rows, MASS] = mass if self.scale == 1.0 else mass / self.scale
        if stats:
            start = self.layout.start
            top = x.gather(1, predicted[:, None])[:, 0].float()
            expected = q.argmax(dim=1)
            p.keys[rows, 0] = pack_max_key(top, predicted + start)
            p.keys[rows, 1] = pack_max_key(q.gather(1, expected[:, None])[:, 0].float(), expected + start)

    def grad_(self, x: torch.Tensor, q: torch.Tensor, w: Optional[torch.Tensor], lse, lse_lo, mass, grad_row,
              grad_lse) -> torch.Tensor:
        """Overwrite the slice logits ``x`` ((n_c, V_r)) with ``d(sum_i grad_row_i loss_i + grad_lse_i
        lse_i) / dx`` (``lse`` pair and ``mass`` = A global, (n_c,) each) and return it."""
        if self.layout.size == 0:
            return x
        if self.scale != 1.0:
            mass, grad_row = mass * self.scale, grad_row / self.scale
        self.backward_op(x, q, w, lse, lse_lo, mass, grad_row, grad_lse, *self.opts.op_args())
        return x


@dataclass
class ProbsPartials:
    """This rank's per-row statistics: the slice's lse pair ``lse`` / ``lo``, ``sums`` (n, 4) fp32 and the argmax
    ``keys`` (n, 2) int64 (None without stats)."""

    lse: torch.Tensor
    lo: torch.Tensor
    sums: torch.Tensor
    keys: Optional[torch.Tensor]

    @classmethod
    def allocate(cls, n: int, stats: bool, device: torch.device) -> "ProbsPartials":
        f32 = dict(dtype=torch.float32, device=device)
        return cls(lse=torch.empty(n, **f32), lo=torch.empty(n, **f32), sums=torch.zeros(n, 4, **f32),
                   keys=torch.empty(n, 2, dtype=torch.int64, device=device) if stats else None)


@dataclass
class ProbsRows:
    """Per-row results on the global vocabulary, the same on every rank: ``loss`` without z-loss, the lse pair,
    ``mass`` and the global argmaxes ``predicted`` / ``expected`` (None without stats)."""

    loss: torch.Tensor
    lse: torch.Tensor
    lse_lo: torch.Tensor
    mass: torch.Tensor
    predicted: Optional[torch.Tensor]
    expected: Optional[torch.Tensor]


def exchange_soft(p: ProbsPartials, layout: VocabLayout) -> ProbsRows:
    """The collectives on ``p`` (modified in place) and the global per-row loss (module docstring)."""
    n = p.lse.shape[0]
    gmax = p.lse.clone()
    predicted = expected = None
    if n > 0:
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=layout.group)          # collective 1
        gmax = torch.where(gmax == float("-inf"), 0.0, gmax)   # -inf on every rank: lse = -inf
        empty = p.lse == float("-inf")   # a slice all -inf in that row (or empty) adds exactly 0
        shift = torch.where(empty, 0.0, (p.lse - gmax) + p.lo)   # <= 0: lse_r - M, with lse_r's low part
        p.sums[:, EXP] = torch.where(empty, 0.0, torch.exp(shift))
        p.sums[:, SHIFT] = torch.where(p.sums[:, MASS] == 0.0, 0.0, -shift * p.sums[:, MASS])
        dist.all_reduce(p.sums, op=dist.ReduceOp.SUM, group=layout.group)        # collective 2
        if p.keys is not None:
            dist.all_reduce(p.keys, op=dist.ReduceOp.MAX, group=layout.group)    # collective 3 (stats)
    if p.keys is not None:
        predicted, expected = unpack_max_key(p.keys[:, 0])[1], unpack_max_key(p.keys[:, 1])[1]
    s = p.sums
    log_s = torch.log(s[:, EXP])
    lse, lse_lo = two_sum(gmax, log_s)
    loss = s[:, LOSS] + s[:, SHIFT] + s[:, MASS] * log_s
    return ProbsRows(loss=loss, lse=lse, lse_lo=lse_lo, mass=s[:, MASS].clone(), predicted=predicted,
                    expected=expected)
