"""The LM head's matmuls with fp32 logits from bf16 / fp16 operands, never an fp32 copy of the weight.

A product of two bf16 (or fp16) values is exact in fp32 (8 + 8 or 11 + 11 significand bits fit in
24), so fp32 logits ``h @ W.T`` summed in fp32 carry only fp32's rounding (about 2^-24 relative per
partial sum), where the stock composition (``F.linear`` in the operands' dtype) rounds every logit to
the operands' dtype at the end (2^-8 relative in bf16: 0.03 nats at a logit of 8). Two ways to form them:

- eager CUDA builds with an fp32-output GEMM of low-precision operands (``torch.mm(..., out_dtype=
  torch.float32)``; probed once per device type, ``loop._mm_out_dtype_ok``): the tensor cores read the
  bf16 operands and write fp32, no upcast copy at all (the same FLOPs as the bf16 GEMM).
- everywhere else (the CPU kernels have no such GEMM in torch 2.13: ``aten::mm.dtype`` has no CPU
  kernel; traced code): the weight is upcast ``weight_block_rows(H, n, V)`` rows at a time (about
  ``BLOCK_ELEMENTS`` = 2^22 elements, 16 MiB in fp32, up to twice that for chunks whose fp32 logits are
  larger), each block's fp32 GEMM written into its columns of the fp32 logits, so the extra memory is one
  block of at most 32 MiB, never V x H in fp32.

Cost on the CPU, measured on the 2-core CPU VM (AMD EPYC with AVX512-BF16, loaded: load average ~14;
one chunk of 64 / 144 rows x H = 576 against V = 49152, median of 5): the bf16 GEMM 89 / 168 ms; this
path with blocks of 7281 rows 796 / 1136 ms (1820-row blocks: 1560 / 5984 ms; 14563: 918 / 1152 ms);
an fp32 GEMM on a ready fp32 copy of the weight 427 / 700 ms. So on this CPU, whose bf16 GEMM is fast,
fp32 logits cost 5-9x the logits GEMM (the contract's default all the same: correctness first; the
``logits_dtype="input"`` opt-out is the fast path); 2^22-element blocks were the fastest of those; a
later one (issue 32, ``weight_block_rows``) found blocks as wide as the chunk's logits faster still. On a
GPU the fp32-output GEMM is the bf16 tensor-core GEMM with an fp32 epilogue: an estimated cost of the
fp32 chunk buffer's bandwidth only (twice the bytes of a bf16 chunk), no extra FLOPs.

On a CPU with bf16 units (AVX512-BF16 / AMX) each block's fp32 GEMM runs in oneDNN's bf16 math mode
(``core/bf16_products.py``: exact for these bf16 values, fp32 accumulation and result): measured on the
2-core CPU VM (Xeon with AMX, idle, 144 x 576 rows against V = 49152, mean of 5) 41 -> 22 ms per chunk,
the bf16 GEMM itself 13 ms; what remains is the upcast of the weight blocks.

The backward rounds the logits' gradient to the operands' dtype before its two GEMMs (as the stock
composition's bf16 backward, ``loop.backprop_chunk_``), so they stay the fast low-precision ones;
where torch's low-precision CPU GEMM is its scalar fallback (no oneDNN kernel for the dtype on that CPU:
``bf16_products.upcast_gemms``), the hidden gradient and ``logits="input"``'s logits are fp32 GEMMs of the
same values rounded once (``grad_hidden_fp32_``; 30x faster on an AVX2-only CPU).
"""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.bf16_products import exact_bf16_gemms

BLOCK_ELEMENTS = 1 << 22   # weight elements upcast at once (16 MiB in fp32), at least; the measurement above
MAX_BLOCK_FACTOR = 2       # ... and at most twice that, when the chunk's own fp32 logits are larger (below)


def weight_block_rows(hidden_size: int, n_rows: int = 0, vocab_size: int = 0) -> int:
    """Rows of the weight upcast at once: ``E / H``, at least 1, with ``E`` = ``BLOCK_ELEMENTS`` raised to
    the chunk's fp32 logits size ``n_rows * vocab_size`` and capped at ``MAX_BLOCK_FACTOR *
    BLOCK_ELEMENTS`` (32 MiB in fp32): a block no larger than the chunk buffer that the backward's
    weight-gradient step already upcasts (``loop.accumulate_``), fewer and wider GEMMs per chunk.
    Measured (issue 32, 2-core CPU VM, load 4.4-4.8, 144 x 576 rows against V = 49152, median of 5
    in one process): 7281-row blocks 287-299 ms, 12288-row blocks 235-245 ms, 16384: 276 ms."""
    elements = min(max(BLOCK_ELEMENTS, n_rows * vocab_size), MAX_BLOCK_FACTOR * BLOCK_ELEMENTS)
    return max(1, elements // max(hidden_size, 1))


def linear_fp32_(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
                 fused_gemm: bool) -> torch.Tensor:
    """``out = h @ weight.T (+ bias)`` in fp32 (``out``: ``(n, V)`` fp32, written in place and returned)
    from ``h`` ``(n, H)`` and ``weight`` ``(V, H)`` of one low-precision dtype. ``fused_gemm``: use the
    fp32-output GEMM (only where ``loop._mm_out_dtype_ok`` said the build has it); else the weight
    is upcast in blocks of ``weight_block_rows(H, n, V)`` rows (never V x H in fp32)."""
    if fused_gemm:
        torch.mm(h, weight.t(), out_dtype=torch.float32, out=out)
    else:
        h32 = h.float()   # n x H, the chunk's rows only
        step = weight_block_rows(weight.shape[1], h.shape[0], weight.shape[0])
        blocks = torch.empty((min(step, weight.shape[0]), weight.shape[1]), dtype=torch.float32,
                             device=weight.device)   # one block buffer for every block (no fresh pages each)
        with exact_bf16_gemms(h, weight):   # bf16 operands: the CPU's bf16 units, the same exact products
            for v in range(0, weight.shape[0], step):
                w32 = blocks[:min(step, weight.shape[0] - v)]
                w32.copy_(weight[v:v + step])
                torch.mm(h32, w32.t(), out=out[:, v:v + step])
    if bias is not None:
        out += bias.float()
    return out


def grad_hidden_fp32_(g32: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = g @ weight`` rounded once into ``out`` (``(n, H)``, the weight's dtype) from ``g32``
    (``(n, V)`` fp32 holding low-precision values) and ``weight`` ``(V, H)``: fp32 GEMMs over blocks of
    ``weight_block_rows(H)`` weight rows (a fixed split, whatever ``n``), summed in fp32. For CPUs whose
    low-precision GEMM is torch's scalar fallback (``bf16_products.upcast_gemms``)."""
    vocab, hidden = weight.shape
    step = weight_block_rows(hidden)
    acc = torch.zeros(g32.shape[0], hidden, dtype=torch.float32, device=g32.device)
    blocks = torch.empty((min(step, vocab), hidden), dtype=torch.float32, device=weight.device)
    for v in range(0, vocab, step):
        w32 = blocks[:min(step, vocab - v)]
        w32.copy_(weight[v:v + step])
        acc.addmm_(g32[:, v:v + step], w32)
    return out.copy_(acc)

