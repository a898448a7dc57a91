"""The per-element and per-row math of the distillation kernels, written once: on 1-D blocks of a row (the row
kernel) or 2-D tiles with per-row (rows, 1) columns (the tiled kernels); fp32 throughout."""
import triton
import triton.language as tl

from .common import softmax_shift, tanh_fp32

NEG_INF = tl.constexpr(float("-inf"))   # a jit global must be a constexpr


@triton.jit
def cap_logits(x, mask, cap, HAS_CAP: tl.constexpr):
    """fp32 ``c(x) = cap tanh(x / cap)`` (or ``x``), -inf where not ``mask`` (padded columns)."""
    if HAS_CAP:
        x = cap * tanh_fp32(x / cap)
    return tl.where(mask, x, NEG_INF)


@triton.jit
def capped_pair(xs, xt, mask, inv_t, s_cap, t_cap, HAS_S_CAP: tl.constexpr, HAS_T_CAP: tl.constexpr):
    """``(c, u, w)``: capped student logits, ``u = c / T``, the teacher's capped logits at T; -inf off ``mask``."""
    c = cap_logits(xs, mask, s_cap, HAS_S_CAP)
    w = cap_logits(xt, mask, t_cap, HAS_T_CAP) * inv_t
    return c, c * inv_t, w


@triton.jit
def row_targets(target_ptr, rows, in_rows, stride_target, ignore_index, BLOCK_N: tl.constexpr,
                HAS_TARGET: tl.constexpr):
    """``(target, live)`` of ``rows``: the int64 targets (-1 without HAS_TARGET) and which rows count."""
    if HAS_TARGET:
        target = tl.load(target_ptr + rows * stride_target, mask=in_rows, other=ignore_index).to(tl.int64)
        live = in_rows & (target != ignore_index)
    else:
        target = tl.zeros((BLOCK_N,), tl.int64) - 1
        live = in_rows
    return target, live


@triton.jit
def cap_slope(c, cap, HAS_CAP: tl.constexpr):
    """``dc/dz = 1 - (c / cap)^2`` written with ``c``, or 1.0."""
    slope = 1.0
    if HAS_CAP:
        r = c / cap
        slope = 1.0 - r * r
    return slope


@triton.jit
def safe_shift(m):
    """The online softmax's shift: the running max, or 0 while it is -inf (the sums stay 0, not NaN)."""
    return tl.where(m == NEG_INF, 0.0, m)


@triton.jit
def pair_rebase(acc, m_p, sh_p, m_q, sh_q, s_p):
    """``A = sum e^(p - m_p) ((p - m_p) - (q - m_q))`` re-based from the old maxes ``m_p``, ``m_q`` to the
    new shifts ``sh_p``, ``sh_q``: ``e^(dp) (A + (dp - dq) S_p)``, 0 while nothing was seen of p
    (``m_p = -inf``: A = S_p = 0)."""
    dp = tl.where(m_p == NEG_INF, 0.0, m_p - sh_p)
    dq = m_q - sh_q   # -inf if no q was finite yet: every earlier term of A was already +inf
    return tl.where(m_p == NEG_INF, 0.0, tl.exp(dp) * (acc + (dp - dq) * s_p))


@triton.jit
def pair_terms(e_p, p, sh_p, q, sh_q):
    """``e^(p - sh_p) ((p - sh_p) - (q - sh_q))`` per element, 0 where ``p = -inf`` (0 log 0)."""
    return tl.where(p == NEG_INF, 0.0, e_p * ((p - sh_p) - (q - sh_q)))


@triton.jit
def finish_lse(m, s, live):
    """``m + log s`` on live rows, 0 elsewhere (nothing scanned: m = -inf, s = 0)."""
    return tl.where(live, safe_shift(m) + tl.log(tl.where(live, s, 1.0)), 0.0)


