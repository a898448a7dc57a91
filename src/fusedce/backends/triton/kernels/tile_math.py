"""Tile helpers of the tiled (no-logits) LM-head loss, shared by ``tiled_forward`` and ``tiled_backward``."""
import triton
import triton.language as tl

from .common import target_terms
from .interpreter import to_bf16_rne


@triton.jit
def tile_targets(target_ptr, rows, in_rows, stride_target, class_weight_ptr, n_cols, scalars,
                 FLAGS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(target, is_valid, in_range, w_t)`` of tokens ``rows`` (``common.target_terms``; rows past ``n_rows``
    are ignored, and ``w_t`` is 1 without class weights)."""
    target = tl.load(target_ptr + rows * stride_target, mask=in_rows, other=scalars.ignore_index).to(tl.int64)
    is_valid, in_range, _safe, w_t = target_terms(target, n_cols, class_weight_ptr, scalars, FLAGS)
    w_t = tl.zeros((BLOCK_N,), tl.float32) + w_t    # a (BLOCK_N,) vector also without class weights
    return target, is_valid, in_range, w_t


@triton.jit
def round_like(x, ptr, ROUND_BF16: tl.constexpr):
    """fp32 ``x`` rounded to ``ptr``'s dtype (to nearest) and back; ROUND_BF16: by hand (interpreter only)."""
    if ROUND_BF16:
        y = to_bf16_rne(x).to(tl.float32)
    else:
        y = x.to(ptr.dtype.element_ty).to(tl.float32)
    return y


@triton.jit
def logits_tile(hidden_ptr, weight_ptr, bias_ptr, rows, row_live, cols, col_mask, n_hidden,
                stride_hidden, stride_weight,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr,
                DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 (BLOCK_N, BLOCK_V) logits tile from the operands' values (exact products, fp32 accumulation)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    h_rows = hidden_ptr + rows[:, None] * stride_hidden
    w_rows = weight_ptr + cols.to(tl.int64)[:, None] * stride_weight
    for k0 in range(0, n_hidden, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < n_hidden
        a = tl.load(h_rows + ks[None, :], mask=row_live[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return acc
