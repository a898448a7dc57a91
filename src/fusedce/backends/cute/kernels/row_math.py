"""The per-row cross-entropy math of the CuTe DSL kernels, written once (``@cute.jit`` helpers)."""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .row_reduce import NEG_INF, block_merge, safe_shift


@dsl_user_op
def div_full(a, b, *, loc=None, ip=None) -> Float32:
    """``a / b`` as PTX ``div.full.f32`` (max 2 ulp, as Triton's ``/``): ``div.rn``'s subroutine call spilled."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
                                   "div.full.f32 $0, $1, $2;", "=f,f,f", has_side_effects=False,
                                   is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cute.jit
def tanh_fp32(y: Float32) -> Float32:
    """``tanh(y)`` in fp32, the Triton kernels' two-branch form (``common.tanh_fp32``)."""
    a = cute.math.absf(y)
    u = y * y
    p = Float32(-0.003164674388244748)
    p = p * u + Float32(0.018629277125000954)
    p = p * u - Float32(0.05317629873752594)
    p = p * u + Float32(0.13324938714504242)
    p = p * u - Float32(0.33333030343055725)
    small = y + y * u * p
    big = Float32(1.0) - div_full(Float32(2.0), cute.math.exp(Float32(2.0) * a) + Float32(1.0))
    if y < Float32(0.0):
        big = -big
    out = big
    if a < Float32(0.55):
        out = small
    return out


@cute.jit
def transform(x: Float32, scalars, FLAGS: cutlass.Constexpr):
    """``z`` of one fp32 logit: ``softcap * tanh(x * (logit_scale / softcap))`` or ``logit_scale * x``."""
    z = x * scalars.logit_scale
    if const_expr(FLAGS.HAS_SOFTCAP):
        z = scalars.softcap * tanh_fp32(x * div_full(scalars.logit_scale, scalars.softcap))
    return z


@cute.jit
def slope(z: Float32, scalars, FLAGS: cutlass.Constexpr):
    """``dz/dx`` written with ``z``: ``logit_scale * (1 - (z / softcap)^2)`` or ``logit_scale``."""
    out = scalars.logit_scale
    if const_expr(FLAGS.HAS_SOFTCAP):
        r = div_full(z, scalars.softcap)
        out = scalars.logit_scale * (Float32(1.0) - r * r)
    return out


@cute.jit
def two_sum(a: Float32, b: Float32):
    """``(s, e)``: ``s = fl(a + b)``, ``s + e = a + b`` exactly (Knuth's TwoSum; no multiply, no FMA)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


@cute.jit
def update_vector(m: Float32, s: Float32, zsum: Float32, best: Float32, idx: Int32, xv: cute.TensorSSA,
                  wv, col0: Int32, scalars, VEC: cutlass.Constexpr[int], FLAGS: cutlass.Constexpr,
                  COMPUTE_STATS: cutlass.Constexpr[bool]):
    """Fold one vector of ``VEC`` fp32 logits into a thread's row state (one rescale per vector)."""
    vmax = Float32(NEG_INF)
    for j in cutlass.range_constexpr(VEC):
        z = transform(xv[j], scalars, FLAGS)
        vmax = cute.arch.fmax(vmax, z)
    m_new = cute.arch.fmax(m, vmax)
    shift = safe_shift(m_new)
    acc = Float32(0.0)
    for j in cutlass.range_constexpr(VEC):
        z = transform(xv[j], scalars, FLAGS)
        acc = acc + cute.math.exp(z - shift)
        if const_expr(FLAGS.HAS_SMOOTHING):
            if const_expr(FLAGS.HAS_WEIGHT):
                zsum = zsum + wv[j] * z
            else:
                zsum = zsum + z
        if const_expr(COMPUTE_STATS):
            if xv[j] > best:     # columns arrive in increasing order per thread: '>' keeps the lowest
                best = xv[j]
                idx = col0 + j
    s = s * cute.math.exp(m - shift) + acc
    return m_new, s, zsum, best, idx


