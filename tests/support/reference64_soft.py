"""The float64 oracle of probability ("soft") targets, from the formulas (nothing here imports fusedce).

Per row, on ``z = softcap * tanh(logit_scale * x / softcap)`` (or ``logit_scale * x``), with the target
``q`` (its exact values), ``eps`` = label_smoothing, ``w`` the class weights (1 without):

    q'_c = (1 - eps) q_c + eps / V,   u_c = w_c q'_c
    ce_r = -sum_c u_c log_softmax(z)_c   (a term with u_c = 0 is 0, also at a -inf logit)
    z_r  = lse_square_scale * logsumexp(z)**2

both times ``token_weights`` (1 without); ``"none"``: ``ce_r + z_r``; ``"sum"``: their sum; ``"mean"``:
the sum divided by ``N = num_items_in_batch`` if given, else the number of rows (0 when N = 0). This is
``F.cross_entropy`` with class-probability targets (``test_ce_soft_targets`` checks it against torch).
The gradient comes from float64 autograd with the upstream gradient given (as in reference64).

The error scales follow reference64 (tolerances.py multiplies them): ``M_r = 1 + max(|lse_r|, max_c
|z_rc|)`` and ``K_r = (sum_c |u_c| + 2 |s| |lse_r|) |tw_r|`` (= |d loss_r / d lse_r| bound).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SoftReference:
    loss: torch.Tensor             # float64, reduced like the call
    grad: torch.Tensor             # float64 logits.shape
    lse: torch.Tensor              # float64 logits.shape[:-1]
    z_loss: torch.Tensor           # float64, the z-loss part alone (times token weights), reduced like loss
    predicted: torch.Tensor        # int64 argmax of the logits per row
    token_accuracy: torch.Tensor   # float64: argmax of the logits == argmax of q (per row for "none")
    row_mag: torch.Tensor          # M_r, logits.shape[:-1]
    loss_err_scale: torch.Tensor   # like loss
    grad_err_scale: torch.Tensor   # (..., 1)


def reference_soft(logits: torch.Tensor, q: torch.Tensor, weight: Optional[torch.Tensor] = None, *,
                   reduction: str = "mean", label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                   softcap: Optional[float] = None, logit_scale: float = 1.0, num_items_in_batch=None,
                   token_weights: Optional[torch.Tensor] = None, upstream=None) -> SoftReference:
    shape, n_classes = tuple(logits.shape[:-1]), logits.shape[-1]
    x = logits.detach().to("cpu", torch.float64).clone().requires_grad_()
    z = x * logit_scale
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    z2 = z.reshape(-1, n_classes)
    q2 = q.detach().to("cpu", torch.float64).reshape(-1, n_classes)
    u = (1.0 - label_smoothing) * q2 + label_smoothing / n_classes
    if weight is not None:
        u = u * weight.detach().to("cpu", torch.float64)
    logp = torch.log_softmax(z2, dim=1)
    ce = -torch.where(u == 0, 0.0, u * logp).sum(dim=1)
    lse = torch.logsumexp(z2, dim=1)
    zr = lse_square_scale * lse * lse
    tw = torch.ones_like(lse) if token_weights is None else token_weights.detach().to("cpu", torch.float64).reshape(-1)
    ce, zr = ce * tw, zr * tw
    n = z2.shape[0] if num_items_in_batch is None else float(torch.as_tensor(num_items_in_batch, dtype=torch.float64))
    scale = (0.0 if n == 0 else 1.0 / n) if reduction == "mean" else 1.0

    def reduce(rows):
        return rows.reshape(shape) if reduction == "none" else rows.sum() * scale

    loss = reduce(ce + zr)
    up = torch.ones_like(loss) if upstream is None else (
        upstream.detach().double().expand_as(loss) if isinstance(upstream, torch.Tensor)
        else torch.full_like(loss, float(upstream)))
    (grad,) = torch.autograd.grad(loss, x, up, allow_unused=True)
    grad = torch.zeros_like(x) if grad is None else grad
    with torch.no_grad():
        lse_d, z_d = lse.detach(), z2.detach()
        zmax = z_d.abs().amax(dim=1) if z_d.numel() else torch.zeros(z_d.shape[0], dtype=torch.float64)
        m_r = 1.0 + torch.maximum(lse_d.abs(), zmax).nan_to_num(0.0, 0.0, 0.0)
        k_r = (u.abs().sum(dim=1) + 2.0 * abs(lse_square_scale) * lse_d.abs().nan_to_num(0.0, 0.0, 0.0)) * tw.abs()
        up_rows = up.reshape(-1) if reduction == "none" else up.reshape(()).expand(z_d.shape[0])
        grad_err = (up_rows.abs() * k_r * m_r * scale * logit_scale).reshape(*shape, 1)
        predicted = x.detach().reshape(-1, n_classes).argmax(dim=1)
        correct = (predicted == q2.argmax(dim=1)).double()
        accuracy = correct.reshape(shape) if reduction == "none" else (
            correct.mean() if correct.numel() else torch.zeros((), dtype=torch.float64))
    return SoftReference(loss=loss.detach(), grad=grad, lse=lse_d.reshape(shape), z_loss=reduce(zr.detach()),
                         predicted=predicted.reshape(shape), token_accuracy=accuracy, row_mag=m_r.reshape(shape),
                         loss_err_scale=reduce(k_r * m_r), grad_err_scale=grad_err)
