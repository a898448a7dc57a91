"""The float64 oracle of the linear cross-entropy tests, stock PyTorch at the inputs' own dtype, and how
the fused results are judged against both.

``reference_linear_cross_entropy`` is ``F.linear`` in float64 on the exact input values, then
reference64's ``F.cross_entropy`` composition (softcap, smoothing, class weights, z-loss,
``num_items_in_batch``, D == 0 -> 0); the gradients of hidden, weight and bias follow from the
logits gradient ``G`` (float64 autograd) by the chain rule: ``G @ W``, ``G.T @ h``, ``sum_rows G``.
``stock_linear_cross_entropy`` is what a user writes without fusedce: ``F.linear`` in the inputs' dtype,
then the same loss on ``logits.float()``, with fp32/low-precision autograd. Neither uses fusedce;
``run_fused`` / ``check_linear`` at the bottom are the tests' one call path into it.

The tolerance (one rule, keyed by dtype in ``LINEAR_FACTOR``):

- fp32 loss / lse, element-wise, rigorous to first order: the cross-entropy table (tolerances.py) plus
  the fp32 logits' own error. A length-H dot product plus bias is off by at most ``(H + 2) u A_r`` with
  ``A_r = max_c (|h_r| . |W_c| + |b_c|)`` (``u = 2^-24``); ``lse`` moves by at most that much and the row's
  loss by at most ``2 K_r`` times it (``K_r`` = reference64's ``|d loss_r / d lse_r|`` bound: the 1-norm of
  ``d loss_r / d z`` is at most ``2 K_r``).
- gradients (every dtype) and low-precision losses: the fused result's largest error against float64 is
  at most ``LINEAR_FACTOR[dtype]`` times stock PyTorch's largest error at the same dtype, plus a floor of
  FP32_UNITS fp32 units of the magnitudes the sums run over (``|G| @ |W|``, ``|G|.T @ |h|``,
  ``sum_rows |G|``: the worst case of summing 64 terms, e.g. 64 chunks accumulated one by one), so that
  a stock path that happens to be exact does not demand exactness. Measured (H=32, V=256, 48 tokens,
  chunk 1 / 8 / None): fp32 0.3x-2.7x stock's error (chunk 1 accumulates grad_bias row by row), bf16 and
  fp16 with fp32 accumulation 1.00x. Both paths round the same fp32-accumulated matmuls to the same
  dtype; 4x (TORCH_LOW_PRECISION_FACTOR, the factor of case C6) allows for a different summation order
  across chunks without hiding a fault (a wrong scale, a wrong row's upstream gradient, an unwritten
  chunk are O(1) errors; the bounds are ~1e-6 relative in fp32 and ~1e-2 in bf16).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from reference64 import Reference, reference_cross_entropy
from tolerances import FP32_UNITS, TOLERANCES, TORCH_LOW_PRECISION_FACTOR, U32

LINEAR_FACTOR = {torch.float32: TORCH_LOW_PRECISION_FACTOR, torch.bfloat16: TORCH_LOW_PRECISION_FACTOR,
                 torch.float16: TORCH_LOW_PRECISION_FACTOR}
LOSS_OPTIONS = ("ignore_index", "reduction", "label_smoothing", "lse_square_scale", "softcap",
                "logit_scale", "use_token_scaling", "num_items_in_batch", "token_weights")


@dataclass
class LinearReference:
    ce: Reference                  # reference64 on the float64 logits, the call's reduction
    logits: torch.Tensor           # float64 (..., V)
    grad_hidden: Optional[torch.Tensor]   # float64, hidden.shape
    grad_weight: Optional[torch.Tensor]   # float64, weight.shape
    grad_bias: Optional[torch.Tensor]     # float64, (V,) (None without bias)
    loss_bound: torch.Tensor       # fp32 allowance of the loss, element-wise, like ce.loss
    lse_bound: torch.Tensor        # fp32 allowance of lse per row, target.shape
    floors: dict                   # name -> float64 element-wise floor of the gradient's error


def _d(t):
    return None if t is None else t.detach().to("cpu", torch.float64)


def reference_linear_cross_entropy(hidden, weight, target, bias=None, *, ce_weight=None, upstream=None,
                                   **opts) -> LinearReference:
    """The contract's answer for ``linear_cross_entropy(hidden, weight, target, bias, ...)`` in float64."""
    opts = {k: v for k, v in opts.items() if k in LOSS_OPTIONS}
    h, w, b = _d(hidden), _d(weight), _d(bias)
    n_hidden = h.shape[-1]
    logits = F.linear(h, w, b)
    ce = reference_cross_entropy(logits, target, ce_weight, upstream=upstream, **opts)
    rows = reference_cross_entropy(logits, target, ce_weight, with_grad=False,
                                   **{**opts, "reduction": "none"})
    g = ce.grad.reshape(-1, w.shape[0])
    h2 = h.reshape(-1, n_hidden)
    # |fp32 logits - exact| <= (H + 2) u A_r per row; it moves lse by as much and loss_r by 2 K_r as much
    a = h2.abs() @ w.abs().t() + (0.0 if b is None else b.abs())
    a_max = a.amax(dim=1) if a.numel() else torch.zeros(a.shape[0], dtype=torch.float64)
    delta = (n_hidden + 2) * U32 * a_max
    k = rows.loss_err_scale.reshape(-1) / rows.row_mag.reshape(-1)
    extra_rows = 2.0 * k * delta
    reduction = opts.get("reduction", "mean")
    if reduction == "none":
        extra = extra_rows.reshape(ce.loss.shape)
    else:
        scale = 1.0
        if reduction == "mean":   # ce rows are divided by D, z-loss rows by N: the larger scale bounds both
            scale = max(0.0 if d == 0 else 1.0 / d for d in (ce.denominator, ce.z_denominator))
        extra = extra_rows.sum() * scale
    tol = TOLERANCES[torch.float32]
    loss_bound = tol.loss_rtol * ce.loss.abs() + FP32_UNITS * U32 * ce.loss_err_scale + extra
    lse_bound = (FP32_UNITS * U32 * rows.row_mag.reshape(-1) + delta).reshape(ce.lse.shape)
    # floors of the gradients: FP32_UNITS fp32 units of what each sum runs over (at most 64 terms summed
    # in any order, including the chunk-by-chunk accumulation; see the module docstring)
    g_abs = g.abs()
    floors = {"grad_hidden": (g_abs @ w.abs()).reshape(h.shape), "grad_weight": g_abs.t() @ h2.abs(),
              "grad_bias": g_abs.sum(0)}
    floors = {name: FP32_UNITS * U32 * f for name, f in floors.items()}
    return LinearReference(
        ce=ce, logits=logits,
        grad_hidden=(g @ w).reshape(h.shape), grad_weight=g.t() @ h2, grad_bias=None if b is None else g.sum(0),
        loss_bound=loss_bound.nan_to_num(0.0), lse_bound=lse_bound.nan_to_num(0.0), floors=floors)


