"""Low-precision inputs and the gradient accumulation dtype of ``linear_cross_entropy``.

bf16 / fp16 logits are computed in the inputs' dtype (as ``F.linear``), so the fused result is judged
against the error stock PyTorch makes at the same dtype (``F.linear`` -> ``.float()`` ->
``F.cross_entropy``) versus float64, times LINEAR_FACTOR (reference64_linear.py). The weight and bias
gradients accumulate across chunks in ``accum_dtype`` and are returned in their tensors' dtypes.
"""
import pytest
import torch

from tolerances import FP32_UNITS, U32
from inputs import DTYPE_IDS, DTYPES, make_target, make_weight
from reference64_linear import (LINEAR_FACTOR, check_linear, make_linear, reference_linear_cross_entropy,
                                run_fused, stock_linear_cross_entropy)

# 18 tokens as (3, 6), H = 32, V = 512 (at most 18 x 512 logits per launch), every 3rd token ignored:
# 12 rows remain, chunks of 5 = 5, 5, 2 (the last partial), or one automatic chunk.
LEAD, HIDDEN, V = (3, 6), 32, 512

CONFIGS = {
    "plain": {},
    "all_options": {"label_smoothing": 0.1, "lse_square_scale": 1e-2, "softcap": 30.0},
    "ce_weight+num_items": {"num_items_in_batch": 40},
}


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
def test_low_precision_against_stock_error(backend, dtype, config, reduction):
    """(fp32 runs the same checks in test_linear_options.py.)"""
    _check_dtype(backend, dtype, config, reduction, chunk_size=5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_automatic_chunk_all_dtypes(backend, dtype):
    _check_dtype(backend, dtype, "all_options", "sum", chunk_size=None)


def _check_dtype(backend, dtype, config, reduction, chunk_size):
    opts = dict(CONFIGS[config])
    hidden, weight, bias = make_linear(LEAD, HIDDEN, V, dtype, bias=True,
                                       logit_scale=40.0 if "softcap" in opts else 2.0)
    target = make_target(LEAD, V, ignore_every=3)
    if config.startswith("ce_weight"):
        opts["ce_weight"] = make_weight(V)
    up = torch.randn(LEAD) if reduction == "none" else 0.5
    check_linear(hidden, weight, target, bias, backend=backend, reduction=reduction, chunk_size=chunk_size,
                 upstream=up, return_stats=True, **opts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
def test_low_precision_stats(backend, dtype):
    """lse / predicted / z_loss of bf16 and fp16 inputs (stats judged like the loss)."""
    hidden, weight, bias = make_linear((20,), HIDDEN, V, dtype, bias=True)
    target = make_target((20,), V, ignore_every=4)
    check_linear(hidden, weight, target, bias, backend=backend, reduction="none", chunk_size=7,
                 upstream=torch.randn(20), lse_square_scale=1e-2, return_stats=True)


# ---------------------------------------------------------------------------------------------------
# accum_dtype. 16 tokens, chunk_size=1: 16 chunks, so grad_W and grad_b are sums of 16 chunk terms
# accumulated one by one, where the accumulation dtype shows. V = 256 keeps 16 launches cheap.
ACC_ROWS, ACC_V = 16, 256


def _errors(dtype, accum_dtype, backend, chunk_size=1, seed_tensors=None):
    hidden, weight, bias, target = seed_tensors
    ref = reference_linear_cross_entropy(hidden, weight, target, bias)
    _, _, stock = stock_linear_cross_entropy(hidden, weight, target, bias)
    _, _, grads = run_fused(hidden, weight, target, bias, backend=backend, chunk_size=chunk_size,
                            accum_dtype=accum_dtype)
    err = {n: float((g.double() - getattr(ref, n)).abs().max()) for n, g in grads.items()}
    stock_err = {n: float((g.double() - getattr(ref, n)).abs().max()) for n, g in stock.items()}
    return ref, grads, err, stock_err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
def test_low_precision_weights_fp32_accumulation(backend, dtype):
    """bf16 / fp16 weights, accum_dtype=float32 (the default): 16 chunk terms summed in fp32 and rounded
    once, so the error equals stock's one bf16 matmul (<= LINEAR_FACTOR x) and is no worse than
    accumulating in the weights' own dtype."""
    tensors = (*make_linear((ACC_ROWS,), HIDDEN, ACC_V, dtype, bias=True), make_target((ACC_ROWS,), ACC_V))
    ref, grads, err32, stock_err = _errors(dtype, torch.float32, backend, seed_tensors=tensors)
    for name in ("grad_weight", "grad_bias"):
        assert grads[name].dtype == dtype
        bound = LINEAR_FACTOR[dtype] * stock_err[name] + float(ref.floors[name].max())
        assert err32[name] <= bound, f"{name}: error {err32[name]:.3e} > {bound:.3e} (stock {stock_err[name]:.3e})"
    _, grads_low, err_low, _ = _errors(dtype, dtype, backend, seed_tensors=tensors)
    for name in ("grad_weight", "grad_bias"):
        assert grads_low[name].dtype == dtype
        assert err32[name] <= err_low[name], (
            f"{name}: fp32 accumulation error {err32[name]:.3e} > {DTYPE_IDS[dtype]} accumulation's "
            f"{err_low[name]:.3e}")
        # recursive summation of 16 terms in the low dtype: at most 16 roundings of the running sum
        ulp = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}[dtype]
        mag = ref.floors[name] / (FP32_UNITS * U32)   # sum of |terms| per element
        bound = LINEAR_FACTOR[dtype] * stock_err[name] + float((ACC_ROWS * ulp * mag).max())
        assert err_low[name] <= bound, (name, err_low[name], bound)


@pytest.mark.parametrize("accum_dtype", [torch.float32, torch.float64], ids=["acc_fp32", "acc_fp64"])
def test_fp32_accumulation_dtypes(backend, accum_dtype):
    """fp32 inputs, fp32 or fp64 accumulation: fp32 gradients within the fp32 rule."""
    hidden, weight, bias = make_linear((ACC_ROWS,), HIDDEN, ACC_V, torch.float32, bias=True)
    target = make_target((ACC_ROWS,), ACC_V, ignore_every=5)
    check_linear(hidden, weight, target, bias, backend=backend, chunk_size=1, accum_dtype=accum_dtype)


def test_bf16_accumulation_keeps_dtypes(backend):
    """accum_dtype=bfloat16 on bf16 inputs: the gradients still have the tensors' dtypes and shapes."""
    hidden, weight, bias = make_linear((12,), HIDDEN, ACC_V, torch.bfloat16, bias=True)
    target = make_target((12,), ACC_V, ignore_every=3)
    _, _, grads = run_fused(hidden, weight, target, bias, backend=backend, chunk_size=4,
                            accum_dtype=torch.bfloat16)
    for name, t in (("grad_hidden", hidden), ("grad_weight", weight), ("grad_bias", bias)):
        assert grads[name].dtype == t.dtype and grads[name].shape == t.shape
        assert bool(torch.isfinite(grads[name]).all())
