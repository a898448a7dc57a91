"""Run a test module's gloo checks on spawned ranks, once per (module, world size, backend) per session.

A module defines ``CHECKS = {name: fn(rank, world)}``; ``results(module, world, backend, ...)`` spawns
``world`` processes on 127.0.0.1 (a free TCP port) that join a gloo group and run every check in turn
with ``$FUSEDCE_BACKEND = backend``, seeded from the check's name (the same inputs on every rank),
recording a traceback per failing check instead of stopping; each pytest test then reads one check's
outcome (``assert_passed``). Under pytest-xdist the spawn happens once for the whole session (a file
lock in the session's shared temp dir), whichever worker gets there first. Used by every test module of
``tests/distributed/``.
"""
from __future__ import annotations

import fcntl
import importlib
import json
import multiprocessing
import os
import socket
import traceback
import zlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The (world size, backend) pairs the checks run on. What a third rank adds is in the exchange between ranks
# (torch collectives on row statistics, the same code whichever backend made them); each backend's kernels see
# only their own rank's slice, and the slice shapes of 3 ranks (uneven, one class, none) are also in the 2-rank
# layouts. So the Triton kernels (under the interpreter, the costly part) run on 2 ranks, and 3 ranks on torch.
WORLD_BACKENDS = ((2, "torch"), (3, "torch"), (2, "triton"))
over_worlds = pytest.mark.parametrize("world, backend", WORLD_BACKENDS,
                                      ids=[f"{backend}-world{world}" for world, backend in WORLD_BACKENDS])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out_dir, backend, module):
    """One rank: join the gloo group, run every check of ``module.CHECKS``, write {check: traceback or None}."""
    os.environ["FUSEDCE_BACKEND"] = backend
    torch.set_num_threads(1)
    import interpreter_index
    import interpreter_math
    import interpreter_speed
    interpreter_math.install()   # as conftest.py does in the pytest process
    interpreter_index.install()
    interpreter_speed.install()
    checks = importlib.import_module(module).CHECKS
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    outcomes = {}
    try:
        for name, fn in checks.items():
            torch.manual_seed(zlib.crc32(name.encode()))   # the same inputs on every rank
            try:
                fn(rank, world)
                outcomes[name] = None
            except Exception:  # noqa: BLE001 - every failure is reported by its own test
                outcomes[name] = traceback.format_exc()
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(outcomes, f)
        dist.destroy_process_group()


# The ranks start from a fork server that has imported these once (per pytest process), not each from a fresh
# interpreter: a rank then starts in well under a second instead of importing torch and fusedce again (~3.5 s
# of CPU each, which was most of a small check module's cost). The server imports nothing else and runs no
# torch op, so a fork of it holds no thread pool or lock.
PRELOAD = ["torch", "torch.distributed", "fusedce", "fusedce.distributed", "dist_harness", "interpreter_index",
           "interpreter_math", "interpreter_speed"]


def start_ranks(fn, args, nprocs: int, preload=()) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)``, the ranks forked from the fork server."""
    multiprocessing.set_forkserver_preload(PRELOAD + list(preload))   # no effect once the server runs
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _spawn(module, names, world, backend, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    try:
        start_ranks(_worker, (world, _free_port(), out_dir, backend, module), world, preload=[module])
    except Exception:  # noqa: BLE001 - a crashed rank fails every check once, with its traceback
        return {name: {"spawn": traceback.format_exc()} for name in names}
    merged = {name: {} for name in names}
    for rank in range(world):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            for name, error in json.load(f).items():
                merged[name][rank] = error
    return merged


_CACHE = {}


def results(module: str, names, world: int, backend: str, request, tmp_path_factory):
    """Outcomes of every check of ``module`` for ``world`` ranks on ``backend``: {name: {rank: error}}."""
    key = f"{module}-{world}-{backend}"
    if key in _CACHE:
        return _CACHE[key]
    root = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):   # an xdist worker: share with the other workers
        root = root.parent
    out_dir, done = root / f"fusedce-{key}", root / f"fusedce-{key}.json"
    with open(root / f"fusedce-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            done.write_text(json.dumps(_spawn(module, list(names), world, backend, str(out_dir))))
        _CACHE[key] = json.loads(done.read_text())
    return _CACHE[key]


def assert_passed(outcome: dict, world: int) -> None:
    """Fail with every rank's traceback unless all ``world`` ranks ran the check without error."""
    failed = {rank: err for rank, err in outcome.items() if err is not None}
    assert not failed.get("spawn"), failed.get("spawn")
    assert len(outcome) == world, f"only ranks {sorted(outcome)} reported"
    assert not failed, "\n".join(f"--- rank {rank} ---\n{err}" for rank, err in sorted(failed.items()))