def stock_linear_cross_entropy(hidden, weight, target, bias=None, *, ce_weight=None, upstream=None,
                               **opts):
    """Stock PyTorch at the inputs' dtype: ``F.linear`` -> ``.float()`` -> ``F.cross_entropy`` (+ softcap,
    z-loss, the contract's mean). Returns ``(loss fp32, lse fp32 per row, {name: grad})``."""
    opts = {k: v for k, v in opts.items() if k in LOSS_OPTIONS}
    assert opts.get("token_weights") is None, "the stock path here has no token_weights (use reference64)"
    reduction, ignore_index = opts.get("reduction", "mean"), opts.get("ignore_index", -100)
    leaves = {"grad_hidden": hidden.detach().clone().requires_grad_(),
              "grad_weight": weight.detach().clone().requires_grad_()}
    if bias is not None:
        leaves["grad_bias"] = bias.detach().clone().requires_grad_()
    n_classes = weight.shape[0]
    x = F.linear(leaves["grad_hidden"], leaves["grad_weight"], leaves.get("grad_bias")).float()
    softcap = opts.get("softcap")
    x = x * opts.get("logit_scale", 1.0)
    z = (x if softcap is None else softcap * torch.tanh(x / softcap)).reshape(-1, n_classes)
    t = target.reshape(-1).long()
    valid = t != ignore_index
    lse = torch.logsumexp(z, dim=1)
    cw = None if ce_weight is None else ce_weight.float()
    rows = F.cross_entropy(z, t, weight=cw, ignore_index=ignore_index, reduction="none",
                           label_smoothing=opts.get("label_smoothing", 0.0))
    z_rows = torch.where(valid, opts.get("lse_square_scale", 0.0) * lse * lse, 0.0)
    if opts.get("use_token_scaling", False):   # DFT: each row times p_t, detached
        p_t = torch.where(valid, torch.exp(z.detach().gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
                                           - lse.detach()), 0.0)
        rows, z_rows = rows * p_t, z_rows * p_t
    if reduction == "none":
        loss = (rows + z_rows).reshape(target.shape)
    elif reduction == "sum":
        loss = rows.sum() + z_rows.sum()
    else:   # the contract's mean: sum(ce) / D + sum(z) / N
        d = n = opts.get("num_items_in_batch")
        if d is None:
            wt = torch.ones_like(rows) if cw is None else cw[torch.where(valid, t, 0)]
            d, n = torch.where(valid, wt, 0.0).sum(), valid.sum()
        d, n = torch.as_tensor(d, dtype=torch.float32), torch.as_tensor(n, dtype=torch.float32)
        loss = (torch.where(d != 0, rows.sum() / torch.where(d != 0, d, 1.0), 0.0)
                + torch.where(n != 0, z_rows.sum() / torch.where(n != 0, n, 1.0), 0.0))
    up = torch.ones_like(loss) if upstream is None else (
        upstream if isinstance(upstream, torch.Tensor) else torch.full_like(loss, float(upstream)))
    grads = torch.autograd.grad(loss, list(leaves.values()), up.to(loss.dtype))
    return loss.detach(), lse.detach().reshape(target.shape), dict(zip(leaves, grads))


