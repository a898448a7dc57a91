"""A row's inputs and outputs in the CuTe kernels: its target's terms (validity, range, column, class weight), the
class weights' sum and the stores of its per-row results (loss, lse pair, argmax, ``p_t``)."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr


@cute.jit
def target_terms(target: Int64, n_cols: Int32, scalars, mW, FLAGS: cutlass.Constexpr):
    """``(is_valid, in_range, safe, w_t)``: ``safe`` is 0 unless the target is a class in [0, V), so
    the loads at it are always in bounds (a bad target gives a NaN loss row, never a wild read)."""
    is_valid = target != scalars.ignore_index
    in_range = target >= Int64(0) and target < Int64(n_cols)
    safe = Int32(0)
    if in_range:
        safe = Int32(target)
    w_t = Float32(1.0)
    if const_expr(FLAGS.HAS_WEIGHT):
        w_t = Float32(mW[safe])
    return is_valid, in_range, safe, w_t


@cute.jit
def total_weight(mWSum, n_cols: Int32, FLAGS: cutlass.Constexpr) -> Float32:
    """``W``, the class weights' sum (``mWSum[0]``, read only where the smoothing term needs it), else V."""
    total_w = Float32(n_cols)
    if const_expr(FLAGS.HAS_WEIGHT and FLAGS.HAS_SMOOTHING):
        total_w = mWSum[0]
    return total_w


@cute.jit
def store_row_results(mLoss: cute.Tensor, mLse: cute.Tensor, mLseLo: cute.Tensor, mPred, mTokenWeight, row,
                      loss: Float32, lse: Float32, lse_lo: Float32, idx: Int32, is_valid, p_t: Float32,
                      COMPUTE_STATS: cutlass.Constexpr[bool], TOKEN_SCALING: cutlass.Constexpr[bool]):
    """One thread writes the row's loss, lse pair, argmax (-1 on an ignored row) and ``p_t``."""
    mLoss[row] = loss
    mLse[row] = lse
    mLseLo[row] = lse_lo
    if const_expr(COMPUTE_STATS):
        pred = Int64(-1)
        if is_valid:
            pred = Int64(idx)
        mPred[row] = pred
    if const_expr(TOKEN_SCALING):
        mTokenWeight[row] = p_t