@cute.jit
def row_stats(gRow: cute.Tensor, gW, n_live: Int32, tidx: Int32, scalars, sbuf_f: cute.Tensor,
              sbuf_i: cute.Tensor, THREADS: cutlass.Constexpr[int], VEC: cutlass.Constexpr[int],
              FLAGS: cutlass.Constexpr, COMPUTE_STATS: cutlass.Constexpr[bool]):
    """The CTA's ``(m, s, zsum, best, best_idx)`` over a row's first ``n_live`` logits, read once."""
    return slice_stats(gRow, 0, gW, n_live // VEC, tidx, scalars, sbuf_f, sbuf_i, THREADS, VEC, FLAGS,
                       COMPUTE_STATS)


@cute.jit
def target_row_stats(gRow: cute.Tensor, gW, mTarget: cute.Tensor, row, n_cols: Int32, tidx: Int32, scalars,
                     THREADS: cutlass.Constexpr[int], VEC: cutlass.Constexpr[int], FLAGS: cutlass.Constexpr,
                     COMPUTE_STATS: cutlass.Constexpr[bool]):
    """The row-streaming kernels' first pass over row ``row``: its target, whether it is kept, and ``row_stats``."""
    smem = cutlass.utils.SmemAllocator()
    sbuf_f = smem.allocate_tensor(Float32, cute.make_layout((4, THREADS // 32)), byte_alignment=16)
    sbuf_i = smem.allocate_tensor(Int32, cute.make_layout(THREADS // 32), byte_alignment=16)
    target = Int64(mTarget[row])
    is_valid = target != scalars.ignore_index
    n_live = Int32(0)
    if is_valid:
        n_live = n_cols
    m, s, zsum, best, idx = row_stats(gRow, gW, n_live, tidx, scalars, sbuf_f, sbuf_i, THREADS, VEC, FLAGS,
                                      COMPUTE_STATS)
    return target, is_valid, m, s, zsum, best, idx


@cute.jit
def slice_stats(sX: cute.Tensor, v0, gW, n_vec: Int32, tidx: Int32, scalars, sbuf_f: cute.Tensor,
                sbuf_i: cute.Tensor, THREADS: cutlass.Constexpr[int], VEC: cutlass.Constexpr[int],
                FLAGS: cutlass.Constexpr, COMPUTE_STATS: cutlass.Constexpr[bool]):
    """``row_stats`` of ``n_vec`` vectors of ``sX`` (a whole row, or a shared-memory slice starting at vector
    ``v0``); every thread gets the CTA's state."""
    m, s, zsum = Float32(NEG_INF), Float32(0.0), Float32(0.0)
    best, idx = Float32(NEG_INF), Int32(0)
    frag = cute.make_rmem_tensor((VEC,), sX.element_type)
    wfrag = cute.make_rmem_tensor((VEC,), Float32)
    for v in cutlass.range(tidx, n_vec, THREADS):
        cute.autovec_copy(cute.local_tile(sX, (VEC,), (v,)), frag)
        wv = None
        if const_expr(FLAGS.HAS_WEIGHT and FLAGS.HAS_SMOOTHING):
            cute.autovec_copy(cute.local_tile(gW, (VEC,), (v0 + v,)), wfrag)
            wv = wfrag.load()
        m, s, zsum, best, idx = update_vector(m, s, zsum, best, idx, frag.load().to(Float32), wv, (v0 + v) * VEC,
                                              scalars, VEC, FLAGS, COMPUTE_STATS)
    return block_merge(m, s, zsum, best, idx, sbuf_f, sbuf_i, THREADS // 32, FLAGS, COMPUTE_STATS)


@cute.jit
def row_loss(m: Float32, s: Float32, zsum: Float32, z_t: Float32, w_t: Float32, total_w: Float32,
             n_cols: Int32, is_valid, in_range, scalars, FLAGS: cutlass.Constexpr):
    """``(loss, lse, lse_lo)`` of a row from its merged state: 0 on ignored rows, NaN loss on an out-of-range target."""
    m_ok, s_ok = Float32(0.0), Float32(1.0)
    if is_valid:
        m_ok, s_ok = m, s
    lse, lse_lo = two_sum(m_ok, cute.math.log(s_ok))
    loss = (Float32(1.0) - scalars.label_smoothing) * w_t * ((lse - z_t) + lse_lo)
    if const_expr(FLAGS.HAS_SMOOTHING):
        loss = loss + div_full(scalars.label_smoothing, Float32(n_cols)) * ((total_w * lse - zsum) + total_w * lse_lo)
    if not in_range:
        loss = Float32(math.nan)
    if not is_valid:
        loss = Float32(0.0)
    return loss, lse, lse_lo


@cute.jit
def grad_coefs(w_t: Float32, n_cols: Int32, scalars):
    """``(a, b)`` of the gradient pass: ``a = (1 - eps) w_t`` (the target term), ``b = eps / V``."""
    a = (Float32(1.0) - scalars.label_smoothing) * w_t
    b = div_full(scalars.label_smoothing, Float32(n_cols))
    return a, b


@cute.jit
def grad_value(x: Float32, col: Int32, target: Int32, w_c: Float32, a: Float32, lse: Float32,
               lse_lo: Float32, g: Float32, h: Float32, b: Float32, total_w: Float32, scalars,
               FLAGS: cutlass.Constexpr, HAS_GRAD_LSE: cutlass.Constexpr[bool]) -> Float32:
    """fp32 ``dL/dx`` of one logit; the target column is formed as ``p - 1`` before scaling (exact 0s)."""
    z = transform(x, scalars, FLAGS)
    p = cute.math.exp((z - lse) - lse_lo)
    pm = p
    if col == target:
        pm = p - Float32(1.0)
    dz = (g * a) * pm
    if const_expr(FLAGS.HAS_SMOOTHING):
        dz = g * (a * pm + b * (total_w * p - w_c))
    if const_expr(HAS_GRAD_LSE):
        dz = dz + h * p
    return dz * slope(z, scalars, FLAGS)


@cute.jit
def grad_vector(gX: cute.Tensor, gW, gG: cute.Tensor, v: Int32, is_valid, target: Int32, a: Float32,
                lse: Float32, lse_lo: Float32, g: Float32, h: Float32, b: Float32, total_w: Float32, scalars,
                VEC: cutlass.Constexpr[int], FLAGS: cutlass.Constexpr, HAS_GRAD_LSE: cutlass.Constexpr[bool]):
    """Read vector ``v`` of a row, write its gradient (zeros on ignored rows) into ``gG``'s vector ``v`` (may alias)."""
    grad_vector_from(gX, v, gW, gG, v, is_valid, target, a, lse, lse_lo, g, h, b, total_w, scalars, VEC, FLAGS,
                     HAS_GRAD_LSE)


@cute.jit
def grad_vector_from(sX: cute.Tensor, vx: Int32, gW, gG: cute.Tensor, v: Int32, is_valid, target: Int32,
                     a: Float32, lse: Float32, lse_lo: Float32, g: Float32, h: Float32, b: Float32,
                     total_w: Float32, scalars, VEC: cutlass.Constexpr[int], FLAGS: cutlass.Constexpr,
                     HAS_GRAD_LSE: cutlass.Constexpr[bool]):
    """``grad_vector`` with the logits from vector ``vx`` of ``sX``, written to vector ``v`` of ``gG``."""
    out = cute.make_rmem_tensor((VEC,), Float32)
    out.fill(0.0)
    if is_valid:
        frag = cute.make_rmem_tensor((VEC,), sX.element_type)
        cute.autovec_copy(cute.local_tile(sX, (VEC,), (vx,)), frag)
        xv = frag.load().to(Float32)
        wfrag = cute.make_rmem_tensor((VEC,), Float32)
        wfrag.fill(1.0)
        if const_expr(FLAGS.HAS_WEIGHT and FLAGS.HAS_SMOOTHING):
            cute.autovec_copy(cute.local_tile(gW, (VEC,), (v,)), wfrag)
        for j in cutlass.range_constexpr(VEC):
            out[j] = grad_value(xv[j], v * VEC + j, target, wfrag[j], a, lse, lse_lo, g, h, b, total_w, scalars,
                                FLAGS, HAS_GRAD_LSE)
    res = cute.make_rmem_tensor((VEC,), gG.element_type)
    res.store(out.load().to(gG.element_type))     # round to nearest even, as the GPU's cvt.rn does
    cute.autovec_copy(res, cute.local_tile(gG, (VEC,), (v,)))