def _max_err(actual, expected) -> float:
    if expected.numel() == 0:
        return 0.0
    return float((actual.detach().to("cpu", torch.float64) - expected).abs().max())


def _assert_within(name, actual, expected, bound):
    actual = actual.detach().to("cpu", torch.float64)
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not bool(torch.isnan(actual).any()), f"{name}: NaN in the result"
    diff = (actual - expected).abs()
    bound = torch.broadcast_to(torch.as_tensor(bound, dtype=torch.float64), diff.shape)
    bad = diff > bound
    if bool(bad.any()):
        i = int(torch.argmax((diff - bound).reshape(-1)))
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{diff.numel()} elements out of tolerance; worst (flat {i}): got "
            f"{float(actual.reshape(-1)[i])!r}, expected {float(expected.reshape(-1)[i])!r}, "
            f"|diff| {float(diff.reshape(-1)[i]):.3e} > bound {float(bound.reshape(-1)[i]):.3e}")


def assert_linear_loss_close(loss, ref: LinearReference, dtype, stock_loss=None, name="loss"):
    """fp32: the element-wise fp32 bound. Low precision: + LINEAR_FACTOR x stock's largest error."""
    assert loss.dtype == torch.float32, f"{name} dtype {loss.dtype}, the contract says float32"
    bound = ref.loss_bound
    if dtype != torch.float32:
        assert stock_loss is not None, "low precision is judged against the stock path's error"
        bound = bound + LINEAR_FACTOR[dtype] * _max_err(stock_loss, ref.ce.loss)
    _assert_within(name, loss, ref.ce.loss, bound)