@triton.jit
def finish_pair(acc, s_p, s_q, live):
    """``A / S_p - log S_p + log S_q`` (the one-pass KL of MODE 0 / 1), 0 on rows not ``live``."""
    sp = tl.where(live, s_p, 1.0)
    sq = tl.where(live, s_q, 1.0)
    return tl.where(live, (acc / sp - tl.log(sp)) + tl.log(sq), 0.0)


@triton.jit
def log_mix(ls, lt, log_beta, log_1mb):
    """``log(beta t + (1 - beta) s)`` from ``log s``, ``log t`` (a two-term log-sum-exp)."""
    a = lt + log_beta
    b = ls + log_1mb
    hi = tl.maximum(a, b)
    lo = tl.minimum(a, b)
    return tl.where(hi == NEG_INF, NEG_INF, hi + tl.log(1.0 + tl.exp(lo - hi)))


@triton.jit
def jsd_terms(u, w, lse_u, lse_w, log_beta, log_1mb):
    """Per element ``(t (log t - log m), s (log s - log m))``, each 0 where its probability's logit is
    -inf, and ``log s - log m`` (for the gradient)."""
    ls = u - lse_u
    lt = w - lse_w
    lm = log_mix(ls, lt, log_beta, log_1mb)
    kl_t = tl.where(lt == NEG_INF, 0.0, tl.exp(lt) * (lt - lm))
    d_s = tl.where(ls == NEG_INF, 0.0, ls - lm)
    kl_s = tl.exp(ls) * d_s
    return kl_t, kl_s, d_s


@triton.jit
def jsd_init(beta, BLOCK_N: tl.constexpr):
    """``(log beta, log(1 - beta), kl_t, kl_s)`` before the MODE 2 second pass, the sums (BLOCK_N,) zeros."""
    zero = tl.zeros((BLOCK_N,), tl.float32)
    return tl.log(beta), tl.log(1.0 - beta), zero, zero


@triton.jit
def jsd_update(kl_t, kl_s, u, w, lse_u, lse_w, log_beta, log_1mb):
    """The MODE 2 second pass's ``(kl_t, kl_s)`` plus one block's ``KL(t || m)`` and ``KL(s || m)``."""
    term_t, term_s, _d = jsd_terms(u, w, lse_u[:, None], lse_w[:, None], log_beta, log_1mb)
    return kl_t + tl.sum(term_t, axis=1), kl_s + tl.sum(term_s, axis=1)


@triton.jit
def jsd_finish(kl_t, kl_s, beta, live):
    """``(divergence, rowsum)`` per row after the second pass: ``beta KL(t || m) + (1 - beta) KL(s || m)`` and
    ``(1 - beta) KL(s || m)``, 0 on rows not ``live``."""
    rowsum = (1.0 - beta) * kl_s
    return tl.where(live, beta * kl_t + rowsum, 0.0), tl.where(live, rowsum, 0.0)


@triton.jit
def dlogits(c, u, w, is_target, lse_u, lse_w, lse_c, rowsum, beta, inv_t, hard_w, s_cap,
            MODE: tl.constexpr, HAS_HARD: tl.constexpr, HARD_OWN_LSE: tl.constexpr, HAS_S_CAP: tl.constexpr):
    """fp32 ``dL/dz_s`` of a block (before the grad_factor); ``rowsum``: MODE 1 KL(s || t), MODE 2
    (1 - beta) KL(s || m)."""
    ls = u - lse_u
    s = tl.exp(ls)
    if MODE == 0:
        du = s - tl.exp(w - lse_w)
    elif MODE == 1:
        du = tl.where(ls == NEG_INF, 0.0, s * (((ls - (w - lse_w))) - rowsum))
    else:
        lt = w - lse_w
        log_beta = tl.log(beta)
        log_1mb = tl.log(1.0 - beta)
        lm = log_mix(ls, lt, log_beta, log_1mb)
        du = tl.where(ls == NEG_INF, 0.0, s * ((1.0 - beta) * (ls - lm) - rowsum))
    dz = du * inv_t
    if HAS_HARD:
        if HARD_OWN_LSE:
            p = tl.exp(c - lse_c)
        else:
            p = s
        dz += hard_w * (p - tl.where(is_target, 1.0, 0.0))
    return dz * cap_slope(c, s_cap, HAS_S_CAP)


