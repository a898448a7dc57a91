"""The linear cross-entropy on CPU while other processes compete for the cores: stock vs fusedce chunked
vs fusedce tiled, each run in a fresh process, optionally against a second source tree (the code before a
change) in the same run, with and without a competing busy-loop process.

    PYTHONPATH=src python benchmarks/cpu_contention.py --rows 1024 --repeats 3 \
        --baseline-src /tmp/fusedce-before/src --out results/cpu_contention.json

Each measurement: one forward+backward of ``hidden (rows, H) @ weight (V, H).T`` + mean cross-entropy
(fp32, seeded random inputs, 10% of targets ignored) after a small warm-up call, wall time and the
process's CPU time (contention shows as wall >> CPU / threads). The competitor (``--competitor``) is one
busy-loop process per core, each pinned to its core, started before and stopped after the measurements
it covers. The machine's own load (other jobs) is part of every condition: the load average is printed.
Timing under contention is a script, not a unit test: its numbers depend on the machine's other jobs.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

PATHS = ("stock", "chunked", "tiled")


def _worker(path: str, rows: int, hidden_size: int, vocab: int) -> None:
    import torch
    import fusedce

    def step(h, w, t):
        if path == "stock":
            loss = torch.nn.functional.cross_entropy(h @ w.t(), t)
        else:
            loss = fusedce.linear_cross_entropy(h, w, t, method=path, backend="torch")
        loss.backward()

    gen = torch.Generator().manual_seed(0)
    small = (torch.randn(64, hidden_size, requires_grad=True), torch.randn(2048, hidden_size, requires_grad=True),
             torch.randint(0, 2048, (64,)))
    step(*small)                                            # warm-up: library loading, first-call costs
    hidden = torch.randn(rows, hidden_size, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) * hidden_size ** -0.5).requires_grad_()
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[torch.randperm(rows, generator=gen)[: rows // 10]] = -100
    cpu0, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    step(hidden, weight, target)
    wall, cpu1 = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    print(json.dumps({"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "threads": torch.get_num_threads(),
                      "fusedce": fusedce.__file__}), flush=True)


def _spin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


class Competitor:
    """One busy-loop process per core of this process's affinity, each pinned to its core."""

    def __enter__(self):
        self.procs = [mp.Process(target=_spin, args=(c,), daemon=True) for c in sorted(os.sched_getaffinity(0))]
        for p in self.procs:
            p.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.join()


def _measure(src: str, path: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, "--rows", str(args.rows), "--hidden",
           str(args.hidden), "--vocab", str(args.vocab)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"wall_s": None, "error": f"timeout after {args.timeout} s"}
    if done.returncode != 0:
        return {"wall_s": None, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--src", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    parser.add_argument("--baseline-src", default=None, help="another fusedce source tree, timed alongside")
    parser.add_argument("--conditions", default="machine,competitor",
                        help="machine (the machine as it is) and/or competitor (plus a busy loop per core)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.rows, args.hidden, args.vocab)
        return 0
    trees = {"current": os.path.abspath(args.src)}
    if args.baseline_src:
        trees["baseline"] = os.path.abspath(args.baseline_src)
    paths = args.paths.split(",")
    results = []
    for condition in args.conditions.split(","):
        with (Competitor() if condition == "competitor" else _Nothing()):
            for repeat in range(args.repeats):
                for tree, src in trees.items():
                    for path in paths:
                        if path == "stock" and tree != "current":
                            continue
                        load = os.getloadavg()[0]
                        row = {"condition": condition, "tree": tree, "path": path, "repeat": repeat,
                               "load_before": round(load, 2), **_measure(src, path, args)}
                        results.append(row)
                        print(json.dumps(row), flush=True)
    _table(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.platform(), "processor": platform.processor(), "cores": os.cpu_count(),
                       "args": vars(args), "results": results}, f, indent=1)
    return 0


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _table(results) -> None:
    keys = sorted({(r["condition"], r["tree"], r["path"]) for r in results})
    print(f"\n{'condition':<11} {'tree':<9} {'path':<8} {'median s':>9} {'min s':>8} {'max s':>8}  runs (wall s)")
    for key in keys:
        walls = [r["wall_s"] for r in results if (r["condition"], r["tree"], r["path"]) == key]
        done = [w for w in walls if w is not None]
        med = f"{statistics.median(done):9.2f}" if done else f"{'-':>9}"
        lo, hi = (f"{min(done):8.2f}", f"{max(done):8.2f}") if done else (f"{'-':>8}", f"{'-':>8}")
        print(f"{key[0]:<11} {key[1]:<9} {key[2]:<8} {med} {lo} {hi}  {walls}")


if __name__ == "__main__":
    sys.exit(main())
