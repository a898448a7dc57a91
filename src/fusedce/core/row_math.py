"""Per-row cross-entropy math on fp32 row blocks in plain PyTorch: the reference formulas every layer may import."""
from __future__ import annotations

from typing import Optional, cast

import torch

from fusedce.core.options import LossOptions


def transform(x: torch.Tensor, opts: LossOptions) -> torch.Tensor:
    """``z`` of fp32 logits ``x``: ``softcap * tanh(logit_scale * x / softcap)``, or ``logit_scale * x``.
    Returns ``x`` itself when there is nothing to do (callers that write into ``x`` rely on that)."""
    if opts.logit_scale != 1.0:
        x = x * opts.logit_scale
    return x if opts.softcap is None else torch.tanh(x / opts.softcap) * opts.softcap


def mul_slope_(grad: torch.Tensor, z: torch.Tensor, opts: LossOptions, z_scratch: bool = False) -> torch.Tensor:
    """``grad *= dz/dx = logit_scale * (1 - (z / softcap)**2)`` in place (``logit_scale`` alone without softcap)."""
    if opts.softcap is not None:
        shifted = z.div_(opts.softcap) if z_scratch else z.div(opts.softcap)
        grad.mul_(shifted.square_().neg_().add_(1.0))
    if opts.logit_scale != 1.0:
        grad.mul_(opts.logit_scale)
    return grad


def target_probability(x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, lse_lo: torch.Tensor,
                       opts: LossOptions):
    """``p_t = exp((z_t - lse) - lse_lo)`` per row, fp32, 0 on ignored or out-of-range rows: the factor of
    ``use_token_scaling``."""
    valid = opts.kept(target) & (target >= 0) & (target < x.shape[1])
    safe = torch.where(valid, target, 0).long()
    z_t = transform(x.gather(1, safe[:, None])[:, 0].float(), opts)
    return torch.where(valid, torch.exp((z_t - lse) - lse_lo), 0.0)


def two_sum(a: torch.Tensor, b: torch.Tensor):
    """``(s, e)``: ``s = fl(a + b)`` and ``s + e = a + b`` exactly (Knuth's TwoSum, TAOCP 4.2.2)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def target_terms(z, target, weight, opts: LossOptions):
    """(valid, in_range, safe target, z_t, w_t) for a block; never indexes with a bad target."""
    n_classes = z.shape[1]
    valid = opts.kept(target)
    in_range = (target >= 0) & (target < n_classes)
    safe = torch.where(in_range, target, torch.zeros_like(target)).long()
    z_t = z.gather(1, safe[:, None])[:, 0]
    w_t = torch.ones_like(z_t) if weight is None else weight[safe]
    return valid, in_range, safe, z_t, w_t


def logsumexp_rows(z: torch.Tensor, scratch: Optional[torch.Tensor] = None):
    """``(lse, lse_lo)`` per row, fp32, with ``lse + lse_lo = max + log(sum_c exp(z_c - max))`` exactly."""
    m = z.amax(dim=1)
    shift = torch.where(m == float("-inf"), 0.0, m)
    d = torch.sub(z, shift[:, None], out=scratch).exp_().sum(dim=1).log_()
    return two_sum(shift, d)


def row_loss(lse, lse_lo, z_t, w_t, zsum, total_w, n_classes: int, opts: LossOptions) -> torch.Tensor:
    """The row's cross-entropy without z-loss, (n,) fp32: the one loss formula of the PyTorch backend and the
    vocab-parallel exchange."""
    eps = opts.label_smoothing
    loss = (1.0 - eps) * ((lse - z_t) + lse_lo)
    if w_t is not None:
        loss = loss * w_t
    if eps > 0.0:
        loss = loss + (eps / n_classes) * ((total_w * lse - zsum) + total_w * lse_lo)
    return loss


def entropy_rows(z: torch.Tensor, lse: torch.Tensor, lse_lo: torch.Tensor) -> torch.Tensor:
    """The entropy ``-sum_c p_c u_c`` of ``softmax(z)`` per row (``u = (z - lse) - lse_lo``; no cancellation); a
    row of -inf only is NaN, as torch's."""
    u = (z - lse[:, None]) - lse_lo[:, None]
    return -torch.where((z == float("-inf")) & (lse[:, None] != float("-inf")), 0.0, torch.exp(u) * u).sum(dim=1)


