"""Compile one CuTe kernel variant (``variants.KernelKey``) with fake tensors: no GPU, no driver.

``compile_key(key)`` returns the compiled callable (the launcher's path on a GPU; the arch comes from
``$CUTE_DSL_ARCH``, which ``launch.ensure_arch`` sets from the device before ``cutlass`` is imported).
``python -m fusedce.backends.cute.compile --arch sm_90a --json OUT`` compiles every variant of
``variants.check_keys()`` for that arch in this one process (the arch is read from the environment at
trace time, so one process per arch), keeps PTX and cubin, and writes per variant: registers and
spills (ptxas' own report, ``remarks{ptx}``), static/local memory (Triton's bundled ``cuobjdump
-res-usage`` when present), shared memory, the global access widths of the PTX and its 16-byte
``cp.async`` copies (the on-chip chunk kernel's logits stream).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from ...types import LossOptions
from .variants import ITEMSIZE, KernelKey, check_keys, quick_keys


def _dtypes():
    import cutlass
    return {"fp32": cutlass.Float32, "bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


def _kernel(key: KernelKey):
    from .kernels.ce_backward import CEBackward
    from .kernels.ce_chunk import CEChunk
    from .kernels.ce_chunk_onchip import CEChunkOnChip
    from .kernels.ce_forward import CEForward
    from .tuning import BACKWARD_UNROLL, THREADS
    if key.kind == "forward":
        return CEForward(key.vec, THREADS, key.loss, *key.features)
    if key.kind == "backward":
        return CEBackward(key.vec, THREADS, BACKWARD_UNROLL, key.loss, *key.features)
    if key.kind == "onchip":
        return CEChunkOnChip(key.vec, THREADS, key.cluster, key.loss, *key.features)
    return CEChunk(key.vec, THREADS, key.loss, *key.features)


def fake_args(key: KernelKey) -> tuple:
    """The kernel's arguments as fake tensors (dynamic BT and V; V and the row stride divisible by
    ``vec``; the logits ``vec * itemsize`` bytes aligned) and placeholder scalars (the default options'),
    in call order."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32

    from .kernels.scalars import dsl_scalars

    rt = cute.runtime
    dt = _dtypes()[key.dtype]
    vec, f = key.vec, key.feature
    rows, cols = cute.sym_int(), cute.sym_int(divisibility=vec)
    align = vec * ITEMSIZE[key.dtype]

    def logits():
        return rt.make_fake_tensor(dt, (rows, cols), stride=(cute.sym_int64(divisibility=vec), 1),
                                   assumed_align=align)

    def vector(dtype=Float32):
        return rt.make_fake_compact_tensor(dtype, (rows,))

    has_weight = key.loss.HAS_WEIGHT
    weight = rt.make_fake_compact_tensor(Float32, (cols,), assumed_align=min(16, 4 * vec)) if has_weight else None
    wsum = rt.make_fake_compact_tensor(Float32, (1,)) if has_weight else None
    target = vector(cutlass.Int64)
    scalars = dsl_scalars(LossOptions().kernel_scalars())
    stream = rt.make_fake_stream()
    if key.kind == "forward":
        pred = vector(cutlass.Int64) if f["stats"] else None
        return (logits(), target, weight, wsum, vector(), vector(), vector(), pred, scalars, stream)
    if key.kind == "backward":
        grad_lse = vector() if f["grad_lse"] else None
        return (logits(), logits(), target, weight, wsum, vector(), vector(), vector(), grad_lse, scalars, stream)
    pred = vector(cutlass.Int64) if f["stats"] else None     # chunk and onchip: the same arguments
    return (logits(), target, weight, wsum, vector(), vector() if f["zloss"] else None, vector(), vector(),
            vector(), pred, vector() if f["dft"] else None, scalars, stream)


def compile_key(key: KernelKey, options: str = ""):
    """``cute.compile`` of one variant for ``$CUTE_DSL_ARCH``."""
    import cutlass.cute as cute
    return cute.compile(_kernel(key), *fake_args(key), options=options)


# ---------------------------------------------------------------- the static report (CPU)

_PTXAS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers", re.S)
_RES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)")
_BITS = re.compile(r"^[bsuf](8|16|32|64)$")
_CP_ASYNC16 = re.compile(r"\bcp\.async\.c[ag]\.shared\.global\s+\[[^]]+\],\s*\[[^]]+\],\s*16\b")


