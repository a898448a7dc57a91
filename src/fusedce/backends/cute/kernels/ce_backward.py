"""Cross-entropy backward in CuTe DSL: 2-D grid (row, vocabulary tile), softmax recomputed from the saved lse pair."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from fusedce.core.options import LossFlags, LossScalars
from .row_io import target_terms, total_weight
from .row_math import grad_coefs, grad_vector


class CEBackward:
    """``__call__(mX (M, V), mG (M, V) out, mTarget (M,) int64, mW (V,) fp32 | None, mWSum (1,) fp32 |
    None, mLse, mLseLo, mGradRow (M,) fp32, mGradLse (M,) fp32 | None, scalars, stream)``; ``scalars``
    and ``FLAGS`` as ``CEForward``'s."""

    def __init__(self, vec: int, threads: int, unroll: int, FLAGS: LossFlags, has_grad_lse: bool):
        self.vec, self.threads, self.unroll = vec, threads, unroll
        self.FLAGS, self.has_grad_lse = FLAGS, has_grad_lse

    @cute.jit
    def __call__(self, mX: cute.Tensor, mG: cute.Tensor, mTarget: cute.Tensor, mW, mWSum, mLse: cute.Tensor,
                 mLseLo: cute.Tensor, mGradRow: cute.Tensor, mGradLse, scalars: LossScalars, stream):
        tile = self.threads * self.vec * self.unroll
        self.kernel(mX, mG, mTarget, mW, mWSum, mLse, mLseLo, mGradRow, mGradLse, scalars).launch(
            grid=[mX.shape[0], cute.ceil_div(mX.shape[1], tile), 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mG: cute.Tensor, mTarget: cute.Tensor, mW, mWSum, mLse: cute.Tensor,
               mLseLo: cute.Tensor, mGradRow: cute.Tensor, mGradLse, scalars: LossScalars):
        FLAGS, HAS_GRAD_LSE = self.FLAGS, self.has_grad_lse
        VEC, THREADS, UNROLL = self.vec, self.threads, self.unroll
        tidx, _, _ = cute.arch.thread_idx()
        row, tile_idx, _ = cute.arch.block_idx()
        n_cols = Int32(mX.shape[1])
        target = Int64(mTarget[row])
        is_valid, _in_range, _safe, w_t = target_terms(target, n_cols, scalars, mW, FLAGS)
        g = mGradRow[row]
        h = Float32(0.0)
        if const_expr(HAS_GRAD_LSE):
            h = mGradLse[row]
        total_w = total_weight(mWSum, n_cols, FLAGS)
        a, b = grad_coefs(w_t, n_cols, scalars)
        lse, lse_lo = mLse[row], mLseLo[row]
        # target as an int32 column; an ignored or bad target never matches a column in [0, V)
        t_col = Int32(-1)
        if target >= Int64(0) and target < Int64(n_cols):
            t_col = Int32(target)
        gW = None
        if const_expr(FLAGS.HAS_WEIGHT):
            gW = mW
        gX, gG = mX[row, None], mG[row, None]
        n_vec = n_cols // VEC
        for u in cutlass.range_constexpr(UNROLL):
            v = (tile_idx * UNROLL + u) * THREADS + tidx
            if v < n_vec:
                grad_vector(gX, gW, gG, v, is_valid, t_col, a, lse, lse_lo, g, h, b, total_w, scalars, VEC, FLAGS,
                            HAS_GRAD_LSE)
