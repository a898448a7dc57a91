"""Cross-entropy forward in CuTe DSL: one CTA per row, the row streamed once in 128-bit vectors."""
import cutlass  # noqa: F401 (as before; the DSL compiles this module)
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fusedce.core.options import LossFlags, LossScalars
from .row_io import store_row_results, target_terms, total_weight
from .row_math import row_loss, target_row_stats, transform


class CEForward:
    """``__call__(mX (M, V), mTarget (M,) int64, mW (V,) fp32 | None, mWSum (1,) fp32 | None, mLoss, mLse, mLseLo (M,)
    fp32, mPred (M,) int64 | None, scalars, stream)``; ``scalars``: the options' ``options.LossScalars`` of DSL
    scalars (``kernels/scalars.py``; ``lse_square_scale`` unused here), ``FLAGS``: their ``options.LossFlags``."""

    def __init__(self, vec: int, threads: int, FLAGS: LossFlags, compute_stats: bool):
        self.vec, self.threads = vec, threads
        self.FLAGS, self.compute_stats = FLAGS, compute_stats

    @cute.jit
    def __call__(self, mX: cute.Tensor, mTarget: cute.Tensor, mW, mWSum, mLoss: cute.Tensor,
                 mLse: cute.Tensor, mLseLo: cute.Tensor, mPred, scalars: LossScalars, stream):
        self.kernel(mX, mTarget, mW, mWSum, mLoss, mLse, mLseLo, mPred, scalars).launch(
            grid=[mX.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mTarget: cute.Tensor, mW, mWSum, mLoss: cute.Tensor,
               mLse: cute.Tensor, mLseLo: cute.Tensor, mPred, scalars: LossScalars):
        FLAGS, COMPUTE_STATS = self.FLAGS, self.compute_stats
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        n_cols = Int32(mX.shape[1])
        gRow = mX[row, None]
        gW = None
        if const_expr(FLAGS.HAS_WEIGHT):
            gW = mW
        target, is_valid, m, s, zsum, best, idx = target_row_stats(gRow, gW, mTarget, row, n_cols, tidx, scalars,
                                                                   self.threads, self.vec, FLAGS, COMPUTE_STATS)
        if tidx == 0:
            # the target's terms only now: nothing but the row state is live across the stream
            _, in_range, safe, w_t = target_terms(target, n_cols, scalars, mW, FLAGS)
            total_w = total_weight(mWSum, n_cols, FLAGS)
            z_t = transform(Float32(gRow[safe]), scalars, FLAGS)
            loss, lse, lse_lo = row_loss(m, s, zsum, z_t, w_t, total_w, n_cols, is_valid, in_range, scalars, FLAGS)
            store_row_results(mLoss, mLse, mLseLo, mPred, None, row, loss, lse, lse_lo, idx, is_valid,
                              Float32(0.0), COMPUTE_STATS, False)