@triton.jit
def stats_init(BLOCK_N: tl.constexpr):
    """``stats_update``'s running statistics before the first column: (-inf, 0, -inf, 0, 0, -inf, 0, 0)."""
    neg = tl.full((BLOCK_N,), NEG_INF, tl.float32)
    zero = tl.zeros((BLOCK_N,), tl.float32)
    return neg, zero, neg, zero, zero, neg, zero, zero


@triton.jit
def stats_update(u, w, c, is_target, m_u, s_u, m_w, s_w, acc, m_c, s_c, c_t,
                 MODE: tl.constexpr, HAS_HARD: tl.constexpr, HARD_OWN_LSE: tl.constexpr):
    """One tile into the running per-row statistics: the online softmaxes of ``u`` and ``w``, the MODE 0 / 1
    divergence sum ``acc``, the target's ``c`` and (HARD_OWN_LSE) the online softmax of ``c``."""
    m_u_new, sh_u = softmax_shift(m_u, u, 1)
    m_w_new, sh_w = softmax_shift(m_w, w, 1)
    e_u = tl.exp(u - sh_u[:, None])
    e_w = tl.exp(w - sh_w[:, None])
    if MODE == 0:
        acc = pair_rebase(acc, m_w, sh_w, m_u, sh_u, s_w) + tl.sum(
            pair_terms(e_w, w, sh_w[:, None], u, sh_u[:, None]), axis=1)
    elif MODE == 1:
        acc = pair_rebase(acc, m_u, sh_u, m_w, sh_w, s_u) + tl.sum(
            pair_terms(e_u, u, sh_u[:, None], w, sh_w[:, None]), axis=1)
    s_u = s_u * tl.exp(m_u - sh_u) + tl.sum(e_u, axis=1)
    s_w = s_w * tl.exp(m_w - sh_w) + tl.sum(e_w, axis=1)
    if HAS_HARD:
        c_t += tl.sum(tl.where(is_target, c, 0.0), axis=1)
        if HARD_OWN_LSE:
            m_c_new, sh_c = softmax_shift(m_c, c, 1)
            s_c = s_c * tl.exp(m_c - sh_c) + tl.sum(tl.exp(c - sh_c[:, None]), axis=1)
            m_c = m_c_new
    return m_u_new, s_u, m_w_new, s_w, acc, m_c, s_c, c_t


@triton.jit
def row_results(m_u, s_u, m_w, s_w, acc, m_c, s_c, c_t, live, hard_w,
                MODE: tl.constexpr, HAS_HARD: tl.constexpr, HARD_OWN_LSE: tl.constexpr):
    """``(loss, lse_u, lse_w, lse_c, rowsum)`` per row after the first pass; in MODE 2 ``loss`` holds only the
    hard-label term (the second pass adds the rest)."""
    lse_u = finish_lse(m_u, s_u, live)
    lse_w = finish_lse(m_w, s_w, live)
    lse_c = lse_u
    loss = tl.zeros_like(lse_u)
    rowsum = tl.zeros_like(lse_u)
    if MODE == 0:
        rowsum = finish_pair(acc, s_w, s_u, live)
    elif MODE == 1:
        rowsum = finish_pair(acc, s_u, s_w, live)
    if MODE != 2:
        loss = rowsum
    if HAS_HARD:
        if HARD_OWN_LSE:
            lse_c = finish_lse(m_c, s_c, live)
        loss += tl.where(live, hard_w * (lse_c - c_t), 0.0)
    return loss, lse_u, lse_w, lse_c, rowsum
