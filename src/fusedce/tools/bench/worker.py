"""A fresh process for one bench measurement: ``python -m fusedce.tools.bench.worker`` reads a JSON spec on stdin and
prints one ``harness.RESULT_PREFIX`` line with the JSON result."""
from __future__ import annotations

import json
import resource
import sys
import traceback

import torch

from . import harness, inputs, paths, sweep

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_spec(spec: dict) -> dict:
    """Measure ``spec`` in this process (see the module docstring); never raises."""
    if spec.get("distill") or spec.get("distill_soft"):   # the distillation row (``distill*.measure``)
        return _distill(spec)
    if spec.get("rl"):   # the RL-precision table (``rl_precision.measure``)
        return _rl(spec)
    path = paths.PATHS[spec["path"]]
    try:
        data = inputs.build(spec["source"], path.op.needs, DTYPES[spec["dtype"]], spec["device"],
                            spec.get("rows"))
        shape = {"rows": int(data.target.shape[0]),
                 "ignored_rows": int((data.target == inputs.IGNORE_INDEX).sum()), **{
            f"{name}_shape": list(t.shape) for name, t in data.tensors().items() if name != "target"}}
        if spec.get("sweep"):
            result = sweep.measure(path, data, spec.get("repeats", sweep.REPEATS), spec.get("warmup", 0))
        else:
            result = harness.measure(path, data, spec["device"], spec["mode"], spec.get("repeats", 5),
                                     spec.get("warmup", 1))
        result["inputs"] = shape
        return result
    except ImportError as exc:
        return {"status": "unavailable", "reason": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # reported in the table, the bench goes on
        traceback.print_exc()
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}


def _distill(spec: dict) -> dict:
    try:
        from . import distill, distill_soft
        return (distill_soft if spec.get("distill_soft") else distill).measure(spec)
    except ImportError as exc:
        return {"status": "unavailable", "reason": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # reported in the table, the bench goes on
        traceback.print_exc()
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}


def _rl(spec: dict) -> dict:
    try:
        from . import rl_precision
        return rl_precision.measure(spec)
    except Exception as exc:  # reported in the table, the bench goes on
        traceback.print_exc()
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}


def main() -> int:
    result = run_spec(json.loads(sys.stdin.read()))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["process_cpu_s"] = round(usage.ru_utime + usage.ru_stime, 2)  # contention shows as wall >> CPU
    print(harness.RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
