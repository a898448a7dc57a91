"""fp32 GEMMs whose operands hold bf16 values, on the CPU's bf16 units: ``exact_bf16_gemms()``.

The LM head forms fp32 logits (and fp32 weight-gradient sums) from bf16 operands by upcasting them
(``lm_head/fp32_linear.py``, ``lm_head/loop.accumulate_``): torch 2.13's CPU kernels have no
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
of one chunk (``fp32_linear``, ``loop.accumulate_``) or around a region whose only GEMMs are of bf16
values (the tiled method's forward, whose threads run the blocks' logits and row math without a product of
fp32 values), never around a product of fp32 values that are not bf16 values (it would round them), and
restores the caller's value after, even on error; only the calling thread sets or restores it. A GEMM of
fp32 data that ANOTHER Python thread runs at that same moment on the CPU would also use bf16 math; set
``FUSEDCE_CPU_BF16_GEMM=0`` (read at import) or ``ENABLED = False`` to keep the setting untouched.
It is a no-op off the CPU, while tracing (``torch.compile`` / ``torch.export``), where the caller already
chose a precision other than the default ("none" / "ieee"), and wherever the mode does not engage: the
decision is measured once per process (``cpu_bf16_capabilities``: a probe GEMM of non-bf16 fp32 data in the
mode loses digits only where oneDNN really ran it on bf16 units; CPU flags alone mislead, e.g. a Xeon with
AVX512-BF16 and no AMX reports bf16 support while the mode leaves fp32 GEMMs as they are).
"""
from __future__ import annotations

import contextlib
import os
from functools import lru_cache

import torch

ENABLED = os.environ.get("FUSEDCE_CPU_BF16_GEMM", "1") != "0"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _probe_mode_engages() -> bool:
    """Whether an fp32 GEMM of non-bf16 values loses digits in the bf16 mode (then it ran on bf16 units).
    The shape is one that torch hands to oneDNN (torch 2.11 keeps smaller fp32 GEMMs on MKL)."""
    knob = torch.backends.mkldnn.matmul
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(128, 576, generator=g), torch.randn(576, 512, generator=g)
    before = knob.fp32_precision
    knob.fp32_precision = "bf16"
    try:
        out = a @ b
    finally:
        knob.fp32_precision = before
    return bool(((out.double() - a.double() @ b.double()).abs().max() > 1e-3).item())


@lru_cache(maxsize=None)
def cpu_bf16_capabilities() -> dict[str, object]:
    """This CPU's bf16 GEMM facts, measured once per process: ``cpu`` (its name), ``amx`` and
    ``avx512_bf16`` (what torch / the CPU flags report) and ``bf16_gemm_mode`` (whether oneDNN's bf16 math
    mode really runs fp32 GEMMs on bf16 units here: the probe; only then does ``exact_bf16_gemms`` switch)."""
    flags = _cpu_flags()
    amx_probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    avx_probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = bool(amx_probe()) if amx_probe is not None else "amx_bf16" in flags
    avx512_bf16 = bool(avx_probe()) if avx_probe is not None else "avx512_bf16" in flags
    knob = getattr(torch.backends.mkldnn, "matmul", None)   # the fp32_precision API (torch >= 2.9)
    usable = torch.backends.mkldnn.is_available() and knob is not None and hasattr(knob, "fp32_precision")
    return {"cpu": _cpu_name(), "amx": amx, "avx512_bf16": avx512_bf16,
            "bf16_gemm_mode": bool(usable and (amx or avx512_bf16) and _probe_mode_engages())}


def _cpu_has_bf16_units() -> bool:
    """Whether the bf16 mode engages on this CPU (measured once: ``cpu_bf16_capabilities``)."""
    return bool(cpu_bf16_capabilities()["bf16_gemm_mode"])


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


_NATIVE_PROBES = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}


@lru_cache(maxsize=None)
def _scalar_fallback(dtype: torch.dtype) -> bool:
    """Whether torch's CPU GEMM of ``dtype`` is its scalar fallback here (oneDNN has no kernel for it on
    this CPU, e.g. bf16 without AVX-512): measured 144 x 49152 @ 49152 x 576 bf16 in 21.8 s where the fp32
    GEMM of the same values took 0.67 s (AMD EPYC, AVX2 only; ``benchmarks/README.md``)."""
    probe = getattr(torch.ops.mkldnn, _NATIVE_PROBES[dtype], None)
    try:
        return probe is not None and not bool(probe())
    except (RuntimeError, AttributeError):
        return False


def upcast_gemms(*operands: torch.Tensor) -> bool:
    """Whether GEMMs of these bf16 / fp16 CPU operands run as fp32 GEMMs of their (exact) upcast values,
    rounded once: where torch's own kernel for that dtype is the scalar fallback (eager only)."""
    if not operands or torch.compiler.is_compiling():
        return False
    dtype = operands[0].dtype
    if dtype not in _NATIVE_PROBES or any(t.dtype != dtype or t.device.type != "cpu" for t in operands):
        return False
    return _scalar_fallback(dtype)
