"""The CuTe half of the static report: compile CuTe kernel variants for one arch, no GPU, and read their resource usage
(``fusedce inspect --cute`` runs this once per arch, ``cute_report.py``)."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time

from ...backends.cute.compile import compile_key
from ...backends.cute.variants import KernelKey, check_keys, quick_keys
from .compile import access_bits, ptxas_usage, res_usage

_CP_ASYNC16 = re.compile(r"\bcp\.async\.c[ag]\.shared\.global\s+\[[^]]+\],\s*\[[^]]+\],\s*16\b")


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
        ptx_file = next((f for f in files if f.endswith(".ptx")), None)
        cubin = next((f for f in files if f.endswith(".cubin")), None)
        regs, spill_stores, spill_loads = ptxas_usage(err.getvalue())
        row["spill_bytes"] = None if spill_stores is None else spill_stores + spill_loads
        usage = res_usage(open(os.path.join(dump, cubin), "rb").read()) if cubin else {}
        row.update(local=usage.get("local"), smem=usage.get("shared_static"))
        row["regs"] = regs if regs is not None else usage.get("regs")
        ptx = open(os.path.join(dump, ptx_file)).read() if ptx_file else ""
        bits = access_bits(ptx)
        row["ld128"], row["st128"] = bits["ld"].get(128, 0), bits["st"].get(128, 0)
        row["ld_bits"], row["st_bits"] = bits["ld"], bits["st"]
        row["cp16"] = len(_CP_ASYNC16.findall(ptx))
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
