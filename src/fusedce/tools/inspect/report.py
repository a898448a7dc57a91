"""``fusedce inspect``: what the Triton kernels compile to on Hopper / Blackwell, without a GPU.

For each kernel at representative configurations (logits dtype x vocabulary x the constexpr flags that
change code) it builds the launch as the launcher does, on meta tensors, compiles it for sm_90 (H100 / H200)
and sm_100 (B200) when the installed Triton can, and prints registers, spills, shared memory and whether the
streaming accesses are 128-bit (``v4 got/need``: the PTX's 128-bit loads, and stores in the backward, against
those one block of logits needs; the tiled kernels' ``mma`` column: whether ``tl.dot`` lowered to tensor-core
instructions).

What it compiles: by default a quick set (32 configurations, under a minute on 2 quiet CPU cores: 23 CPU
seconds): sm_90, V = 128256, the ``plain`` variant of every kernel (a distillation kernel's first
divergence), bf16 and fp32. ``--all`` compiles every default arch (90, 100), vocabulary and
representative variant (about 10 min, some 1,500 lines); ``--arch`` / ``--vocab`` / ``--kernel`` /
``--variant`` / ``--dtype`` choose each axis, ``--every-variant`` every flag combination.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from .variants import (ALL_KERNELS, ARCHS, DEFAULT_VOCABS, DTYPES, ROWS, SOFT, TILED, VARIANTS, VOCABS, Variant,
                       every_variant, launch)

@dataclass
class Row:
    arch: int
    kernel: str
    dtype: str
    vocab: int
    variant: str
    block_v: int
    num_warps: int
    align: int
    regs: Optional[int]
    spill_bytes: Optional[int]
    local: Optional[int]
    smem: int
    ld128: int
    ld128_needed: int
    narrow_loads: int
    st128: int
    st128_needed: int
    aligned_rows: bool
    ld_bits: dict              # {access width in bits: count} of the global loads in the PTX
    error: str = ""
    mma: str = "-"             # tiled kernels: "wgmma" / "mma" when tl.dot lowers to tensor-core
                               # instructions in the PTX (ptxas maps them to HGMMA / HMMA), else "none"
    atomics: int = 0           # atomic instructions (atom. / red.) in the PTX

    @property
    def deterministic(self) -> bool:
        """A kernel of a deterministic path: it must hold no atomic instruction."""
        return self.kernel not in NONDETERMINISTIC_KERNELS

    @property
    def vectorized(self) -> bool:
        return self.ld128 >= self.ld128_needed and self.st128 >= self.st128_needed

    @property
    def problem(self) -> str:
        """What is wrong with this kernel config ("" if nothing)."""
        if self.error:
            return "compile failed"
        issues = []
        if self.spill_bytes or self.local:
            issues.append("spills")
        if self.aligned_rows and not self.vectorized:
            issues.append("not 128-bit")
        if self.deterministic and self.atomics:
            issues.append("atomics")
        return ", ".join(issues)


def _needed(kernel: str, itemsize: int, meta: dict) -> tuple:
    """128-bit accesses per thread per block: (loads, stores) of the streams that must be vectorized
    (``meta["FLAGS"]``: the launch's ``options.LossFlags``)."""
    if kernel in TILED:   # operand tiles go through shared memory (TMA / cp.async): no per-thread rule
        return 0, 0
    threads = 32 * meta["num_warps"]
    per_stream = lambda size: max(1, meta["BLOCK_V"] * size // (16 * threads))   # noqa: E731
    if kernel == "distill_rows":   # student and teacher streams of BLOCK_N rows; the gradient's stores
        per_stream = lambda size: max(1, meta["BLOCK_N"] * meta["BLOCK_V"] * size // (16 * threads))  # noqa
        return 2 * per_stream(itemsize), per_stream(itemsize) if meta["HAS_GRAD"] else 0
    loads = per_stream(itemsize)
    if kernel in SOFT:   # the target q (the logits' dtype here), and the class weights whenever given
        loads += per_stream(itemsize) + (per_stream(4) if meta["FLAGS"].HAS_WEIGHT else 0)
    elif meta["FLAGS"].HAS_WEIGHT and meta["FLAGS"].HAS_SMOOTHING:
        loads += per_stream(4)                       # fp32 class weights, read blockwise
    stores = per_stream(itemsize) if kernel in ("backward", "chunk", "probs_backward") else 0
    return loads, stores


def _mma(ptx: str) -> str:
    """Which tensor-core instructions ``tl.dot`` became: "wgmma" (Hopper warpgroup MMA), "mma" (mma.sync),
    or "none" (FMA: fp32 IEEE dots)."""
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if re.search(r"\bmma\.sync", ptx) or "tcgen05.mma" in ptx:
        return "mma"
    return "none"


def _atomics(ptx: str) -> int:
    """The atomic instructions in the PTX (``atom.*``, ``red.*``), predicated or not."""
    return len(re.findall(r"^\s*(?:@!?%p\d+\s+)?(?:atom|red)\.", ptx, flags=re.M))


# The one kernel allowed atomics: the tiled backward's fp32 accumulation (``deterministic=False``).
NONDETERMINISTIC_KERNELS = ("tiled_backward", "distill_tiled_grad")
_CACHE: dict = {}


def inspect_one(arch: int, kernel: str, dtype_name: str, vocab: int, variant_name: str,
                variant: Optional[Variant] = None) -> Row:
    """Compile one configuration (memoized on what the compiler sees) and summarize it."""
    from .compile import compile_launch, resources

    dtype, variant = DTYPES[dtype_name], variant or VARIANTS[kernel][variant_name]
    fn, _grid, args, meta = launch(kernel, dtype, vocab, variant)
    itemsize = torch.empty((), dtype=dtype).element_size()
    ld_needed, st_needed = _needed(kernel, itemsize, meta)
    aligned = (vocab * itemsize) % 16 == 0
    base = dict(arch=arch, kernel=kernel, dtype=dtype_name, vocab=vocab, variant=variant_name,
                block_v=meta["BLOCK_V"], num_warps=meta["num_warps"], align=meta.get("ALIGN", 0),
                ld128_needed=ld_needed, st128_needed=st_needed, aligned_rows=aligned)
    # Same specialization for every V divisible by 16 with the same BLOCK_V: compile once.
    key = (arch, kernel, dtype_name, variant, tuple(sorted(meta.items())), vocab % 16 == 0)
    if key not in _CACHE:
        try:
            compiled = compile_launch(fn, args, meta, arch)
            _CACHE[key] = dict(resources(compiled), mma=_mma(compiled.ptx) if kernel in TILED else "-",
                               atomics=_atomics(compiled.ptx))
        except Exception as exc:  # noqa: BLE001 - reported, e.g. an arch this Triton can't target
            _CACHE[key] = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]}"}
    res = _CACHE[key]
    if "error" in res:
        return Row(**base, regs=None, spill_bytes=None, local=None, smem=0, ld128=0, narrow_loads=0,
                   st128=0, ld_bits={}, error=res["error"])
    ld, st = res["access_bits"]["ld"], res["access_bits"]["st"]
    spills = None if res["spill_stores"] is None else res["spill_stores"] + res["spill_loads"]
    return Row(**base, regs=res["regs"], spill_bytes=spills, local=res["local"], smem=res["smem_dynamic"],
               ld128=ld.get(128, 0), narrow_loads=sum(n for b, n in ld.items() if b < 128),
               st128=st.get(128, 0), ld_bits=dict(sorted(ld.items())), mma=res["mma"], atomics=res["atomics"])


def arch_supported(arch: int) -> Optional[str]:
    """None if the installed Triton compiles for ``sm_<arch>``, else why not."""
    row = inspect_one(arch, "backward", "fp32", 4096, "plain")
    return row.error or None


def collect(archs=ARCHS, dtypes=tuple(DTYPES), vocabs=DEFAULT_VOCABS, kernels=ALL_KERNELS,
        variants=None, every=False, progress=None, first=False) -> tuple:
    """All rows for the requested configurations (``first``: each kernel's first variant only), and notes
    on targets that were skipped."""
    rows, notes = [], []
    for arch in archs:
        why = arch_supported(arch)
        if why:
            notes.append(f"sm_{arch}: skipped, the installed Triton cannot compile for it ({why})")
            continue
        for kernel in kernels:
            table = every_variant(kernel) if every else VARIANTS[kernel]
            for name, variant in list(table.items())[:1] if first else table.items():
                if variants and name not in variants:
                    continue
                for dtype in dtypes:
                    for vocab in vocabs:
                        if progress:
                            progress(f"sm_{arch} {kernel} {name} {dtype} V={vocab}")
                        rows.append(inspect_one(arch, kernel, dtype, vocab, name, variant))
    return rows, notes


def _fmt(v) -> str:
    return "?" if v is None else str(v)


def format_table(rows) -> str:
    head = ("arch", "kernel", "variant", "dtype", "V", "BLOCK_V", "warps", "ALIGN", "regs", "spill B",
            "smem B", "ld v4 got/need", "narrow ld", "st v4 got/need", "mma", "atomics", "check")
    lines = [head]
    for r in rows:
        check = r.problem or ("ok" if r.aligned_rows else "ok (rows unaligned: scalar)")
        lines.append((f"sm_{r.arch}", r.kernel, r.variant, r.dtype, str(r.vocab), str(r.block_v),
                      str(r.num_warps), str(r.align), _fmt(r.regs), _fmt(r.spill_bytes), str(r.smem),
                      f"{r.ld128}/{r.ld128_needed}", str(r.narrow_loads),
                      f"{r.st128}/{r.st128_needed}" if r.kernel in ("backward", "chunk", "distill_rows") else "-",
                      r.mma, str(r.atomics), check))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


HELP = "static GPU report of the Triton kernels (registers, spills, smem, 128-bit loads), no GPU needed"
DESCRIPTION = __doc__


# What a bare ``fusedce inspect`` compiles (a quick look, under a minute on 2 quiet CPU cores): sm_90 at
# Llama-3's V, each kernel's first variant (its simplest: "plain", or a distillation kernel's first
# divergence), both dtypes. ``--all`` takes every default value on every axis not given (both archs,
# DEFAULT_VOCABS, the representative variants: ~10 min on 2 CPU cores, ~1,500 table lines).
QUICK = {"arch": (90,), "vocab": (128256,)}


def _vocab(text: str) -> int:
    """``--vocab``'s value: an integer V >= 1 (argparse reports the error with the option's name)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"V must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"V must be >= 1 (the number of classes), got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``fusedce inspect`` (the ``fusedce`` CLI's subcommand interface)."""
    full = "; with --all: 90 and 100"
    p.add_argument("--arch", type=int, action="append",
                   help=f"compute capability, repeatable (default: {QUICK['arch'][0]}{full})")
    p.add_argument("--dtype", action="append", choices=list(DTYPES), help="logits dtype (default: all)")
    p.add_argument("--vocab", type=_vocab, action="append",
                   help=f"V, repeatable (default: {QUICK['vocab'][0]}; with --all: {list(DEFAULT_VOCABS)})")
    p.add_argument("--kernel", action="append", choices=list(ALL_KERNELS), help="default: all")
    p.add_argument("--variant", action="append",
                   help="flag combination, e.g. plain, all, repeatable (default: each kernel's first, plain "
                        "for most; with --all: every representative one)")
    p.add_argument("--all", action="store_true",
                   help="the full report: every default arch, vocabulary and representative variant for the "
                        "options not given (about 10 min and 1,500 lines on 2 CPU cores; without it, about "
                        "a minute)")
    p.add_argument("--every-variant", action="store_true",
                   help="every combination of the constexpr flags instead of the representative ones")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--cute", action="store_true",
                   help="also compile the CuTe DSL kernels for sm_90a / sm_100a (needs fusedce[cute]; "
                        "with --every-variant, every flag combination)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 if any kernel spills or misses 128-bit accesses on aligned rows")


