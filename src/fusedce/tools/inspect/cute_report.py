"""The CuTe DSL rows of ``fusedce inspect --cute``: every CuTe kernel variant compiled for sm_90a and sm_100a
without a GPU (one subprocess per arch), with its resource usage and 128-bit accesses."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

ARCH_NAMES = {90: "sm_90a", 100: "sm_100a"}
FULL_VEC = {"fp32": 4, "bf16": 8, "fp16": 8}


def available() -> bool:
    return importlib.util.find_spec("cutlass") is not None


def problem(row: dict) -> str:
    if row.get("error"):
        return "compile failed"
    issues = []
    if row.get("spill_bytes") or row.get("local"):
        issues.append("spills")
    loads = row.get("cp16", 0) if row["kernel"] == "onchip" else row["ld128"]
    if row["vec"] == FULL_VEC[row["dtype"]] and (
            loads < 1 or (row["kernel"] != "forward" and row["st128"] < 1)):
        issues.append("not 128-bit")
    return ", ".join(issues)


def collect(archs=(90, 100), every: bool = False, progress=None) -> tuple:
    """``(rows, notes)``: one dict per (arch, variant), ``problem`` filled in."""
    if not available():
        return [], ["CuTe rows skipped: nvidia-cutlass-dsl is not installed (pip install 'fusedce[cute]')"]
    rows, notes = [], []
    for arch in archs:
        name = ARCH_NAMES.get(arch, f"sm_{arch}a")
        if progress:
            progress(f"CuTe kernels for {name} ({'every variant' if every else 'representative variants'})")
        env = {**os.environ, "CUTE_DSL_ARCH": name}
        env.pop("TRITON_INTERPRET", None)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, "-m", "fusedce.tools.inspect.cute_compile", "--arch", name, "--json", out]
            proc = subprocess.run(cmd + ([] if every else ["--quick"]), env=env, capture_output=True, text=True)
            if not os.path.exists(out):
                notes.append(f"{name}: CuTe compile check did not run (exit {proc.returncode}): "
                             + (proc.stderr.strip().splitlines() or [""])[-1][:200])
                continue
            data = json.load(open(out))
        for row in data["rows"]:
            row["problem"] = problem(row)
            rows.append(row)
        notes.append(f"{name}: nvidia-cutlass-dsl {data.get('cutlass_dsl', '?')}, {len(data['rows'])} variants")
    return rows, notes


def format_table(rows) -> str:
    head = ("arch", "kernel", "variant", "dtype", "vec", "regs", "spill B", "smem B", "local B",
            "ld v4", "cp.async 16B", "st v4", "check")
    lines = [head]
    fmt = lambda v: "?" if v is None else str(v)   # noqa: E731
    for r in rows:
        lines.append((r["arch"], r["kernel"], r["variant"], r["dtype"], str(r["vec"]), fmt(r.get("regs")),
                      fmt(r.get("spill_bytes")), fmt(r.get("smem")), fmt(r.get("local")), str(r.get("ld128", 0)),
                      str(r.get("cp16", 0)),
                      str(r.get("st128", 0)) if r["kernel"] != "forward" else "-",
                      r["problem"] or ("ok" if r["vec"] == FULL_VEC[r["dtype"]] else "ok (scalar rows)")))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