def assert_lse_close(lse, ref: LinearReference, dtype, stock_lse=None, valid=None):
    """Per-row lse on non-ignored rows (``valid``); ignored rows are checked by the callers (exact 0)."""
    assert lse.dtype == torch.float32
    bound = ref.lse_bound
    expected = ref.ce.lse
    if valid is not None:
        lse, expected, bound = lse[valid], expected[valid], bound[valid]
        stock_lse = None if stock_lse is None else stock_lse[valid]
    if dtype != torch.float32:
        bound = bound + LINEAR_FACTOR[dtype] * _max_err(stock_lse, expected)
    _assert_within("lse", lse, expected, bound)


def assert_linear_grad_close(name, grad, ref: LinearReference, stock_grads: dict, tensor_dtype):
    """``grad`` (of hidden / weight / bias) has the tensor's dtype and is within LINEAR_FACTOR x stock's
    largest error plus the fp32 floor."""
    assert grad is not None, f"{name}: no gradient"
    assert grad.dtype == tensor_dtype, f"{name} dtype {grad.dtype}, the tensor is {tensor_dtype}"
    expected = getattr(ref, name)
    factor = LINEAR_FACTOR[tensor_dtype]
    bound = factor * _max_err(stock_grads[name], expected) + ref.floors[name]
    _assert_within(name, grad, expected, bound)


# ---------------------------------------------------------------------------------------------------
# Inputs: random, never zeros; logits = hidden @ weight.T + bias come out ~ logit_scale * randn.
def make_linear(lead, n_hidden, n_classes, dtype=torch.float32, *, bias=False, logit_scale=2.0,
                requires_grad=(True, True, True)):
    """``(hidden (*lead, H), weight (V, H), bias (V,) or None)`` rounded once to ``dtype``."""
    hidden = torch.randn(*lead, n_hidden).to(dtype).requires_grad_(requires_grad[0])
    weight = (torch.randn(n_classes, n_hidden) * (logit_scale / n_hidden ** 0.5)).to(dtype)
    weight.requires_grad_(requires_grad[1])
    b = (torch.randn(n_classes) * 0.5).to(dtype).requires_grad_(requires_grad[2]) if bias else None
    return hidden, weight, b


# ---------------------------------------------------------------------------------------------------
# The one call path of the tests: fused forward + backward with poisoned allocations, then every check.
def run_fused(hidden, weight, target, bias=None, *, backend, upstream=None, poison=True, **kw):
    """``fusedce.linear_cross_entropy`` forward + backward (every ``torch.empty*`` the library makes is
    NaN-filled first); gradients via ``autograd.grad`` for the tensors that require them.
    Returns ``(out, loss, {name: grad})``; ``upstream`` None (ones), a float or a per-token tensor."""
    import fusedce
    from inputs import poisoned_allocations

    leaves = {"grad_hidden": hidden, "grad_weight": weight, "grad_bias": bias}
    need = {k: v for k, v in leaves.items() if v is not None and v.requires_grad}
    with poisoned_allocations() if poison else nullcontext():
        out = fusedce.linear_cross_entropy(hidden, weight, target, bias, backend=backend, **kw)
        loss = out.loss if isinstance(out, fusedce.CrossEntropyOutput) else out
        if upstream is None:
            up = torch.ones_like(loss)
        elif isinstance(upstream, torch.Tensor):
            up = upstream
        else:
            up = torch.full_like(loss, float(upstream))
        grads = torch.autograd.grad(loss, list(need.values()), up) if need else ()
    return out, loss.detach(), dict(zip(need, grads))


def _clear_top2(logits64, softcap):
    """Rows whose top two (softcapped) float64 logits differ by more than fp32 / bf16 noise: there the
    argmax is unambiguous whatever the precision of the logits."""
    z = logits64 if softcap is None else softcap * torch.tanh(logits64 / softcap)
    z = z.reshape(-1, z.shape[-1])
    if z.shape[1] < 2:
        return torch.ones(z.shape[0], dtype=torch.bool)
    top = z.topk(2, dim=1).values
    return (top[:, 0] - top[:, 1]) > 1e-2 * (1.0 + top[:, 0].abs())


