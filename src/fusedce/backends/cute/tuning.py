"""Launch configuration of the CuTe kernels, and the rule that keeps ``backend="auto"`` off them.

Configuration (reasoned, not measured: no GPU has run these kernels yet):
- ``THREADS = 256`` per CTA for the row-streaming kernels (forward, fused chunk): 8 warps, each thread
  one 128-bit vector per step, 4 KiB of bf16 logits per CTA step; with ~8 CTAs per SM resident (29-62
  registers, 160 bytes of shared memory each in the static report) that keeps enough loads in flight
  at BT >= a few thousand rows.
- backward: 256 threads x 2 vectors per CTA (``BACKWARD_UNROLL``), i.e. 4096 bf16 logits per CTA, the
  Triton backward's block, so a 2-D grid fills the GPU even for few rows.
- vector width: 16 bytes (8 bf16 / fp16, 4 fp32) when V, the row strides and the base pointers allow
  it, else the largest power of two that does (1 for odd V): ``launch.vec_for``.

``backend="auto"`` never picks ``"cute"``: ``AUTO_PICKS_CUTE`` stays False until the GPU parity tests
(``tests/test_cute_gpu.py``, run by ``benchmarks/gpu_check.sh``) have passed on a GPU and the timing
shows it ahead of Triton; record the machine, date and result below when that happens.

Evidence so far: compiled for sm_90a and sm_100a with nvidia-cutlass-dsl 4.8.1 on a CPU-only machine
(0 spills in every variant, ``fusedce inspect --cute``); numerics NOT verified on a GPU.
"""
from __future__ import annotations

THREADS = 256
BACKWARD_UNROLL = 2

AUTO_PICKS_CUTE = False          # flip only with the GPU evidence above
VERIFIED_ON_GPU = None           # e.g. "H200, 2026-01-01, benchmarks/gpu_check.sh: parity ok"
