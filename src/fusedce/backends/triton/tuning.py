"""Launch configurations of the Triton cross-entropy kernels (one function per kernel).

No GPU was available when these were chosen, so they come from reasoning, not measurement (to be
re-tuned with ``benchmarks/gpu_check.sh`` on a lent H100/H200):
- forward: one program per row streams the row in blocks of up to 4096 logits with 8 warps, i.e. 16
  values per thread per iteration: two 128-bit loads in bf16, enough in flight to saturate HBM with
  BT >= a few thousand rows; smaller vocabularies use one block of next_pow2(V).
- backward: 2-D grid, 4096-wide blocks (same vector width), so even a few rows fill the GPU.
- registers: ``maxnreg = 128`` for every launch. Without a cap, ptxas (Triton 3.9, sm_90 and sm_100)
  aims at 3 CTAs of 256 threads per SM for some flag combinations (softcap + stats + class weights, the
  fused chunk with z-loss and token scaling), takes 80 registers and spills 4-40 bytes; with the cap it
  allocates 87-111 and spills nothing in any of the 1536 configurations ``fusedce inspect
  --every-variant`` compiles (2 CTAs, 16 warps per SM). Static evidence only: re-measure on a GPU.
Under the interpreter (CPU tests) larger blocks only mean fewer Python-level iterations.
"""
from __future__ import annotations

import triton

MAX_BLOCK_V = 4096


MAX_REGISTERS = 128


def forward_config(n_cols: int) -> dict:
    block = min(MAX_BLOCK_V, triton.next_power_of_2(max(n_cols, 16)))
    return {"BLOCK_V": block, "num_warps": 8 if block >= 2048 else 4, "maxnreg": MAX_REGISTERS}


def backward_config(n_cols: int) -> dict:
    block = min(MAX_BLOCK_V, triton.next_power_of_2(max(n_cols, 16)))
    return {"BLOCK_V": block, "num_warps": 8 if block >= 2048 else 4, "maxnreg": MAX_REGISTERS}