def selection(args) -> dict:
    """The archs, vocabularies and variants (None: every one of the kernel's table) that ``args`` asks
    for, and ``first`` (only each kernel's first variant): each given option as given; else ``QUICK``'s,
    or with ``--all`` every default."""
    full = getattr(args, "all", False)
    return {"archs": tuple(args.arch or (ARCHS if full else QUICK["arch"])),
            "vocabs": tuple(args.vocab or (DEFAULT_VOCABS if full else QUICK["vocab"])),
            "variants": args.variant, "first": not (full or args.variant or args.every_variant)}


def main(argv=None) -> int:
    """``python -m fusedce.tools.inspect [options]`` (same options as ``fusedce inspect``)."""
    from ..help_format import DefaultsFormatter, plain
    parser = argparse.ArgumentParser(prog="fusedce inspect", description=plain(DESCRIPTION),
                                     formatter_class=DefaultsFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args) -> int:
    """Compile, print the table (and JSON); the exit status (1 with ``--strict`` and a problem)."""
    import triton
    from triton.runtime.jit import JITFunction

    from ...backends.triton.kernels.ce_forward import ce_forward_kernel

    if not isinstance(ce_forward_kernel, JITFunction):
        print("fusedce inspect compiles for a GPU target; unset TRITON_INTERPRET (the interpreter replaces "
              "the kernels by Python functions)", file=sys.stderr)
        return 2
    # Triton 3.9's default (FP fusion on), stated as gpu_check.sh states it: its "unset" warning is not ours to print
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    chosen = selection(args)
    rows, notes = collect(archs=chosen["archs"], dtypes=tuple(args.dtype or DTYPES), vocabs=chosen["vocabs"],
                          kernels=tuple(args.kernel or ALL_KERNELS), variants=chosen["variants"], first=chosen["first"],
                          every=args.every_variant,
                          progress=lambda msg: print(f"compiling {msg}", file=sys.stderr, flush=True))
    print(f"Triton {triton.__version__}: kernels compiled offline (no GPU), BT = {ROWS}, "
          f"launch configs from backends/triton/tuning.py")
    print(format_table(rows))
    for note in notes:
        print(note)
    vocab_notes = [f"  V={v}: {VOCABS[v]}" for v in chosen["vocabs"] if v in VOCABS]
    if vocab_notes:
        print("vocabularies:\n" + "\n".join(vocab_notes))
    cute_rows = _cute_section(args)
    problems = [r for r in rows if r.problem]
    print(f"{len(rows)} configs, {len(problems)} with problems"
          + "".join(f"\n  PROBLEM sm_{r.arch} {r.kernel} {r.variant} {r.dtype} V={r.vocab}: {r.problem}"
                    f"{' (' + r.error + ')' if r.error else ''}" for r in problems))
    if not (args.all or args.arch or args.vocab or args.variant or args.every_variant):
        print(f"quick set: sm_{QUICK['arch'][0]}, V={QUICK['vocab'][0]}, the first variant of each "
              "kernel; --all for every arch, vocabulary and representative variant (about 10 min on 2 CPU cores), "
              "or choose with --arch / --vocab / --kernel / --variant / --dtype")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "notes": notes,
                       "rows": [dict(asdict(r), problem=r.problem) for r in rows], "cute_rows": cute_rows},
                      f, indent=1)
    return 1 if (args.strict and (problems or any(r["problem"] for r in cute_rows))) else 0


def _cute_section(args) -> list:
    """The CuTe DSL table (``cute_report.py``) when ``--cute`` is given; its rows."""
    if not getattr(args, "cute", False):
        return []
    from . import cute_report
    archs = tuple(a for a in selection(args)["archs"] if a in cute_report.ARCH_NAMES) or (90, 100)
    rows, notes = cute_report.collect(archs, every=args.every_variant,
                                      progress=lambda msg: print(f"compiling {msg}", file=sys.stderr, flush=True))
    print("\nCuTe DSL kernels (backend='cute'), compiled offline with fake tensors (dynamic BT and V):")
    if rows:
        print(cute_report.format_table(rows))
    for note in notes:
        print(note)
    bad = [r for r in rows if r["problem"]]
    print(f"{len(rows)} CuTe variants, {len(bad)} with problems"
          + "".join(f"\n  PROBLEM {r['arch']} {r['kernel']} {r['variant']} {r['dtype']} vec={r['vec']}: "
                    f"{r['problem']}{' (' + r['error'][:200] + ')' if r.get('error') else ''}" for r in bad))
    return rows
