"""Tiled LM-head cross-entropy backward: no logits or gradient-of-logits tensor of any size.

Grid: one program per (tile of BLOCK_N tokens, tile of BLOCK_V classes), so even a few tokens fill the
GPU. Each program
  1. recomputes its logits tile (``tile_math.logits_tile``: tl.dot over H, + bias, rounded to hidden's
     dtype) from hidden and weight;
  2. forms ``dL/dx`` in registers from the forward's lse pair (``row_math.grad_block`` on the 2-D tile:
     the loss, lse (z-loss) and entropy upstreams, smoothing, class weights, softcap, logit_scale),
     zeroes ignored rows and columns past V, and rounds it to hidden's dtype (the value the chunked
     path stores in its logits buffer; bf16 / fp16 operands run on tensor cores);
  3. accumulates its share of the two products with fp32 atomics, looping over H in BLOCK_H steps:
         grad_hidden[rows, k] += dx @ weight[cols, k]        (BLOCK_N x BLOCK_H per step)
         grad_weight[cols, k] += dx.T @ hidden[rows, k]      (BLOCK_V x BLOCK_H per step)
         grad_bias[cols]      += sum_rows dx
     A program whose rows are all ignored, or whose rounded dx is exactly zero everywhere (e.g. a
     -inf bias block, or probabilities that underflow the dtype), returns before step 3: skipping an
     exact zero changes nothing.

Why atomics (Cut Cross-Entropy's choice, Wijmans et al. 2024), and what they cost. The two products
reduce over different axes (grad_hidden over classes, grad_weight over tokens), and neither accumulator
fits on chip (BLOCK_N x H or BLOCK_V x H fp32 for H = 4096 is 1-2 MiB per program). The alternatives are
two kernels that each own one accumulator (deterministic, but the logits are recomputed twice: 8 V H
FLOPs per token instead of 6, plus the same read-modify-write traffic of the owned accumulator; that is
``tiled_backward_owned.py``, run when determinism is asked for), or
split reductions into per-tile partial buffers (n x H x V / BLOCK_V floats: a tensor larger than the
logits). Atomics keep the FLOPs at the floor (6 V H per token: recompute, grad_hidden, grad_weight) and
one launch, at the price of
  - nondeterminism: fp32 additions land in a run-dependent order (results differ in the last bits
    between runs; under the Triton interpreter the programs run one after another, so CPU tests are
    deterministic);
  - atomic traffic, resolved in L2: per token 4 H V / BLOCK_V bytes into grad_hidden and
    4 V H / BLOCK_N into grad_weight (both fp32 read-modify-write);
  - fp32 accumulators: grad_hidden (n x H fp32) is cast to hidden's dtype afterwards, grad_weight /
    grad_bias (V x H, V fp32) are cast to accum_dtype when that is not fp32 (``tiled.py``).

Cost per token (n tokens, V classes, H hidden, s bytes per element):
    FLOPs  6 V H (tensor cores for bf16 / fp16) + ~20 V (fp32 epilogue)
    bytes  read H s + V H s / BLOCK_N (logits recompute) + H s V / BLOCK_V + V H s / BLOCK_N (the operand
           tiles of the two products, L2-resident: the same tiles the recompute just read) + 12-24
           (target, lse, lse_lo, upstreams); atomics 4 H V / BLOCK_V + 4 V H / BLOCK_N (L2 RMW);
           HBM floor: n H s + V H s read, n H 4 + V H 4 written once the accumulators leave L2.
"""
import triton
import triton.language as tl

from .common import tile_rows
from .tile_grads import any_nonzero, dot_operand, operand_slice
from .tile_math import tile_targets
from .tiled_dlogits import recompute_dx