def check_stats(out, ref: LinearReference, target, dtype, stock_lse=None, **opts):
    """``return_stats``: lse (0 on ignored rows), predicted (-1 on ignored rows), z_loss, accuracy."""
    import fusedce

    assert isinstance(out, fusedce.CrossEntropyOutput)
    ignore_index, reduction = opts.get("ignore_index", -100), opts.get("reduction", "mean")
    valid = target != ignore_index
    assert out.lse.shape == target.shape and out.predicted_tokens.shape == target.shape
    assert out.predicted_tokens.dtype == torch.int64
    for field in ("z_loss", "lse", "token_accuracy", "predicted_tokens"):
        assert getattr(out, field).grad_fn is None, f"{field} must not carry a gradient"
    assert bool((out.lse[~valid] == 0).all()), f"lse on ignored rows must be 0, got {out.lse[~valid]}"
    assert bool((out.predicted_tokens[~valid] == -1).all()), "predicted must be -1 on ignored rows"
    assert_lse_close(out.lse, ref, dtype, stock_lse, valid)
    clear = _clear_top2(ref.logits, opts.get("softcap")).reshape(target.shape) & valid
    assert torch.equal(out.predicted_tokens[clear], ref.ce.predicted[clear])
    # z_loss = s lse^2: its error is 2 |s| |lse| times lse's, reduced like the loss
    s = opts.get("lse_square_scale", 0.0)
    lse_err = ref.lse_bound
    if dtype != torch.float32:
        lse_err = lse_err + LINEAR_FACTOR[dtype] * _max_err(stock_lse[valid], ref.ce.lse[valid])
    z_rows = torch.where(valid, 2 * abs(s) * ref.ce.lse.abs() * lse_err, 0.0)
    if reduction == "sum":
        z_rows = z_rows.sum()
    elif reduction == "mean":
        z_rows = z_rows.sum() * (1.0 / ref.ce.z_denominator if ref.ce.z_denominator else 0.0)
    _assert_within("z_loss", out.z_loss, ref.ce.z_loss, z_rows + 2.0 ** -22 * ref.ce.z_loss.abs())
    if bool(clear[valid].all()):
        _assert_within("token_accuracy", out.token_accuracy, ref.ce.token_accuracy, 1e-6)


def check_linear(hidden, weight, target, bias=None, *, backend, upstream=None, poison=True, **kw):
    """Fused vs the float64 reference (and stock PyTorch at the same dtype): loss, every gradient asked
    for, exact zeros on ignored rows (hidden gradient; loss with "none"), stats when returned.
    Returns ``(ref, out, loss, grads)``."""
    dtype = hidden.dtype
    ref = reference_linear_cross_entropy(hidden, weight, target, bias, upstream=upstream, **kw)
    stock_loss, stock_lse, stock_grads = stock_linear_cross_entropy(hidden, weight, target, bias,
                                                                    upstream=upstream, **kw)
    out, loss, grads = run_fused(hidden, weight, target, bias, backend=backend, upstream=upstream,
                                 poison=poison, **kw)
    reduction = kw.get("reduction", "mean")
    assert tuple(loss.shape) == (tuple(target.shape) if reduction == "none" else ()), loss.shape
    assert_linear_loss_close(loss, ref, dtype, stock_loss)
    for name, tensor in (("grad_hidden", hidden), ("grad_weight", weight), ("grad_bias", bias)):
        if tensor is not None and tensor.requires_grad:
            assert tuple(grads[name].shape) == tuple(tensor.shape), name
            assert_linear_grad_close(name, grads[name], ref, stock_grads, tensor.dtype)
    ignored = target == kw.get("ignore_index", -100)
    if bool(ignored.any()):
        if "grad_hidden" in grads:
            assert bool((grads["grad_hidden"][ignored] == 0).all()), "ignored rows: hidden grad must be 0"
        if reduction == "none":
            assert bool((loss[ignored] == 0).all()), f"ignored rows' loss must be 0.0, got {loss[ignored]}"
    if kw.get("return_stats"):
        check_stats(out, ref, target, dtype, stock_lse, **kw)
    return ref, out, loss, grads
