"""fp32 GEMMs whose operands hold bf16 values, on the CPU's bf16 units: ``exact_bf16_gemms()``."""
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
    """Context for fp32 GEMMs of upcast copies of ``operands`` (bf16 tensors): inside it, on a CPU with bf16 units,
    such GEMMs run in oneDNN's bf16 math mode (exact for these operands, see the module docstring); elsewhere
    nothing changes."""
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
    """Whether torch's CPU GEMM of ``dtype`` is its scalar fallback here (oneDNN has no kernel for it on this CPU,
    e.g. bf16 without AVX-512: ~30x the fp32 GEMM's time, ``benchmarks/README.md``)."""
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
