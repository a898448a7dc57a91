"""The float64 oracle of the tests: ``torch.nn.functional.cross_entropy`` composed in float64 on CPU.

Nothing here imports fusedce. The per-row math follows the contract (ARCHITECTURE.md):

- softcap first, in float64: ``z = softcap * tanh(x / softcap)``;
- ``F.cross_entropy(z, t, weight, ignore_index, reduction="none", label_smoothing)`` per row (its
  smoothing formula with class weights is the contract's);
- z-loss ``lse_square_scale * logsumexp(z)**2`` added on non-ignored rows only (not weighted);
- ``"mean"`` is ``sum(ce_row) / D + sum(z_row) / N``: ``D = num_items_in_batch`` (int or 0-dim tensor)
  if given, else ``sum(w[t])`` over non-ignored rows; ``N = num_items_in_batch`` if given, else the
  count of non-ignored rows (the z-loss is not class-weighted); a zero denominator gives 0.0 for its
  part and zero gradient.
- ``lse`` (the stat) is 0 on ignored rows.
- ``token_weights`` (per-token weights, a constant): each non-ignored row's loss and z-loss times its
  weight, after ``use_token_scaling``'s ``p_t``; the denominators of ``"mean"`` unchanged; the weight of an
  ignored row never matters (NaN there changes nothing).

``reference_loss`` is the same formula returning ``(loss, z_loss)`` differentiable through the float64
logits it is given (for compositions such as ``F.linear`` of float64 leaves, whose gradients autograd then
gives); ``reference_cross_entropy`` adds the gradient, the statistics and the error scales.

The gradient comes from float64 autograd through that composition, with the upstream gradient given
(``None`` = ones, a float = that scalar, a tensor = per-token for ``"none"``).

Besides the answers, ``Reference`` carries the *error scales* the tolerance table multiplies
(tolerances.py): per row, ``M_r = 1 + max(|lse_r|, max_c |z_rc|)`` (the magnitude fp32 rounding acts on:
an fp32 value of size M has an absolute error ~ 2^-24 M) and ``K_r = (1-eps)|w_t| + eps/V sum|w| +
2|s| |lse_r|`` (= |d loss_r / d lse_r|, how an lse error reaches the loss). The loss error scale is
``K_r M_r`` reduced like the loss; the gradient error scale of row r is ``|upstream_r| K_r M_r / D``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F


@dataclass
class Reference:
    loss: torch.Tensor             # float64, reduced like the call (shape target.shape for "none")
    loss_rows: torch.Tensor        # float64 target.shape, per-row loss (0 on ignored rows)
    grad: Optional[torch.Tensor]   # float64 logits.shape (None when no gradient was asked)
    lse: torch.Tensor              # float64 target.shape, logsumexp of z (0 on ignored rows)
    z_loss: torch.Tensor           # float64, s * lse**2 on non-ignored rows, reduced like loss
    predicted: torch.Tensor        # int64 target.shape, argmax of the logits (first on ties), -1 ignored
    token_accuracy: torch.Tensor   # float64, fraction of counted rows correct (per-row 0/1 for "none")
    denominator: float             # D of "mean" (nan for other reductions)
    z_denominator: float           # N of "mean", the z-loss's (nan for other reductions)
    row_mag: torch.Tensor          # float64 target.shape, M_r = 1 + max(|lse_r|, max_c |z_rc|)
    loss_err_scale: torch.Tensor   # float64, like loss: sum of K_r M_r (/ D for mean)
    grad_err_scale: Optional[torch.Tensor]  # float64 (..., 1): |upstream_r| K_r M_r / D per row


def _reduce(rows: torch.Tensor, reduction: str, scale: float) -> torch.Tensor:
    if reduction == "none":
        return rows
    total = rows.sum()
    return total * scale if reduction == "mean" else total


@dataclass
class _Loss:
    """What one float64 evaluation of the loss composition gives (differentiable through ``loss``)."""
    loss: torch.Tensor      # reduced like the call; (BT,) for "none" (flat rows)
    rows: torch.Tensor      # (BT,) per-row ce + z-loss, 0 on ignored rows
    ce: torch.Tensor        # (BT,) per-row ce part (token-weighted)
    z_rows: torch.Tensor    # (BT,) per-row z-loss part (token-weighted)
    z2: torch.Tensor        # (BT, V) the transformed logits
    lse: torch.Tensor       # (BT,)
    valid: torch.Tensor     # (BT,) bool
    w_t: torch.Tensor       # (BT,) class weight of the target, 0 on ignored rows
    f: torch.Tensor         # (BT,) the token weight (1 without token_weights), 0 on ignored rows
    scale: float            # 1 / D for "mean" (0 if D == 0), else 1
    z_scale: float          # 1 / N for "mean" (0 if N == 0), else 1
    denominator: float
    z_denominator: float


def _loss64(x, t, w, *, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, logit_scale,
            use_token_scaling, num_items_in_batch, token_weights) -> _Loss:
    """The formula once: ``x`` float64 (..., V) (gradients flow through it), ``t`` flat int64, ``w`` float64."""
    n_classes = x.shape[-1]
    z = x * logit_scale
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    z2 = z.reshape(-1, n_classes)
    valid = t != ignore_index
    lse = torch.logsumexp(z2, dim=1) if z2.shape[0] else z2.new_zeros(0)
    ce = F.cross_entropy(z2, t, weight=w, ignore_index=ignore_index, reduction="none",
                         label_smoothing=label_smoothing)
    z_rows = torch.where(valid, lse_square_scale * lse * lse, torch.zeros_like(lse))
    if use_token_scaling:   # each row's loss times p_t = softmax(z)[t], detached (DFT)
        safe = torch.where(valid, t, torch.zeros_like(t))
        p_t = torch.where(valid, torch.exp(z2.detach().gather(1, safe[:, None])[:, 0] - lse.detach()), 0.0)
        ce, z_rows = ce * p_t, z_rows * p_t
    # token_weights: each non-ignored row's loss and z-loss times its weight, a constant (after p_t); the
    # weight of an ignored row (NaN, say) never takes part
    f = torch.ones_like(lse)
    if token_weights is not None:
        f = torch.where(valid, token_weights.detach().to("cpu", torch.float64).reshape(-1), 0.0)
        ce, z_rows = torch.where(valid, ce * f, 0.0), torch.where(valid, z_rows * f, 0.0)
    f = torch.where(valid, f, 0.0)
    rows = ce + z_rows

    safe_t = torch.where(valid, t, torch.zeros_like(t))
    w_t = torch.ones(t.shape, dtype=torch.float64) if w is None else w[safe_t]
    w_t = torch.where(valid, w_t, torch.zeros_like(w_t))
    if reduction == "mean":
        if num_items_in_batch is not None:
            denominator = z_denominator = float(torch.as_tensor(num_items_in_batch, dtype=torch.float64))
        else:
            denominator, z_denominator = float(w_t.sum()), float(valid.sum())
        scale = 0.0 if denominator == 0 else 1.0 / denominator
        z_scale = 0.0 if z_denominator == 0 else 1.0 / z_denominator
    else:
        denominator = z_denominator = float("nan")
        scale = z_scale = 1.0
    loss = rows if reduction == "none" else _reduce(ce, reduction, scale) + _reduce(z_rows, reduction, z_scale)
    return _Loss(loss=loss, rows=rows, ce=ce, z_rows=z_rows, z2=z2, lse=lse, valid=valid, w_t=w_t, f=f,
                 scale=scale, z_scale=z_scale, denominator=denominator, z_denominator=z_denominator)


def reference_loss(
    logits64: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None, *,
    ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0, softcap: Optional[float] = None, logit_scale: float = 1.0,
    use_token_scaling: bool = False, num_items_in_batch: Union[int, torch.Tensor, None] = None,
    token_weights: Optional[torch.Tensor] = None,
):
    """``(loss, z_loss)`` of the contract in float64, differentiable through ``logits64`` (float64, e.g.
    ``F.linear`` of float64 leaves, so a test takes the gradients of a composition by autograd). The same
    formula as ``reference_cross_entropy`` (one implementation, ``_loss64``)."""
    shape = tuple(logits64.shape[:-1])
    t = target.detach().to("cpu", torch.int64).reshape(-1)
    w = None if weight is None else weight.detach().to("cpu", torch.float64)
    r = _loss64(logits64, t, w, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                lse_square_scale=lse_square_scale, softcap=softcap, logit_scale=logit_scale,
                use_token_scaling=use_token_scaling, num_items_in_batch=num_items_in_batch,
                token_weights=token_weights)
    z_loss = _reduce(r.z_rows, reduction, r.z_scale)
    if reduction == "none":
        return r.loss.reshape(shape), z_loss.reshape(shape)
    return r.loss, z_loss


def reference_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None, *,
    ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0, softcap: Optional[float] = None, logit_scale: float = 1.0,
    use_token_scaling: bool = False, num_items_in_batch: Union[int, torch.Tensor, None] = None,
    token_weights: Optional[torch.Tensor] = None,
    upstream: Union[None, float, torch.Tensor] = None, with_grad: bool = True,
) -> Reference:
    """The contract's answer for ``cross_entropy(logits, target, weight, ...)`` in float64.

    ``logits`` (..., V) of any float dtype (its exact values are used), ``target`` (...) int,
    ``token_weights`` (...) or None (its values on ignored rows never matter).
    """
    shape, n_classes = tuple(logits.shape[:-1]), logits.shape[-1]
    x = logits.detach().to("cpu", torch.float64).clone().requires_grad_(with_grad)
    t = target.detach().to("cpu", torch.int64).reshape(-1)
    w = None if weight is None else weight.detach().to("cpu", torch.float64)

    r = _loss64(x, t, w, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                lse_square_scale=lse_square_scale, softcap=softcap, logit_scale=logit_scale,
                use_token_scaling=use_token_scaling, num_items_in_batch=num_items_in_batch,
                token_weights=token_weights)
    loss, rows, z_rows, z2, lse, valid, w_t = r.loss, r.rows, r.z_rows, r.z2, r.lse, r.valid, r.w_t
    scale, z_scale, denominator, z_denominator = r.scale, r.z_scale, r.denominator, r.z_denominator
    if reduction == "none":
        loss = loss.reshape(shape)
    grad = grad_err_scale = None
    if with_grad:
        if upstream is None:
            up = torch.ones_like(loss)
        elif isinstance(upstream, torch.Tensor):
            up = upstream.detach().to("cpu", torch.float64).expand_as(loss)
        else:
            up = torch.full_like(loss, float(upstream))
        (grad,) = torch.autograd.grad(loss, x, up, allow_unused=True)
        if grad is None:  # empty input: nothing depends on x
            grad = torch.zeros_like(x)
        up_rows = up.reshape(-1) if reduction == "none" else up.reshape(()).expand(t.shape[0])

    with torch.no_grad():
        lse_d, z_d = lse.detach(), z2.detach()
        zmax = z_d.abs().amax(dim=1) if n_classes and z_d.shape[0] else torch.zeros(z_d.shape[0], dtype=torch.float64)
        m_r = 1.0 + torch.maximum(lse_d.abs(), zmax).nan_to_num(0.0, 0.0, 0.0)
        w_abs_sum = float(n_classes) if w is None else float(w.abs().sum())
        k_ce = (1.0 - label_smoothing) * w_t.abs() + label_smoothing / n_classes * w_abs_sum
        k_z = 2.0 * abs(lse_square_scale) * lse_d.abs().nan_to_num(0.0, 0.0, 0.0)
        k_ce = torch.where(valid, k_ce * r.f.abs(), torch.zeros_like(k_ce))   # a token weight scales the row
        k_z = torch.where(valid, k_z * r.f.abs(), torch.zeros_like(k_z))
        loss_err_scale = _reduce(k_ce * m_r, reduction, scale) + _reduce(k_z * m_r, reduction, z_scale)
        if reduction == "none":
            loss_err_scale = loss_err_scale.reshape(shape)
        if with_grad:
            s_ce, s_z = (scale, z_scale) if reduction == "mean" else (1.0, 1.0)
            grad_err_scale = up_rows.abs() * (k_ce * s_ce + k_z * s_z) * m_r * logit_scale   # dz/dx
            grad_err_scale = grad_err_scale.reshape(*shape, 1)

        z_loss = _reduce(z_rows.detach(), reduction, z_scale)
        predicted = x.detach().reshape(-1, n_classes).argmax(dim=1) if t.numel() else t.clone()
        predicted = torch.where(valid, predicted, torch.full_like(predicted, -1))
        correct = (valid & (predicted == t)).to(torch.float64)
        if reduction == "none":
            accuracy = correct.reshape(shape)
            z_loss = z_loss.reshape(shape)
        else:
            n_valid = int(valid.sum())
            accuracy = correct.sum() / n_valid if n_valid else torch.zeros((), dtype=torch.float64)

    lse_stat = torch.where(valid, lse_d, torch.zeros_like(lse_d))
    return Reference(loss=loss.detach(), loss_rows=rows.detach().reshape(shape), grad=grad,
                     lse=lse_stat.reshape(shape), z_loss=z_loss, predicted=predicted.reshape(shape),
                     token_accuracy=accuracy, denominator=denominator, z_denominator=z_denominator,
                     row_mag=m_r.reshape(shape),
                     loss_err_scale=loss_err_scale, grad_err_scale=grad_err_scale)
