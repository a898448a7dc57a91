"""The power-of-two headroom of gradients made in the forward (fp16 loss scaling), shared by the linear
families."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.options import LossOptions
from fusedce.core.reduction import MeanScales

# Headroom of the forward-made gradients. The chunk kernels round dL/dlogits to hidden's dtype in the
# forward, before the upstream gradient g exists; with fp16 and loss scaling (g = S = 2^16) a dlogit
# (p_c - y_c) / D below fp16's smallest subnormal (2^-24) would be 0 before S arrives: the underflow
# loss scaling exists to prevent. So the forward forms P dL/dlogits, with (K = HEADROOM_EXP)
#     m = |logit_scale| max(max_c |w_c| / D, 1 / N),   m = f 2^e (frexp, f in [0.5, 1)),   P = 2^(K - e),
# i.e. P m in [2^(K-1), 2^K): dlogits of about 2^K |p_c - y_c| whatever D, the class weights and
# logit_scale; grad_hidden is rounded to its dtype at that scale, grad_weight / grad_bias accumulate at
# it, and the backward multiplies them by g / P in fp32. P is a power of two, so for a power-of-two g
# (a GradScaler's) that is exact: each result is rounded once, as stock's is, but from dlogits at a
# scale where fp16 keeps |p_c - y_c| down to ~2^-(24+K) (normal down to ~2^-(14+K)), not 2^-24 D / S. Overflow would need a per-logit |dL/dz| beyond ~2^(16-K) = 64 times (p - y)'s bound 1,
# or |grad_hidden| at unit scale (<= 2 max |W|) beyond 2^(16-K). bf16 / fp32: P changes no bit.
HEADROOM_EXP = 10


def headroom(scales: MeanScales, w: Optional[torch.Tensor], opts: LossOptions,
             token_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``P`` above: a 0-dim fp32 power of two on the scales' device (no host sync). ``w``: (V,) fp32
    class weights or None; ``token_weights``: (n,) fp32 per-row loss weights or None, whose largest
    finite magnitude multiplies ``m`` like the class weights' (a NaN / inf weight, not caught where the
    host check is skipped, reaches only its own row's gradients and the sums over rows, as in stock)."""
    ce = scales.ce.abs() if w is None else scales.ce.abs() * w.abs().amax()
    m = torch.maximum(ce, scales.z.abs()) * abs(opts.logit_scale)
    if token_weights is not None and token_weights.numel() > 0:
        m = m * torch.where(torch.isfinite(token_weights), token_weights.abs(), 0.0).amax()
    _, e = torch.frexp(m)   # m = 0 gives e = 0: P = 2^K, harmless (every gradient is 0)
    return torch.ldexp(torch.ones_like(m), HEADROOM_EXP - e).to(m.dtype)


def scaled_(t: Optional[torch.Tensor], g: torch.Tensor) -> Optional[torch.Tensor]:
    """``t * g`` (``g`` a 0-dim fp32 device tensor), the product formed in fp32 and rounded once to
    ``t``'s dtype. fp32 / fp64 ``t`` is scaled in place (no second V x H buffer); a bf16 / fp16 ``t``
    goes through one fp32 copy, since ``t.mul_(g)`` on CUDA first rounds ``g`` itself to ``t``'s dtype
    (a 0-dim device tensor is an operand, not a scalar): ``g / P`` = 2^-34 would be 0 in fp16."""
    if t is None:
        return None
    if t.dtype in (torch.float32, torch.float64):
        return t.mul_(g)
    return t.float().mul_(g).to(t.dtype)