def rows_forward(x: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                 weight_sum: Optional[torch.Tensor], opts: LossOptions, stats: bool = True,
                 scratch: Optional[torch.Tensor] = None, entropy: bool = False):
    """Per-row cross-entropy (without z-loss), lse and argmax of ``x`` ((n, V) fp32; ``weight`` (V,) fp32 or None)."""
    n_classes = x.shape[1]
    z = transform(x, opts)
    lse, lse_lo = logsumexp_rows(z, scratch)
    valid, in_range, _, z_t, w_t = target_terms(z, target, weight, opts)
    zsum = None
    if opts.label_smoothing > 0.0:
        zsum = z.sum(dim=1) if weight is None else z @ weight
    total_w = n_classes if weight is None else cast(torch.Tensor, weight_sum)   # given with weight
    loss = row_loss(lse, lse_lo, z_t, w_t, zsum, total_w, n_classes, opts)
    ent = torch.where(valid, entropy_rows(z, lse, lse_lo), 0.0) if entropy else None
    loss, lse, lse_lo = masked_stats(loss, lse, lse_lo, valid, in_range)
    predicted = None
    if stats:
        predicted = torch.where(valid, x.argmax(dim=1), torch.full_like(target, -1, dtype=torch.long))
    if entropy:
        return loss, lse, lse_lo, predicted, ent
    return loss, lse, lse_lo, predicted


def masked_stats(loss: torch.Tensor, lse: torch.Tensor, lse_lo: torch.Tensor, valid: torch.Tensor,
                 in_range: torch.Tensor):
    """``(loss, lse, lse_lo)`` ((n,) fp32) with 0 on ignored rows and NaN loss on a kept out-of-range target."""
    loss = torch.where(valid, torch.where(in_range, loss, float("nan")), 0.0)
    return loss, torch.where(valid, lse, 0.0), torch.where(valid, lse_lo, 0.0)


