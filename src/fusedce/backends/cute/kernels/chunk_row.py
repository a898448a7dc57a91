"""The per-row epilogue shared by the two fused chunk kernels (``ce_chunk.CEChunk`` and
``ce_chunk_onchip.CEChunkOnChip``): once a row's statistics are known, its loss and lse pair and the upstream
gradient factors of the gradient pass (the stores are ``row_io.store_row_results``)."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .row_io import total_weight
from .row_math import row_loss


@cute.jit
def chunk_row_factors(m: Float32, s: Float32, zsum: Float32, z_t: Float32, w_t: Float32, n_cols: Int32,
                      is_valid, in_range, mWSum, mGradRow: cute.Tensor, mZGradRow, row, scalars,
                      FLAGS: cutlass.Constexpr, HAS_ZLOSS: cutlass.Constexpr[bool],
                      TOKEN_SCALING: cutlass.Constexpr[bool]):
    """``(loss, lse, lse_lo, g, h, p_t, total_w)``: the row's loss and exact lse pair; ``g`` the upstream
    gradient of its loss and ``h = 2 s lse zg`` that of its lse (the z-loss, ``s = lse_square_scale``),
    both times ``p_t`` with token scaling (Dynamic Fine-Tuning: the row's whole loss times its detached
    ``p_t``; 0 without it); ``total_w = W``, the class weights' sum (V without weights)."""
    total_w = total_weight(mWSum, n_cols, FLAGS)
    loss, lse, lse_lo = row_loss(m, s, zsum, z_t, w_t, total_w, n_cols, is_valid, in_range, scalars, FLAGS)
    g = Float32(mGradRow[row])
    zg = Float32(0.0)
    if const_expr(HAS_ZLOSS):
        zg = Float32(mZGradRow[row])
    p_t = Float32(0.0)
    if const_expr(TOKEN_SCALING):
        if is_valid and in_range:
            p_t = cute.math.exp((z_t - lse) - lse_lo)
        g = g * p_t
        zg = zg * p_t
    h = Float32(2.0) * scalars.lse_square_scale * lse * zg   # d(s lse^2)/d lse times its upstream
    return loss, lse, lse_lo, g, h, p_t, total_w
