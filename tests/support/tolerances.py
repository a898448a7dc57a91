"""The tolerance table of the cross-entropy tests, keyed by the logits' dtype, and how it is applied.

Why these numbers. Whatever the logits' dtype, the contract computes every row in fp32 from the exact
input values, and the reference (reference64.py) uses the same exact values in float64. So the only
errors are (a) fp32 arithmetic, (b) rounding the gradient to the logits' dtype once at the end.

(a) fp32 arithmetic, unit roundoff u = 2^-24. Row r's values have magnitude ``M_r = 1 + max(|lse|, |z|)``;
    ``z_c - lse`` then carries an absolute error of a few u M_r, exp/log add a few ulps, the block/tree
    sums over V <= 50257 classes add about log2(V) ~ 16 ulps (and a BT-row mean log2(BT) more). Every
    loss and gradient term is that error times ``K_r`` = |d loss_r / d lse_r| (reference64 computes
    ``K_r M_r`` per row and reduces it like the loss). FP32_UNITS = 64 allows 64 u K_r M_r: twice
    the ~32 ulps this chain can reach in the worst case. The same constant is used for all dtypes.
(b) output rounding of the gradient: round-to-nearest in the logits' dtype has a relative error of at
    most the unit roundoff 2^-p (p = 24 fp32, 8 bf16, 11 fp16 bits of precision). ``grad_rtol`` allows two
    such roundings, i.e. one ulp at the bottom of a binade: 2^-23, 2^-7, 2^-10. Two, because a kernel may
    round an intermediate once before the final scale, and because the Triton *interpreter* converts
    fp32 -> bf16 by truncation (triton/runtime/interpreter.py, cast_impl without a rounding mode), an
    error below one ulp, where the GPU rounds to nearest.
    fp16 also flushes tiny gradients (softmax / D of order 1e-9) into subnormals whose spacing is 2^-24:
    ``grad_atol`` = 2^-24 covers that one rounding (bf16 and fp32 have fp32's exponent range: 0).

The loss, lse and z-loss are fp32 results, so only (a) applies to them (plus ``loss_rtol`` = 2^-22,
four fp32 ulps of the result itself, for the final reduction and the cast of the reduced value).

Low-precision gradients are also judged against PyTorch's own low-precision error where a case asks
for it (C6: no worse than ``TORCH_LOW_PRECISION_FACTOR`` x the error of torch's bf16 F.cross_entropy).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

U32 = 2.0 ** -24
FP32_UNITS = 64.0
TORCH_LOW_PRECISION_FACTOR = 4.0   # case C6 (shared/cases/README.md)


@dataclass(frozen=True)
class Tol:
    loss_rtol: float   # relative, on fp32 results (loss, lse, z_loss)
    grad_rtol: float   # relative, per gradient element: output rounding to the logits' dtype
    grad_atol: float   # absolute floor of the gradient: subnormal spacing of the dtype (fp16 only)


TOLERANCES = {
    torch.float32: Tol(loss_rtol=2.0 ** -22, grad_rtol=2.0 ** -23, grad_atol=0.0),
    torch.bfloat16: Tol(loss_rtol=2.0 ** -22, grad_rtol=2.0 ** -7, grad_atol=0.0),
    torch.float16: Tol(loss_rtol=2.0 ** -22, grad_rtol=2.0 ** -10, grad_atol=2.0 ** -24),
}


def _report(name, actual, expected, bound, excess):
    idx = int(torch.argmax(excess.reshape(-1)))
    a, e, b = actual.reshape(-1)[idx], expected.reshape(-1)[idx], bound.reshape(-1)[idx]
    pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), tuple(actual.shape))) if actual.dim() else ()
    n_bad = int((excess > 0).sum())
    return (f"{name}: {n_bad}/{actual.numel()} elements out of tolerance; worst at {pos}: "
            f"got {float(a)!r}, expected {float(e)!r}, |diff| {float(abs(a - e)):.3e} > bound {float(b):.3e}")


def _check(name, actual, expected, bound):
    actual = actual.detach().to("cpu", torch.float64)
    expected = expected.detach().to("cpu", torch.float64)
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    bound = torch.broadcast_to(bound, expected.shape)
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), (
        f"{name}: NaN pattern differs ({int(nan_a.sum())} NaN in result, {int(nan_e.sum())} expected)")
    diff = torch.where(nan_e, torch.zeros_like(actual), (actual - expected).abs())
    excess = diff - bound
    assert not bool((excess > 0).any()), _report(name, actual, expected, bound, excess)


def assert_loss_close(actual: torch.Tensor, ref, dtype: torch.dtype, name: str = "loss") -> None:
    """``actual`` (the fp32 loss, any reduction) against ``ref.loss`` (reference64.Reference)."""
    tol = TOLERANCES[dtype]
    assert actual.dtype == torch.float32, f"{name} dtype {actual.dtype}, the contract says float32"
    bound = tol.loss_rtol * ref.loss.abs() + FP32_UNITS * U32 * ref.loss_err_scale
    _check(name, actual, ref.loss, bound.nan_to_num(0.0))


def assert_grad_close(actual: torch.Tensor, ref, dtype: torch.dtype, name: str = "grad") -> None:
    """``actual`` (gradient w.r.t. logits) against ``ref.grad``; dtype and shape are checked too."""
    tol = TOLERANCES[dtype]
    assert actual.dtype == dtype, f"{name} dtype {actual.dtype}, the logits are {dtype}"
    bound = (tol.grad_rtol * ref.grad.abs() + FP32_UNITS * U32 * ref.grad_err_scale + tol.grad_atol)
    _check(name, actual, ref.grad, bound.nan_to_num(0.0))


def assert_lse_close(actual: torch.Tensor, ref, dtype: torch.dtype) -> None:
    """Per-row lse: an fp32 value computed from values of magnitude M_r: error (a) of the table."""
    assert actual.dtype == torch.float32, f"lse dtype {actual.dtype}, the contract says float32"
    _check("lse", actual, ref.lse, (FP32_UNITS * U32 * ref.row_mag).nan_to_num(0.0))


# --- The distillation tests' tolerances ---------------------------------------------------------------
# Tolerances of the distillation tests (the reasoning of tolerances.py, applied to the distillation rows).
#
# Whatever the inputs' dtype, a row is computed in fp32 from the exact input values, and the reference
# (reference64_distill.py) uses the same values in float64. fp32 errors: ``log_softmax`` of ``u = c(z) / T``
# carries an absolute error of a few ulps of ``M_r = 1 + max |u|`` per class, and every loss / gradient
# term is a probability-weighted sum of such log terms, so a row's loss is off by ``~32 u M_r`` at worst
# (``FP32_UNITS = 64`` allows twice that) where ``M_r`` adds both models' and, with a hard label, the
# student's ``max |c(z_s)|`` times the weight; a gradient element by that times its row's upstream factor
# (``1 / T + |hard_label_weight|`` per unit of ``M_r``). Low-precision gradients add the one rounding to
# their dtype (``tolerances.TOLERANCES``' ``grad_rtol`` / ``grad_atol``).


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


# --- Bounds of the RL log-probs, top-k distillation, vocab-parallel, nn.functional and HF tests -----------
# Outputs: fp32 math on O(1..10) values (the linear ops: fp32 logits of the inputs' exact products, which the
# float64 reference also uses; the reference sees the same rounded inputs): a few fp32 ulps.
FP32_MATH_ATOL = 2e-5
# Gradients, relative to the largest element, per input dtype: fp32 math, then at most two roundings to the
# dtype.
GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# The vocab-parallel log-probs' gradients: fp32 math relative to the largest element (``VP_GRAD_MAX_RTOL``),
# plus the rounding of the result to the input dtype (bf16: half an ulp, 2^-9 relative).
VP_GRAD_RTOL = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8}
VP_GRAD_MAX_RTOL = 1e-5
# fp32 linear paths (H-term dot products in fp32, in another order than float64's), of each value and / or
# of each tensor's largest magnitude (as each test states): a few hundred fp32 ulps.
LINEAR_MAX_RTOL = 2.0 ** -16
# fusedce.nn.functional against torch.nn.functional, both in fp32.
NN_RTOL, NN_ATOL = 2e-5, 2e-6
# The tiny Hugging Face models (``hf_models.py``'s docstring has the reasoning): ``HF_RTOL`` (~170 fp32 ulps)
# of each value plus ``HF_ATOL_SCALE`` of the tensor's largest magnitude.
HF_RTOL, HF_ATOL_SCALE = 2e-5, 1e-6
