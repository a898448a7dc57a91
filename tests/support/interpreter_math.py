"""Correctly rounded ``exp`` / ``exp2`` / ``log`` / ``log2`` in the Triton interpreter (tests only).

The interpreter evaluates a kernel's transcendental functions with numpy in the kernel's dtype, and
numpy's float32 ``exp`` / ``log`` take a SIMD path chosen by the CPU: measured on this project's AMD EPYC
dev VM (AVX2, no AVX-512) their worst error is 2.5 ulp, where torch's own CPU kernels stay within 0.6
ulp; on a CPU with AVX-512 numpy's are within 1 ulp. The same test could then pass on one machine and
fail on another (tests/ce/gradients/test_gradient_precision.py's C14 bound, 2x stock fp32's own error, did).
Evaluating them in float64 and rounding once to the kernel's dtype gives the correctly rounded value in
all but astronomically rare cases, on every CPU: the CPU tests then judge the kernels' algorithm
(cancellation, order of operations), not the host's libm. A GPU uses its own approximations
(``ex2.approx``, ``lg2.approx``); ``benchmarks/gpu_check.py`` measures the kernels there against float64.
"""
from __future__ import annotations

import numpy as np

_PATCHED = False


def _wide(op):
    def apply(x, *args, **kwargs):
        x = np.asarray(x)
        if x.dtype.kind == "f" and x.dtype.itemsize < 8:
            return op(x.astype(np.float64)).astype(x.dtype)
        return op(x, *args, **kwargs)
    return apply


def install() -> None:
    """Patch ``triton.runtime.interpreter.InterpreterBuilder`` once (no effect without Triton)."""
    global _PATCHED
    if _PATCHED:
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    for name, op in (("create_exp", np.exp), ("create_exp2", np.exp2), ("create_log", np.log),
                     ("create_log2", np.log2)):
        if hasattr(builder, name):
            setattr(builder, name, (lambda wide: lambda self, arg: self.unary_op(arg, wide))(_wide(op)))
    _PATCHED = True
