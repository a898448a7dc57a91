"""Cross-entropy backward with probability ("soft") targets: 2-D grid (row, vocabulary block), the softmax recomputed
from the saved lse pair, one pass (as ``ce_backward``)."""
import triton
import triton.language as tl

from .common import aligned
from .row_math import logit_slope, logit_transform, store_grad
from .probs_forward import probs_target_block


@triton.jit
def probs_backward_kernel(
    # pointers
    logits_ptr,       # [n_rows, n_cols] fp32/bf16/fp16, last dim contiguous
    q_ptr,            # [n_rows, n_cols] fp32/bf16/fp16 target probabilities, last dim contiguous
    grad_ptr,         # [n_rows, n_cols] out, logits' dtype; may equal logits_ptr (in-place)
    weight_ptr,       # [n_cols] class weights (FLAGS.HAS_WEIGHT)
    lse_ptr,          # [n_rows] fp32 from the forward
    lse_lo_ptr,       # [n_rows] fp32 from the forward: lse's rounding error
    a_ptr,            # [n_rows] fp32 from the forward: A = sum_c u_c
    grad_row_ptr,     # [n_rows] upstream gradient of the loss (any float dtype, any stride, 0 allowed)
    grad_lse_ptr,     # [n_rows] upstream gradient of the lse (HAS_GRAD_LSE; any float dtype and stride)
    # sizes
    n_cols,
    # strides (elements)
    stride_logits_row, stride_q_row, stride_grad_row, stride_grad_row_vec, stride_grad_lse,
    # loss options (``options.LossScalars``: runtime fp32)
    scalars,
    # meta-parameters
    BLOCK_V: tl.constexpr,
    ALIGN: tl.constexpr,  # n_cols and the three row strides are multiples of ALIGN (see common.aligned)
    FLAGS: tl.constexpr,  # the loss options' code paths (options.LossFlags)
    HAS_GRAD_LSE: tl.constexpr,
    ROUND_BF16: tl.constexpr = False,  # interpreter only: round to nearest as GPUs do (common.to_bf16_rne)
):
    n_cols = aligned(n_cols, ALIGN)
    stride_logits_row = aligned(stride_logits_row, ALIGN)
    stride_q_row = aligned(stride_q_row, ALIGN)
    stride_grad_row = aligned(stride_grad_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < n_cols
    x = tl.load(logits_ptr + row * stride_logits_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = probs_target_block(q_ptr + row * stride_q_row, weight_ptr, cols, mask, n_cols, scalars, FLAGS)
    g = tl.load(grad_row_ptr + row * stride_grad_row_vec).to(tl.float32)
    z = logit_transform(x, scalars, FLAGS)
    p = tl.exp((z - tl.load(lse_ptr + row)) - tl.load(lse_lo_ptr + row))
    dz = g * (tl.load(a_ptr + row) * p - u)
    if HAS_GRAD_LSE:
        dz += tl.load(grad_lse_ptr + row * stride_grad_lse).to(tl.float32) * p
    store_grad(grad_ptr + row * stride_grad_row + cols, dz * logit_slope(z, scalars, FLAGS), mask, ROUND_BF16)
