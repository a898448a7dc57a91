"""Tolerances of the distillation tests (the reasoning of tolerances.py, applied to the distillation rows).

Whatever the inputs' dtype, a row is computed in fp32 from the exact input values, and the reference
(reference64_distill.py) uses the same values in float64. fp32 errors: ``log_softmax`` of ``u = c(z) / T``
carries an absolute error of a few ulps of ``M_r = 1 + max |u|`` per class, and every loss / gradient
term is a probability-weighted sum of such log terms, so a row's loss is off by ``~32 u M_r`` at worst
(``FP32_UNITS = 64`` allows twice that) where ``M_r`` adds both models' and, with a hard label, the
student's ``max |c(z_s)|`` times the weight; a gradient element by that times its row's upstream factor
(``1 / T + |hard_label_weight|`` per unit of ``M_r``). Low-precision gradients add the one rounding to
their dtype (``tolerances.TOLERANCES``' ``grad_rtol`` / ``grad_atol``).
"""
from __future__ import annotations

import torch

from tolerances import FP32_UNITS, TOLERANCES, U32, _check


def _finite_max(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().double().abs()
    return torch.where(torch.isfinite(x), x, 0.0).amax(dim=-1)


def row_scale(zs, zt, *, temperature=1.0, hard_label_weight=0.0, student_softcap=None, teacher_softcap=None):
    """``M_r`` of the module docstring, float64 of the leading shape (logits of both models)."""
    cs = zs if student_softcap is None else student_softcap * torch.tanh(zs.double() / student_softcap)
    ct = zt if teacher_softcap is None else teacher_softcap * torch.tanh(zt.double() / teacher_softcap)
    ms, mt = _finite_max(cs), _finite_max(ct)
    return 1.0 + (ms + mt) / temperature + abs(hard_label_weight) * (1.0 + ms)


def assert_loss(actual, ref, scale, reduction, denominator=None):
    """``actual`` (fp32) against the float64 ``ref``; ``scale`` = per-row ``M_r`` (0 on ignored rows)."""
    assert actual.dtype == torch.float32, f"loss dtype {actual.dtype}"
    per_row = FP32_UNITS * U32 * scale.double()
    if reduction == "none":
        bound = per_row
    else:
        bound = per_row.sum() * (1.0 if reduction == "sum" or not denominator else 1.0 / denominator)
    _check("loss", actual, ref, 2.0 ** -22 * ref.abs() + bound)


def assert_grad(name, actual, ref, scale, factor, dtype, temperature=1.0, hard_label_weight=0.0):
    """A gradient ``(..., X)`` against float64 ``ref``; ``scale`` (rows) = ``M_r``; ``factor`` (rows) =
    each row's upstream gradient (``1 / D``, 1 or the per-row one). For a matmul product of the logits'
    gradient (``name`` != "logits") pass the row bound already propagated (``scale`` of the output rows)."""
    tol = TOLERANCES[dtype]
    unit = 1.0 / temperature + abs(hard_label_weight)
    abs_bound = FP32_UNITS * U32 * unit * (scale.double() * factor.double().abs())
    bound = tol.grad_rtol * ref.detach().double().abs() + tol.grad_atol + abs_bound.unsqueeze(-1)
    _check(name, actual.detach(), ref.detach().double(), bound)
