"""The forward and the gradient of a block of rows in one pass over it: the PyTorch backend's
``ChunkCE.loss_and_grad_`` (the chunked LM head's forward, which also writes the logits' gradient)."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.options import LossOptions
from fusedce.core.row_math import (grad_lse, masked_stats, mul_slope_, row_loss, smoothing_and_target_, target_terms,
                                   transform, two_sum, zero_ignored_)


def rows_loss_grad_(x: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                    weight_sum: Optional[torch.Tensor], grad_row: torch.Tensor, z_grad_row: torch.Tensor,
                    opts: LossOptions, stats: bool):
    """Forward and gradient of a block: ``x`` ((n, V) fp32 logits, overwritten by the gradient), ``target`` (n,) int,
    ``weight`` (V,) fp32 class weights or None with ``weight_sum`` their sum, ``grad_row`` / ``z_grad_row`` (n,)
    upstream gradients of each row's cross-entropy and z-loss (any float dtype and strides; times ``p_t`` with
    ``use_token_scaling``)."""
    n_classes = x.shape[1]
    valid = opts.kept(target)
    predicted = torch.where(valid, x.argmax(dim=1), -1) if stats else None
    z = transform(x, opts)
    keep_z = z is not x            # logit_scale / softcap: dz/dx needs z; keep it in x meanwhile
    if keep_z:
        x.copy_(z)
    _, in_range, safe, z_t, w_t = target_terms(z, target, weight, opts)
    zsum = None
    if opts.label_smoothing > 0.0:
        zsum = z.sum(dim=1) if weight is None else z @ weight
    total_w = n_classes if weight is None else weight_sum
    m = z.amax(dim=1)
    shift = torch.where(m == float("-inf"), 0.0, m)
    e = z.sub_(shift[:, None]).exp_()   # in place: z is x or transform's fresh tensor
    s = e.sum(dim=1)
    lse, lse_lo = two_sum(shift, s.log())
    loss, lse, lse_lo = masked_stats(row_loss(lse, lse_lo, z_t, w_t, zsum, total_w, n_classes, opts),
                                     lse, lse_lo, valid, in_range)
    token_weight = None
    g, zg = grad_row.float(), z_grad_row.float()
    if opts.use_token_scaling:   # row_math.target_probability's value, from this block's statistics
        token_weight = torch.where(valid & in_range, torch.exp((z_t - lse) - lse_lo), 0.0)
        g, zg = g * token_weight, zg * token_weight
    h = grad_lse(lse, zg, opts)
    g = torch.where(valid, g, 0.0)
    h = None if h is None else torch.where(valid, h, 0.0)
    a, b = (1.0 - opts.label_smoothing) * w_t, opts.label_smoothing / n_classes
    row_factor = g * (a + b * total_w) if h is None else g * (a + b * total_w) + h
    p_t = e.gather(1, safe[:, None])[:, 0] / s
    at_target = g * (a * (p_t - 1.0) + b * (total_w * p_t - w_t))
    if h is not None:
        at_target = at_target + h * p_t
    grad = smoothing_and_target_(e.mul_((row_factor / s)[:, None]), g, b, weight, safe, in_range,
                                 at_target if n_classes else None, opts)
    if keep_z:   # grad in transform's tensor, z in x: the chain rule, then the result into x
        mul_slope_(grad, x, opts, z_scratch=True)
        grad = x.copy_(grad)
    return loss, lse, lse_lo, predicted, token_weight, zero_ignored_(grad, valid)
