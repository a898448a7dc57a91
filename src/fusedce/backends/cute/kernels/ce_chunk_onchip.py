"""Fused cross-entropy forward + gradient of one chunk of logits with each row kept on chip: the logits are read from
HBM once and the gradient written once, whatever the L2 does."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op

from fusedce.core.options import LossFlags, LossScalars
from .chunk_row import chunk_row_factors
from .row_io import store_row_results, target_terms
from .row_math import grad_coefs, grad_vector_from, slice_stats, transform
from .row_reduce import NEG_INF, merge_argmax, merge_softmax

HEADER_BYTES = 512    # the reduction slots (<= 16 warps) and the published CTA state, before the slice


@dsl_user_op
def load_peer(ptr, rank, dtype, *, loc=None, ip=None):
    """``*ptr`` read from the shared memory of CTA ``rank`` of the cluster (``ld.shared::cluster``)."""
    remote = cute.arch.map_dsmem_ptr(ptr, rank, loc=loc, ip=ip)
    return dtype(llvm.load(dtype.mlir_type, remote.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip))


def smem_bytes(n_cols: int, vec: int, itemsize: int, cluster: int) -> int:
    """Dynamic shared memory of one CTA for rows of ``n_cols`` classes (host-side twin of ``__call__``)."""
    n_slice = -(-(n_cols // vec) // cluster)
    return HEADER_BYTES + n_slice * vec * itemsize


class CEChunkOnChip:
    """``__call__`` as ``CEChunk.__call__`` (same arguments, ``scalars`` included, same outputs);
    ``cluster`` CTAs per row."""

    def __init__(self, vec: int, threads: int, cluster: int, FLAGS: LossFlags, compute_stats: bool,
                 has_zloss: bool, token_scaling: bool):
        assert threads // 32 <= 16 and cluster in (1, 2, 4, 8)
        self.vec, self.threads, self.cluster = vec, threads, cluster
        self.FLAGS, self.features = FLAGS, (compute_stats, has_zloss, token_scaling)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mTarget: cute.Tensor, mW, mWSum, mGradRow: cute.Tensor, mZGradRow,
                 mLoss: cute.Tensor, mLse: cute.Tensor, mLseLo: cute.Tensor, mPred, mTokenWeight,
                 scalars: LossScalars, stream):
        n_slice = (mX.shape[1] // self.vec + (self.cluster - 1)) // self.cluster
        smem = HEADER_BYTES + n_slice * (self.vec * mX.element_type.width // 8)
        self.kernel(mX, mTarget, mW, mWSum, mGradRow, mZGradRow, mLoss, mLse, mLseLo, mPred, mTokenWeight,
                    scalars).launch(
            grid=[mX.shape[0] * self.cluster, 1, 1], block=[self.threads, 1, 1],
            cluster=[self.cluster, 1, 1] if const_expr(self.cluster > 1) else None, smem=smem, stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mTarget: cute.Tensor, mW, mWSum, mGradRow: cute.Tensor, mZGradRow,
               mLoss: cute.Tensor, mLse: cute.Tensor, mLseLo: cute.Tensor, mPred, mTokenWeight,
               scalars: LossScalars):
        FLAGS = self.FLAGS
        COMPUTE_STATS, HAS_ZLOSS, TOKEN_SCALING = self.features
        VEC, THREADS, CLUSTER = self.vec, self.threads, self.cluster
        NWARPS = THREADS // 32
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx // CLUSTER
        rank = Int32(0)
        if const_expr(CLUSTER > 1):
            rank = cute.arch.block_idx_in_cluster()
        n_cols = Int32(mX.shape[1])
        n_vec = n_cols // VEC
        n_slice = (n_vec + (CLUSTER - 1)) // CLUSTER
        v0 = rank * n_slice                                   # the slice's first vector in the row
        n_mine = cutlass.max(cutlass.min(n_slice, n_vec - v0), Int32(0))

        # dynamic shared memory, 16-byte aligned: fp32 warp slots (4, NWARPS) at 0, the published fp32
        # state at 256, int32 warp slots at 272, the published argmax at 336; the slice at HEADER_BYTES
        base_f = cute.arch.get_dyn_smem(Float32, alignment=16)
        sbuf_f = cute.make_tensor(base_f, cute.make_layout((4, NWARPS)))
        part_f = cute.make_tensor(base_f + 4 * 16, cute.make_layout(4))
        base_i = cute.arch.get_dyn_smem(Int32, alignment=16)
        sbuf_i = cute.make_tensor(base_i + 4 * 16 + 4, cute.make_layout(NWARPS))
        part_i = cute.make_tensor(base_i + 4 * 16 + 4 + 16, cute.make_layout(1))
        base_x = cute.arch.get_dyn_smem(mX.element_type, alignment=16)
        sRow = cute.make_tensor(base_x + HEADER_BYTES // (mX.element_type.width // 8),
                                cute.make_layout(n_slice * VEC))

        target = Int64(mTarget[row])
        is_valid = target != scalars.ignore_index
        gRow = mX[row, None]
        # 1. the slice into shared memory, every copy in flight before the first wait
        if is_valid:
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                       mX.element_type, num_bits_per_copy=VEC * mX.element_type.width)
            for v in cutlass.range(tidx, n_mine, THREADS):
                cute.copy(atom, cute.local_tile(gRow, (VEC,), (v0 + v,)), cute.local_tile(sRow, (VEC,), (v,)))
        cute.arch.cp_async_commit_group()
        _, in_range, safe, w_t = target_terms(target, n_cols, scalars, mW, FLAGS)
        # z_t before any barrier: no CTA of this row has written its gradient yet
        z_t = transform(Float32(gRow[safe]), scalars, FLAGS)
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()

        # 2. the slice's state from shared memory (nothing was copied for an ignored row: nothing read)
        n_read = Int32(0)
        if is_valid:
            n_read = n_mine
        gW = None
        if const_expr(FLAGS.HAS_WEIGHT):
            gW = mW
        m, s, zsum, best, idx = slice_stats(sRow, v0, gW, n_read, tidx, scalars, sbuf_f, sbuf_i, THREADS, VEC,
                                            FLAGS, COMPUTE_STATS)
        # 3. merge the cluster's states through distributed shared memory, in rank order
        if const_expr(CLUSTER > 1):
            if tidx == 0:
                part_f[0], part_f[1], part_f[2], part_f[3] = m, s, zsum, best
                part_i[0] = idx
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            m, s, zsum, best, idx = Float32(NEG_INF), Float32(0.0), Float32(0.0), Float32(NEG_INF), Int32(0)
            for r in cutlass.range_constexpr(CLUSTER):
                m, s = merge_softmax(m, s, load_peer(part_f.iterator, Int32(r), Float32),
                                     load_peer(part_f.iterator + 1, Int32(r), Float32))
                if const_expr(FLAGS.HAS_SMOOTHING):
                    zsum = zsum + load_peer(part_f.iterator + 2, Int32(r), Float32)
                if const_expr(COMPUTE_STATS):
                    best, idx = merge_argmax(best, idx, load_peer(part_f.iterator + 3, Int32(r), Float32),
                                             load_peer(part_i.iterator, Int32(r), Int32))
            cute.arch.cluster_arrive_relaxed()    # done reading the peers' shared memory

        # 4. the row's results and gradient factors, as CEChunk
        loss, lse, lse_lo, g, h, p_t, total_w = chunk_row_factors(
            m, s, zsum, z_t, w_t, n_cols, is_valid, in_range, mWSum, mGradRow, mZGradRow, row, scalars, FLAGS,
            HAS_ZLOSS, TOKEN_SCALING)
        if tidx == 0 and rank == 0:
            store_row_results(mLoss, mLse, mLseLo, mPred, mTokenWeight, row, loss, lse, lse_lo, idx, is_valid, p_t,
                              COMPUTE_STATS, TOKEN_SCALING)
        a, b = grad_coefs(w_t, n_cols, scalars)
        t_col = Int32(-1)
        if in_range:
            t_col = safe
        for v in cutlass.range(tidx, n_mine, THREADS):
            grad_vector_from(sRow, v, gW, gRow, v0 + v, is_valid, t_col, a, lse, lse_lo, g, h, b, total_w, scalars,
                             VEC, FLAGS, HAS_ZLOSS)
        if const_expr(CLUSTER > 1):
            cute.arch.cluster_wait()              # no CTA leaves while a peer may still read its state
