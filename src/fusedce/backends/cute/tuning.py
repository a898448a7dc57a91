"""Launch configuration of the CuTe kernels, and the rule that keeps ``backend="auto"`` off them.

Configuration (reasoned, not measured: no GPU has run these kernels yet):
- ``THREADS = 256`` per CTA for the row-streaming kernels (forward, fused chunk): 8 warps, each thread
  one 128-bit vector per step, 4 KiB of bf16 logits per CTA step; with 3-8 CTAs per SM resident
  (25-66 registers, so 3 CTAs per SM by registers for the 65-66-register variants; 1 KiB of static
  shared memory each in the static report) that keeps enough loads in flight at BT >= a few thousand rows.
- backward: 256 threads x 2 vectors per CTA (``BACKWARD_UNROLL``), i.e. 4096 bf16 logits per CTA, the
  Triton backward's block, so a 2-D grid fills the GPU even for few rows.
- vector width: 16 bytes (8 bf16 / fp16, 4 fp32) when V, the row strides and the base pointers allow
  it, else the largest power of two that does (1 for odd V): ``launch.vec_for``.
- the fused chunk (``linear_cross_entropy``): the on-chip kernel (``kernels/ce_chunk_onchip.py``, the
  row read from HBM exactly once) whenever ``onchip_cluster`` gives a cluster size, else the two-read
  ``kernels/ce_chunk.py`` (its second read of a row hoped to hit L2). Rule: full-width vectors, and the
  row split over the fewest CTAs (1, 2, 4, 8: a thread-block cluster beyond 1; 8 is the portable
  cluster size of sm_90 / sm_100) whose slices hold at most ``ONCHIP_SLICE_BYTES`` = 96 KiB, so that
  two CTAs fit on an SM (227 KiB of shared memory per block on H100 / H200 / B200) and one loads while
  the other computes. Hence V <= 8 * 96 KiB / s: 393216 bf16 / fp16 classes, 196608 fp32; e.g.
  Llama-3's 128256 bf16 (250.5 KiB) runs on clusters of 4 (62.6 KiB each), 32000 bf16 on one CTA.
  ``FUSEDCE_CUTE_ONCHIP=0`` forces the two-read kernel (for A/B timing on a GPU).

Registers and spills (``fusedce inspect --cute --every-variant``, nvidia-cutlass-dsl 4.8.1, sm_90a and
sm_100a, compiled on a CPU-only machine): 0 spill bytes and 0 local memory in every variant of both
archs (134 per arch: 114 row-streaming + 20 on-chip); 25-66 registers. Before (the first version) 8
of the 114 variants spilled 8-68 bytes at 46-48 registers: ptxas expands an IEEE ``/``
(``div.rn.f32``) into a subroutine call whose calling convention saved registers to local memory,
and the target's terms were held live across the row stream. Fixed by ``row_math.div_full``
(``div.full.f32``, Triton's ``/``) and by forming the target terms after the stream;
``tests/cute/test_cute_compile.py`` fails on any spill.

``backend="auto"`` never picks ``"cute"``: ``AUTO_PICKS_CUTE`` stays False until the GPU parity tests
(``tests/cute/test_cute_gpu.py``, run by ``benchmarks/gpu_check.sh``) have passed on a GPU and the timing
shows it ahead of Triton; record the machine, date and result below when that happens.

Evidence so far: compiled for sm_90a and sm_100a with nvidia-cutlass-dsl 4.8.1 on a CPU-only machine;
numerics NOT verified on a GPU (neither kernel; the on-chip kernel's cluster path neither).
"""
from __future__ import annotations

import os
from typing import Optional

THREADS = 256
BACKWARD_UNROLL = 2
ONCHIP_SLICE_BYTES = 96 * 1024
ONCHIP_CLUSTERS = (1, 2, 4, 8)

AUTO_PICKS_CUTE = False          # flip only with the GPU evidence above
VERIFIED_ON_GPU = None           # e.g. "H200, 2026-01-01, benchmarks/gpu_check.sh: parity ok"


def onchip_cluster(n_cols: int, itemsize: int, full_width: bool) -> Optional[int]:
    """CTAs per row for the on-chip chunk kernel (the rule above), or None: use ``ce_chunk``."""
    if not full_width or n_cols == 0 or os.environ.get("FUSEDCE_CUTE_ONCHIP", "1") == "0":
        return None
    row_bytes = n_cols * itemsize
    return next((c for c in ONCHIP_CLUSTERS if -(-row_bytes // c) <= ONCHIP_SLICE_BYTES), None)
