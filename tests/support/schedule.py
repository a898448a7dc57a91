"""The order the suite's tests start in: the slowest files first, so that pytest-xdist's work stealing ends the
run with short tests on every worker instead of one worker finishing a long test alone.

``SLOW`` is measured (per-file durations of a full run, 2 cores, 2026-12-06), not a rule: a file missing from it
only starts later. The order changes no test's inputs (each test seeds from its own id: ``conftest._seed``).
"""
from __future__ import annotations

SLOW = (
    "tests/tools/test_inspect.py", "tests/cute/test_cute_compile.py", "tests/hf/test_hf_family_sweep.py",
    "tests/tools/test_bench_distill.py", "tests/tools/test_inspect_distill.py", "tests/distill/test_distill_example.py",
    "tests/tools/test_gpu_check_dry_run.py", "tests/distributed/test_distributed_compile.py",
    "tests/ce/compile/test_compile_token_counts.py", "tests/ce/compile/test_compile_loops.py",
    "tests/distill/test_distill_compile.py", "tests/ce/compile/test_compile_order.py",
    "tests/tools/test_bench_smoke.py",
    "tests/core/test_tracing.py", "tests/ce/compile/test_compile.py", "tests/distill/test_distill_memory.py",
    "tests/ce/options/test_ce_options.py",
)


def slow_first(items: list) -> None:
    """Reorder ``items`` in place: the files of ``SLOW`` first, in its order, then the rest as collected."""
    rank = {path: i for i, path in enumerate(SLOW)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(SLOW)))
