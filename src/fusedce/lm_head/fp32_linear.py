"""The LM head's matmuls with fp32 logits from bf16 / fp16 operands, never an fp32 copy of the weight.

A product of two bf16 (or fp16) values is exact in fp32 (8 + 8 or 11 + 11 significand bits fit in
24), so fp32 logits ``h @ W.T`` summed in fp32 carry only fp32's rounding (about 2^-24 relative per
partial sum), where the stock composition (``F.linear`` in the operands' dtype) rounds every logit to
the operands' dtype at the end (2^-8 relative in bf16: 0.03 nats at a logit of 8). Two ways to form them:

- eager CUDA builds with an fp32-output GEMM of low-precision operands (``torch.mm(..., out_dtype=
  torch.float32)``; probed once per device type, ``chunked._mm_out_dtype_ok``): the tensor cores read the
  bf16 operands and write fp32, no upcast copy at all (the same FLOPs as the bf16 GEMM).
- everywhere else (the CPU kernels have no such GEMM in torch 2.13; traced code): the weight is upcast
  ``weight_block_rows(H)`` rows at a time (about ``BLOCK_ELEMENTS`` = 2^22 elements, 16 MiB in fp32),
  each block's fp32 GEMM written into its columns of the fp32 logits. Measured on the 2-core CPU VM
  (loaded; one 144 x 576 chunk against V = 49152): the bf16 GEMM 1494 ms, this path with blocks of
  1024 / 4096 / 8192 rows 1194 / 779 / 639 ms: on this CPU fp32 is faster than bf16 (its bf16 GEMM is
  not vectorized as well), so fp32 logits cost nothing there; the block holds the extra memory to 16 MiB.

The backward's ``grad_hidden = g @ W`` with an fp32 ``g``: the same blocks on CPU (fp32 sums, then one
rounding to hidden's dtype); on CUDA ``g`` is rounded to the weight's dtype first (a chunk-sized copy)
and the tensor-core GEMM runs on it, as the stock composition's bf16 backward does.
"""
from __future__ import annotations

from typing import Optional

import torch

BLOCK_ELEMENTS = 1 << 22   # weight elements upcast at once (16 MiB in fp32); the measurement above


def weight_block_rows(hidden_size: int) -> int:
    """Rows of the weight upcast at once: ``BLOCK_ELEMENTS / H``, at least 1."""
    return max(1, BLOCK_ELEMENTS // max(hidden_size, 1))


def linear_fp32_(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
                 fused_gemm: bool) -> torch.Tensor:
    """``out = h @ weight.T (+ bias)`` in fp32 (``out``: ``(n, V)`` fp32, written in place and returned)
    from ``h`` ``(n, H)`` and ``weight`` ``(V, H)`` of one low-precision dtype. ``fused_gemm``: use the
    fp32-output GEMM (only where ``chunked._mm_out_dtype_ok`` said the build has it); else the weight
    is upcast in blocks of ``weight_block_rows(H)`` rows (never V x H in fp32)."""
    if fused_gemm:
        torch.mm(h, weight.t(), out_dtype=torch.float32, out=out)
    else:
        h32 = h.float()   # n x H, the chunk's rows only
        step = weight_block_rows(weight.shape[1])
        for v in range(0, weight.shape[0], step):
            torch.mm(h32, weight[v:v + step].float().t(), out=out[:, v:v + step])
    if bias is not None:
        out += bias.float()
    return out


def grad_hidden_(g: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, fused_gemm: bool) -> None:
    """``out = g @ weight`` for an fp32 ``g`` ``(n, V)`` and a low-precision ``weight`` ``(V, H)``;
    ``out`` ``(n, H)`` in hidden's dtype (written in place). ``fused_gemm`` (CUDA): ``g`` rounded to the
    weight's dtype, then its GEMM (stock's precision); else fp32 sums over blocks of the upcast weight,
    rounded once into ``out``."""
    if fused_gemm:
        torch.mm(g.to(weight.dtype), weight, out=out)
        return
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    step = weight_block_rows(weight.shape[1])
    for v in range(0, weight.shape[0], step):
        acc.addmm_(g[:, v:v + step], weight[v:v + step].float())
    out.copy_(acc)
