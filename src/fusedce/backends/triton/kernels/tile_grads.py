"""The products of one ``dL/dx`` tile into the LM head's gradients, shared by the tiled cross-entropy and
distillation backward kernels."""
import triton
import triton.language as tl


@triton.jit
def any_nonzero(dx):
    """Whether the tile ``dx`` holds a nonzero value (an exactly-zero tile adds nothing and is skipped)."""
    return tl.sum((dx != 0.0).to(tl.int32)) > 0


@triton.jit
def dot_operand(dx, hidden_ptr, UPCAST: tl.constexpr):
    """``dx`` as the products' operand: hidden's dtype (exact), or fp32 with UPCAST."""
    if UPCAST:
        op = dx
    else:
        op = dx.to(hidden_ptr.dtype.element_ty)
    return op


@triton.jit
def operand_slice(row_ptrs, ks, row_mask, k_mask, UPCAST: tl.constexpr):
    """(R, BLOCK_H) slice ``ks`` of a row-major operand at ``row_ptrs``; 0 outside ``row_mask`` and ``ks < H``."""
    t = tl.load(row_ptrs + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    if UPCAST:
        t = t.to(tl.float32)
    return t


@triton.jit
def add_product(a, b_rows, b_mask, out_rows, out_mask, n_hidden, BLOCK_H: tl.constexpr,
                DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``out[:, k] += a @ b[:, k]`` over H in BLOCK_H slices, into owned rows of an fp32 accumulator (``out_rows``)."""
    for k0 in range(0, n_hidden, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < n_hidden
        b = operand_slice(b_rows, ks, b_mask, k_mask, UPCAST)
        mask = out_mask[:, None] & k_mask[None, :]
        acc = tl.load(out_rows + ks[None, :], mask=mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        tl.store(out_rows + ks[None, :], acc, mask=mask)
    tl.debug_barrier()   # this tile's stores before the next tile's loads (tiled_backward_owned.py)


@triton.jit
def add_grad_hidden(dx, hidden_ptr, weight_ptr, out_rows, row_mask, cols, col_mask, n_hidden, stride_weight,
                    BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``grad_hidden[rows] += dx @ weight[cols]`` into owned rows of the fp32 accumulator."""
    w_rows = weight_ptr + cols.to(tl.int64)[:, None] * stride_weight
    add_product(dot_operand(dx, hidden_ptr, UPCAST), w_rows, col_mask, out_rows, row_mask, n_hidden, BLOCK_H,
                DOT_PRECISION, UPCAST)


@triton.jit
def add_grad_weight(dx, hidden_ptr, rows, row_mask, out_cols, col_mask, n_hidden, stride_hidden,
                    BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``grad_weight[cols] += dx.T @ hidden[rows]`` into owned rows (masked rows' hidden states unread)."""
    h_rows = hidden_ptr + rows[:, None] * stride_hidden
    add_product(tl.trans(dot_operand(dx, hidden_ptr, UPCAST)), h_rows, row_mask, out_cols, col_mask, n_hidden,
                BLOCK_H, DOT_PRECISION, UPCAST)