def rows_grad(x: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
              weight_sum: Optional[torch.Tensor], lse: torch.Tensor, lse_lo: torch.Tensor,
              grad_row: torch.Tensor, grad_lse: Optional[torch.Tensor], opts: LossOptions,
              out: Optional[torch.Tensor] = None, *, n_classes: Optional[int] = None,
              col_start: int = 0, target_weight: Optional[torch.Tensor] = None,
              grad_entropy: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gradient of ``sum_i grad_row[i] * loss_i + grad_lse[i] * lse_i (+ grad_entropy[i] * entropy_i)`` w.r.t."""
    n_local = x.shape[1]
    n_classes = n_local if n_classes is None else n_classes
    z = transform(x, opts)
    valid = opts.kept(target)
    owned = (target >= col_start) & (target < col_start + n_local)
    safe = torch.where(owned, target - col_start, torch.zeros_like(target)).long()
    if target_weight is not None:
        w_t = target_weight
    else:
        w_t = torch.ones_like(lse) if weight is None or n_local == 0 else weight[safe]
    a, b = (1.0 - opts.label_smoothing) * w_t, opts.label_smoothing / n_classes
    total_w = n_classes if weight is None else cast(torch.Tensor, weight_sum)   # given with weight
    g = torch.where(valid, grad_row.float(), 0.0)
    h = None if grad_lse is None else torch.where(valid, grad_lse.float(), 0.0)
    row_factor = g * (a + b * total_w) if h is None else g * (a + b * total_w) + h
    # p = exp((z - lse) - lse_lo): z - lse is exact near the row max; subtracting lse_lo there (not
    # multiplying by exp(-lse_lo)) measured 1.2-1.6x torch's Frobenius error at logits x1e3-1e4, vs ~2x
    grad = torch.sub(z, lse[:, None], out=torch.empty_like(z) if out is None else out)
    grad.sub_(lse_lo[:, None])
    k = None if grad_entropy is None else torch.where(valid, grad_entropy.float(), 0.0)
    if k is not None:   # -k p (u + entropy): u + entropy kept in a second (n, V) buffer
        ent_term = grad.add(torch.where(valid, entropy, 0.0)[:, None])
    grad.exp_()
    if n_local:  # the target column, exactly: g (a (p_t - 1) + b (W p_t - w_t)) + h p_t
        p_t = grad.gather(1, safe[:, None])[:, 0]
        at_target = g * (a * (p_t - 1.0) + b * (total_w * p_t - w_t))
        if h is not None:
            at_target = at_target + h * p_t
        if k is not None:
            at_target = at_target - k * p_t * ent_term.gather(1, safe[:, None])[:, 0]
    if k is not None:   # k p (u + entropy), subtracted below; 0 where p = 0 (z = -inf: 0 * -inf)
        ent_term.mul_(grad).masked_fill_(grad == 0.0, 0.0).mul_(k[:, None])
    grad.mul_(row_factor[:, None])
    if k is not None:
        grad.sub_(ent_term)
    smoothing_and_target_(grad, g, b, weight, safe, owned, at_target if n_local else None, opts)
    mul_slope_(grad, z, opts, z_scratch=opts.softcap is not None)   # with softcap z is a fresh tensor here
    return zero_ignored_(grad, valid)


def smoothing_and_target_(grad: torch.Tensor, g: torch.Tensor, b: float, weight: Optional[torch.Tensor],
                          safe: torch.Tensor, owned: torch.Tensor, at_target: Optional[torch.Tensor],
                          opts: LossOptions) -> torch.Tensor:
    """The last terms of ``dL/dz`` in place: smoothing's ``-b g w_c``, then the target column ``safe`` set to
    ``at_target`` where ``owned``."""
    if opts.label_smoothing > 0.0:
        if weight is None:
            grad.sub_((b * g)[:, None])
        else:
            grad.addr_(b * g, weight, alpha=-1.0)
    if at_target is not None:
        current = grad.gather(1, safe[:, None])[:, 0]
        grad.scatter_(1, safe[:, None], torch.where(owned, at_target, current)[:, None])
    return grad


def zero_ignored_(grad: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``grad[~valid] = 0`` in place (exact zeros over inf / NaN), returned; on CPU only the ignored rows."""
    if grad.device.type == "cpu" and not torch.compiler.is_compiling():
        return grad.index_fill_(0, (~valid).nonzero().squeeze(1), 0.0)
    return grad.masked_fill_(~valid[:, None], 0.0)


def token_stats(z: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, lse_lo: torch.Tensor,
                valid: torch.Tensor):
    """TRL's per-token statistics (``types.TokenStats``) of fp32 ``z`` with its lse pair; 0 / False where not
    ``valid``."""
    u = (z - lse[:, None]) - lse_lo[:, None]
    log_sum_sq = u.mul_(2.0).exp_().sum(dim=1).log_()
    mean = z.sum(dim=1) / z.shape[1]
    top1 = valid & (z.argmax(dim=1) == target)
    return torch.where(valid, log_sum_sq, 0.0), torch.where(valid, mean, 0.0), top1


def grad_lse(lse: torch.Tensor, z_grad_row: torch.Tensor, opts: LossOptions) -> Optional[torch.Tensor]:
    """The chunk lse's upstream gradient from the z-loss: ``2 s lse`` times its per-row upstream; None without."""
    if opts.lse_square_scale == 0.0:
        return None
    return (2.0 * opts.lse_square_scale) * lse * z_grad_row
