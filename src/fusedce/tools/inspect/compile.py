"""Compile one kernel launch for a GPU target without a GPU, and read its resource usage."""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature


@dataclass
class Compiled:
    """One compiled kernel: its PTX, cubin, launch metadata and ptxas' log."""

    name: str
    arch: int
    ptx: str
    cubin: bytes
    shared: int          # dynamic shared memory bytes requested per block
    num_warps: int
    constexprs: dict = field(default_factory=dict)   # name -> value, incl. specialized ints (== 1);
                                                     # a tuple argument's field as "name[i]"
    ptxas_log: str = ""


def _specialize(kernel, args, meta, target: GPUTarget):
    """``(signature, constexprs, attrs, options)`` exactly as ``JITFunction.run`` builds them."""
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, dict(meta), bound_args,
                                                              specialization, options)
    return signature, constexprs, attrs, options


def compile_launch(kernel, args, meta, arch: int) -> Compiled:
    """Compile ``kernel[grid](*args, **meta)`` for ``sm_<arch>`` (e.g. 90, 100); raises if Triton can't."""
    target = GPUTarget("cuda", arch, 32)
    signature, constexprs, attrs, options = _specialize(kernel, args, meta, target)
    # Recompile (never hit Triton's cache) so that ptxas runs and its -v log can be captured.
    saved = (knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log)
    knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = True, True
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            ck = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                options=options.__dict__)
    finally:
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = saved
    names = kernel.arg_names
    return Compiled(name=kernel.__name__, arch=arch, ptx=ck.asm["ptx"], cubin=ck.asm["cubin"],
                    shared=int(ck.metadata.shared), num_warps=int(ck.metadata.num_warps),
                    constexprs={names[k[0]] + "".join(f"[{i}]" for i in k[1:]): v for k, v in constexprs.items()},
                    ptxas_log=log.getvalue())


# ---------------------------------------------------------------- resource usage

_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_GLOBAL_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)")
_TYPE_BITS = re.compile(r"^[bsuf](8|16|32|64)$")


def res_usage(cubin: bytes) -> dict:
    """``cuobjdump -res-usage`` of a cubin: REG, STACK, SHARED (static), LOCAL; {} if unavailable."""
    tool = knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    finally:
        os.unlink(f.name)
    m = _RES_USAGE.search(out)
    return {} if m is None else dict(zip(("regs", "stack", "shared_static", "local"), map(int, m.groups())))


def access_bits(ptx: str) -> dict:
    """``{"ld": {bits: count}, "st": {bits: count}}`` of the global loads/stores in ``ptx`` (per
    instruction in the code, not per execution: a loop body counts once)."""
    counts = {"ld": {}, "st": {}}
    for op, suffix in _GLOBAL_ACCESS.findall(ptx):
        parts = suffix.strip(".").split(".")
        vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        bits = next((int(_TYPE_BITS.match(p).group(1)) for p in parts if _TYPE_BITS.match(p)), 0)
        width = vec * bits
        counts[op][width] = counts[op].get(width, 0) + 1
    return counts


def ptxas_usage(log: str) -> tuple:
    """``(regs, spill_stores, spill_loads)`` from ptxas' ``-v`` log (None where the log says nothing)."""
    regs = _PTXAS_REGS.search(log)
    spills = _PTXAS_SPILLS.search(log)
    return (int(regs.group(1)) if regs else None, int(spills.group(1)) if spills else None,
            int(spills.group(2)) if spills else None)


def resources(c: Compiled) -> dict:
    """Registers, spills (bytes), shared/local memory (bytes) and global access widths of ``c``."""
    usage = res_usage(c.cubin)
    regs, spill_stores, spill_loads = ptxas_usage(c.ptxas_log)
    return {
        "regs": regs if regs is not None else usage.get("regs"),
        "spill_stores": spill_stores,
        "spill_loads": spill_loads,
        "local": usage.get("local"),
        "stack": usage.get("stack"),
        "smem_dynamic": c.shared,
        "smem_static": usage.get("shared_static"),
        "access_bits": access_bits(c.ptx),
    }