@triton.jit
def atomic_products(dx, hidden_ptr, weight_ptr, rows, row_mask, out_mask, cols, col_mask, n_hidden,
                    stride_hidden, stride_weight, grad_hidden_ptr, grad_weight_ptr, grad_bias_ptr,
                    BLOCK_H: tl.constexpr, NEED_GRAD_HIDDEN: tl.constexpr, NEED_GRAD_WEIGHT: tl.constexpr,
                    NEED_GRAD_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Add the tile's three products (``tile_grads``' docstring) with fp32 atomics into zeroed fp32
    ``grad_hidden`` (n, H), ``grad_weight`` (V, H) and ``grad_bias`` (V,), each only when asked for (also
    the atomic distillation gradient's, ``distill_tiled_grad``). ``rows`` (BLOCK_N,) int64 token indices,
    ``row_mask`` the rows whose hidden state is read and ``out_mask`` those whose grad_hidden is written
    (the rows that count, never past n), ``cols`` (BLOCK_V,) class indices, ``col_mask`` ``cols < V``."""
    if NEED_GRAD_BIAS:
        tl.atomic_add(grad_bias_ptr + cols, tl.sum(dx, axis=0), mask=col_mask)
    op = dot_operand(dx, hidden_ptr, UPCAST)
    h_rows = hidden_ptr + rows[:, None] * stride_hidden
    w_rows = weight_ptr + cols.to(tl.int64)[:, None] * stride_weight
    for k0 in range(0, n_hidden, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < n_hidden
        if NEED_GRAD_HIDDEN:
            wt = operand_slice(w_rows, ks, col_mask, k_mask, UPCAST)
            dh = tl.dot(op, wt, input_precision=DOT_PRECISION)
            tl.atomic_add(grad_hidden_ptr + rows[:, None] * n_hidden + ks[None, :], dh,
                          mask=out_mask[:, None] & k_mask[None, :])
        if NEED_GRAD_WEIGHT:
            ht = operand_slice(h_rows, ks, row_mask, k_mask, UPCAST)
            dw = tl.dot(tl.trans(op), ht, input_precision=DOT_PRECISION)
            tl.atomic_add(grad_weight_ptr + cols.to(tl.int64)[:, None] * n_hidden + ks[None, :], dw,
                          mask=col_mask[:, None] & k_mask[None, :])


@triton.jit
def tiled_backward_kernel(
    # pointers
    hidden_ptr,        # [n_rows, n_hidden] fp32/bf16/fp16, last dim contiguous
    weight_ptr,        # [n_cols, n_hidden] hidden's dtype, last dim contiguous
    bias_ptr,          # [n_cols] hidden's dtype (HAS_BIAS)
    target_ptr,        # [n_rows] int32/int64
    class_weight_ptr,  # [n_cols] fp32 class weights (FLAGS.HAS_WEIGHT)
    weight_sum_ptr,    # [1] fp32 sum of the class weights (FLAGS: HAS_WEIGHT and HAS_SMOOTHING)
    lse_ptr,           # [n_rows] fp32 from the forward
    lse_lo_ptr,        # [n_rows] fp32 from the forward
    grad_row_ptr,      # [n_rows] upstream gradient of the loss (any float dtype, any stride)
    grad_lse_ptr,      # [n_rows] upstream gradient of the lse (HAS_GRAD_LSE)
    grad_entropy_ptr,  # [n_rows] upstream gradient of the entropy (HAS_GRAD_ENTROPY)
    entropy_ptr,       # [n_rows] fp32 entropy from the forward (HAS_GRAD_ENTROPY)
    grad_hidden_ptr,   # [n_rows, n_hidden] fp32, zeroed, accumulated atomically (NEED_GRAD_HIDDEN)
    grad_weight_ptr,   # [n_cols, n_hidden] fp32, zeroed, accumulated atomically (NEED_GRAD_WEIGHT)
    grad_bias_ptr,     # [n_cols] fp32, zeroed, accumulated atomically (NEED_GRAD_BIAS)
    # sizes
    n_rows, n_cols, n_hidden,
    # strides (elements)
    stride_hidden, stride_weight, stride_target, stride_grad_row, stride_grad_lse, stride_grad_entropy,
    # loss options (``options.LossScalars``: runtime, fp32 but ignore_index; changing them does not recompile)
    scalars,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    FLAGS: tl.constexpr,  # the loss options' code paths (options.LossFlags: HAS_WEIGHT, HAS_SMOOTHING, ...)
    HAS_BIAS: tl.constexpr,
    HAS_GRAD_LSE: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
    NEED_GRAD_HIDDEN: tl.constexpr, NEED_GRAD_WEIGHT: tl.constexpr, NEED_GRAD_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr = False,            # interpreter only (tile_math.logits_tile)
    ROUND_BF16: tl.constexpr = False,        # interpreter only (tile_math.round_like)
):
    rows, in_rows = tile_rows(tl.program_id(0) * BLOCK_N, n_rows, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < n_cols
    target, is_valid, _in_range, w_t = tile_targets(target_ptr, rows, in_rows, stride_target, class_weight_ptr,
                                                    n_cols, scalars, FLAGS, BLOCK_N)
    if tl.max(is_valid.to(tl.int32), axis=0) > 0:   # a tile of ignored rows: zero gradient, no work
        dx = recompute_dx(hidden_ptr, weight_ptr, bias_ptr, rows, in_rows, is_valid, cols, col_mask, target,
                          w_t, lse_ptr, lse_lo_ptr, grad_row_ptr, grad_lse_ptr, grad_entropy_ptr, entropy_ptr,
                          class_weight_ptr, weight_sum_ptr, n_cols, n_hidden, stride_hidden, stride_weight,
                          stride_grad_row, stride_grad_lse, stride_grad_entropy, scalars, FLAGS, BLOCK_N, BLOCK_V,
                          BLOCK_H, HAS_BIAS, HAS_GRAD_LSE, HAS_GRAD_ENTROPY, DOT_PRECISION, UPCAST, ROUND_BF16)
        if any_nonzero(dx):   # an exactly-zero tile adds nothing
            atomic_products(dx, hidden_ptr, weight_ptr, rows, is_valid, in_rows & is_valid, cols, col_mask,
                            n_hidden, stride_hidden, stride_weight, grad_hidden_ptr, grad_weight_ptr, grad_bias_ptr,
                            BLOCK_H, NEED_GRAD_HIDDEN, NEED_GRAD_WEIGHT, NEED_GRAD_BIAS, DOT_PRECISION, UPCAST)
