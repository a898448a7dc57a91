"""fp32 GEMMs whose operands hold bf16 values, on the CPU's bf16 units: ``exact_bf16_gemms()``.

The LM head forms fp32 logits (and fp32 weight-gradient sums) from bf16 operands by upcasting them
(``lm_head/fp32_linear.py``, ``lm_head/chunked.accumulate_``): torch 2.13's CPU kernels have no
fp32-output GEMM of bf16 operands (``aten::mm.dtype`` is CUDA-only). An fp32 GEMM then runs on the fp32
units although every operand is a bf16 value. oneDNN's bf16 math mode (torch's
``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``) lets an fp32 GEMM convert its operands to bf16
and multiply them on the bf16 units (AVX512-BF16 / AMX) with fp32 accumulation and an fp32 result. For
operands that ARE bf16 values that conversion is exact (a representable value rounds to itself), so the
result is the same fp32 sum of exact products as the fp32 GEMM's, only summed in another order: no
precision is lost, and on CPUs with bf16 units the GEMM runs at bf16 speed (measured on the 2-core CPU
VM, Xeon with AMX, 144 x 576 rows against V = 49152: fp32 logits 41 -> 22 ms, the weight-gradient
accumulation 35 -> 20 ms per chunk; ``benchmarks/README.md``).

Scope and hazard: the mode is a process-wide torch setting. ``exact_bf16_gemms`` sets it around the GEMMs
of one chunk (``fp32_linear``, ``chunked.accumulate_``) or around a region whose only GEMMs are of bf16
values (the tiled method's forward, whose threads run the blocks' logits and row math without a product of
fp32 values), never around a product of fp32 values that are not bf16 values (it would round them), and
restores the caller's value after, even on error; only the calling thread sets or restores it. A GEMM of
fp32 data that ANOTHER Python thread runs at that same moment on the CPU would also use bf16 math; set
``FUSEDCE_CPU_BF16_GEMM=0`` (read at import) or ``ENABLED = False`` to keep the setting untouched.
It is a no-op off the CPU, without bf16 units or oneDNN, while tracing
(``torch.compile`` / ``torch.export``), and where the caller already chose a precision other than the
default ("none" / "ieee").
"""
from __future__ import annotations

import contextlib
import os
from functools import lru_cache

import torch

ENABLED = os.environ.get("FUSEDCE_CPU_BF16_GEMM", "1") != "0"


@lru_cache(maxsize=None)
def _cpu_has_bf16_units() -> bool:
    """Whether oneDNN can run bf16 GEMMs natively here (AVX512-BF16 or AMX; probed once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    knob = getattr(torch.backends.mkldnn, "matmul", None)   # the fp32_precision API (torch >= 2.9)
    if knob is None or not hasattr(knob, "fp32_precision"):
        return False
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(p()) for p in probes if p is not None)


def applies(*operands: torch.Tensor) -> bool:
    """Whether ``exact_bf16_gemms`` would switch the mode for GEMMs whose bf16 sources are ``operands``
    (all bf16, all on the CPU, eager, enabled, the CPU has bf16 units)."""
    if not ENABLED or not operands or torch.compiler.is_compiling():
        return False
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in operands):
        return False
    return _cpu_has_bf16_units()


@contextlib.contextmanager
def exact_bf16_gemms(*operands: torch.Tensor):
    """Context for fp32 GEMMs of upcast copies of ``operands`` (bf16 tensors): inside it, on a CPU with
    bf16 units, such GEMMs run in oneDNN's bf16 math mode (exact for these operands, see the module
    docstring); elsewhere nothing changes. Only GEMMs whose every operand holds bf16 values belong
    inside. Restores ``torch.backends.mkldnn.matmul.fp32_precision`` on exit."""
    if not applies(*operands):
        yield
        return
    knob = torch.backends.mkldnn.matmul
    before = knob.fp32_precision
    if before not in ("none", "ieee"):   # the caller chose a mode of their own: leave it
        yield
        return
    knob.fp32_precision = "bf16"
    try:
        yield
    finally:
        knob.fp32_precision = before