def access_bits(ptx: str) -> dict:
    """``{"ld": {bits: n}, "st": {bits: n}}`` of the global accesses in the PTX (static count)."""
    out = {"ld": {}, "st": {}}
    for op, suffix in _ACCESS.findall(ptx):
        parts = suffix.strip(".").split(".")
        vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        bits = next((int(_BITS.match(p).group(1)) for p in parts if _BITS.match(p)), 0)
        out[op][vec * bits] = out[op].get(vec * bits, 0) + 1
    return out


def _cuobjdump(cubin: str) -> dict:
    try:
        from triton import knobs
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", cubin], capture_output=True,
                              text=True, check=True).stdout
    except Exception:   # noqa: BLE001 - optional: Triton's bundled tool
        return {}
    m = _RES.search(text)
    return {} if m is None else dict(zip(("regs", "stack", "smem_static", "local"), map(int, m.groups())))


def report_one(key: KernelKey, arch: str) -> dict:
    """Compile ``key`` keeping PTX and cubin; its resource row (``error`` set if compilation failed)."""
    row = {"arch": arch, "kernel": key.kind, "dtype": key.dtype, "vec": key.vec, "cluster": key.cluster,
           "variant": key.name, "error": ""}
    with tempfile.TemporaryDirectory() as dump:
        err = io.StringIO()
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stderr(err):
                compile_key(key, options=f"--keep-ptx --keep-cubin --dump-dir {dump} remarks{{ptx}}")
        except Exception as exc:  # noqa: BLE001 - reported per variant and failed by the tests
            row["error"] = f"{type(exc).__name__}: {str(exc).strip()[:400]}"
            return row
        row["compile_s"] = round(time.perf_counter() - t0, 3)
        files = os.listdir(dump)
        ptx = next((f for f in files if f.endswith(".ptx")), None)
        cubin = next((f for f in files if f.endswith(".cubin")), None)
        m = _PTXAS.search(err.getvalue())
        row["spill_bytes"] = None if m is None else int(m.group(1)) + int(m.group(2))
        row["regs"] = None if m is None else int(m.group(3))
        usage = _cuobjdump(os.path.join(dump, cubin)) if cubin else {}
        row.update(local=usage.get("local"), smem=usage.get("smem_static"))
        if row["regs"] is None:
            row["regs"] = usage.get("regs")
        bits = access_bits(open(os.path.join(dump, ptx)).read()) if ptx else {"ld": {}, "st": {}}
        row["ld128"], row["st128"] = bits["ld"].get(128, 0), bits["st"].get(128, 0)
        row["ld_bits"], row["st_bits"] = bits["ld"], bits["st"]
        row["cp16"] = len(_CP_ASYNC16.findall(open(os.path.join(dump, ptx)).read())) if ptx else 0
        row["has_cubin"] = cubin is not None
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="compile the CuTe kernel variants for one arch (no GPU)")
    p.add_argument("--arch", required=True, help="sm_90a or sm_100a (= $CUTE_DSL_ARCH)")
    p.add_argument("--json", required=True)
    p.add_argument("--kind", action="append", help="forward / backward / chunk (default: all)")
    p.add_argument("--quick", action="store_true", help="the representative subset (variants.quick_keys)")
    args = p.parse_args(argv)
    if os.environ.get("CUTE_DSL_ARCH") != args.arch or "cutlass" in sys.modules:
        print("run with CUTE_DSL_ARCH set to --arch before cutlass is imported", file=sys.stderr)
        return 2
    keys = quick_keys() if args.quick else check_keys()
    rows = [report_one(k, args.arch) for k in keys if not args.kind or k.kind in args.kind]
    import cutlass
    with open(args.json, "w") as f:
        json.dump({"arch": args.arch, "cutlass_dsl": getattr(cutlass, "__version__", "?"), "rows": rows}, f)
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
