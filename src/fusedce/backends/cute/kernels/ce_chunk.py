"""Fused cross-entropy forward + gradient of one chunk of logits, written over the logits: the hot path of
``linear_cross_entropy`` (mean / sum), where each row's upstream gradient is known in forward."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fusedce.core.options import LossFlags, LossScalars
from .chunk_row import chunk_row_factors
from .row_io import store_row_results, target_terms
from .row_math import grad_coefs, grad_vector, target_row_stats, transform


class CEChunk:
    """``__call__(mX (M, V) in/out, mTarget (M,) int64, mW | None, mWSum | None, mGradRow (M,) fp32,
    mZGradRow (M,) fp32 | None, mLoss, mLse, mLseLo (M,) fp32, mPred (M,) int64 | None,
    mTokenWeight (M,) fp32 | None, scalars, stream)``; ``scalars`` and ``FLAGS`` as ``CEForward``'s
    (``scalars.lse_square_scale`` is the z-loss coefficient)."""

    def __init__(self, vec: int, threads: int, FLAGS: LossFlags, compute_stats: bool, has_zloss: bool,
                 token_scaling: bool):
        self.vec, self.threads = vec, threads
        self.FLAGS, self.features = FLAGS, (compute_stats, has_zloss, token_scaling)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mTarget: cute.Tensor, mW, mWSum, mGradRow: cute.Tensor, mZGradRow,
                 mLoss: cute.Tensor, mLse: cute.Tensor, mLseLo: cute.Tensor, mPred, mTokenWeight,
                 scalars: LossScalars, stream):
        self.kernel(mX, mTarget, mW, mWSum, mGradRow, mZGradRow, mLoss, mLse, mLseLo, mPred, mTokenWeight,
                    scalars).launch(grid=[mX.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mTarget: cute.Tensor, mW, mWSum, mGradRow: cute.Tensor, mZGradRow,
               mLoss: cute.Tensor, mLse: cute.Tensor, mLseLo: cute.Tensor, mPred, mTokenWeight,
               scalars: LossScalars):
        FLAGS = self.FLAGS
        COMPUTE_STATS, HAS_ZLOSS, TOKEN_SCALING = self.features
        VEC, THREADS = self.vec, self.threads
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        n_cols = Int32(mX.shape[1])
        gRow = mX[row, None]
        gW = None
        if const_expr(FLAGS.HAS_WEIGHT):
            gW = mW
        target, is_valid, m, s, zsum, best, idx = target_row_stats(gRow, gW, mTarget, row, n_cols, tidx, scalars,
                                                                   THREADS, VEC, FLAGS, COMPUTE_STATS)
        # the target's terms only now: nothing but the row state is live across the stream
        _, in_range, safe, w_t = target_terms(target, n_cols, scalars, mW, FLAGS)
        # every thread reads z_t (one broadcast load) before any thread overwrites the row
        z_t = transform(Float32(gRow[safe]), scalars, FLAGS)
        loss, lse, lse_lo, g, h, p_t, total_w = chunk_row_factors(
            m, s, zsum, z_t, w_t, n_cols, is_valid, in_range, mWSum, mGradRow, mZGradRow, row, scalars, FLAGS,
            HAS_ZLOSS, TOKEN_SCALING)
        if tidx == 0:
            store_row_results(mLoss, mLse, mLseLo, mPred, mTokenWeight, row, loss, lse, lse_lo, idx, is_valid, p_t,
                              COMPUTE_STATS, TOKEN_SCALING)
        cute.arch.barrier()    # z_t was read by every thread before the row is overwritten
        a, b = grad_coefs(w_t, n_cols, scalars)
        t_col = Int32(-1)
        if in_range:
            t_col = safe
        for v in cutlass.range(tidx, n_cols // VEC, THREADS):
            grad_vector(gRow, gW, gRow, v, is_valid, t_col, a, lse, lse_lo, g, h, b, total_w, scalars, VEC, FLAGS,
                        HAS_ZLOSS)
