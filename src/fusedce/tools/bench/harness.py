"""Timing, peak memory and parity of one bench path; shared by ``fusedce bench`` and scripts."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

import torch

from .inputs import IGNORE_INDEX, Inputs
from .paths import BenchPath

RESULT_PREFIX = "FUSEDCE-BENCH-RESULT "
TIME_METHOD = {
    "cpu": "median of {repeats} fwd+bwd, time.perf_counter, after {warmups} untimed warm-up fwd+bwd (the "
           "peak-memory run + {warmup} of --warmup; before them one 16-row set-up run)",
    "cuda": "triton.testing.do_bench, median, fwd+bwd (after 1 untimed compile/autotune run)",
}


def time_method(device: str, repeats: int, warmup: int) -> str:
    """How ``measure`` times a timed row, with the warm-up it really runs: on CPU the peak-memory run
    (a full forward+backward, before the timing) plus ``warmup`` more (``median_ms``)."""
    return TIME_METHOD[device].format(repeats=repeats, warmup=warmup, warmups=1 + warmup)


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
        return int(match.group(1)) if match else None
    except OSError:
        return None


def _release_free_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim(0)``), so that memory an earlier
    call freed, and ``malloc`` would reuse without touching RSS, cannot hide a later call's allocations:
    without it a fused head measured after the stock one showed 0.0 MiB for its 24 MiB weight gradient."""
    import ctypes
    import ctypes.util
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: nothing to release this way
        pass


class CpuPeakMemory:
    """Context manager: ``self.bytes`` = peak RSS inside the block minus RSS at its start
    (``self.base``); ``self.peak`` = that peak RSS itself."""

    def __enter__(self):
        import psutil
        _release_free_heap()
        self._process = psutil.Process()
        self._sampled, self._stop, self._thread = 0, threading.Event(), None
        try:  # "5" resets the peak RSS (VmHWM) to the current RSS, Linux >= 4.0
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "peak RSS (VmHWM, reset via /proc/self/clear_refs) minus RSS with inputs"
        except OSError:
            self.method = "peak RSS (psutil, sampled every 1 ms) minus RSS with inputs"
            self._thread = threading.Thread(target=self._sample, daemon=True)
        self._base = self._process.memory_info().rss
        self._sampled = self._base
        if self._thread:
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self._sampled = max(self._sampled, self._process.memory_info().rss)

    def __exit__(self, *exc):
        if self._thread:
            self._stop.set()
            self._thread.join()
            peak = max(self._sampled, self._process.memory_info().rss)
        else:
            peak = _status_kib("VmHWM") * 1024
        self.base, self.peak = self._base, max(peak, self._base)
        self.bytes = self.peak - self._base
        return False


def clear_grads(inputs: Inputs) -> None:
    for tensor in inputs.tensors().values():
        tensor.grad = None


def forward_backward(path: BenchPath, inputs: Inputs) -> torch.Tensor:
    """One forward+backward of ``path``; returns the detached loss."""
    loss = path.forward(inputs)
    loss.backward()
    return loss.detach()


def tiny_run(path: BenchPath, inputs: Inputs, seed: int = 0) -> None:
    """One forward+backward of ``path`` on 16 rows x 32 classes of ``inputs``' dtype, device and hidden
    size, half the targets ignored: loads and sets up what a first call needs, at no memory cost."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 32, (16,), generator=gen)
    target[::2] = IGNORE_INDEX
    like = inputs.hidden if inputs.hidden is not None else inputs.logits
    size = like.shape[1] if inputs.hidden is not None else 32
    tiny = {"logits": (16, 32), "hidden": (16, size), "weight": (32, size)}
    made = {name: torch.randn(*tiny[name], generator=gen).to(device=like.device, dtype=like.dtype)
            .requires_grad_(True) for name in path.op.needs}
    forward_backward(path, Inputs(target=target.to(like.device), **made))


def extra_facts(path: BenchPath, inputs: Inputs) -> dict:
    """``path.extra(inputs)`` (facts saved with the row), or ``{"error": ...}``; never raises."""
    try:
        return path.extra(inputs)
    except Exception as exc:  # noqa: BLE001 - a fact we could not get must not lose the measurement
        return {"error": f"{type(exc).__name__}: {exc}"}


def peak_memory(fn: Callable[[], object], device: str) -> tuple[int, str]:
    """(bytes, method): the memory ``fn`` needs beyond what exists when it starts."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, \
            "torch.cuda.max_memory_allocated minus memory_allocated with inputs"
    with CpuPeakMemory() as mem:
        fn()
    return mem.bytes, mem.method


def median_ms(fn: Callable[[], object], reset: Callable[[], None], device: str, repeats: int,
              warmup: int = 1, grad_to_none=None) -> tuple[float, list[float]]:
    """(median ms, every timed ms) of ``fn``; ``reset`` runs before each call, outside the timing."""
    if device == "cuda":
        import triton.testing
        ms = triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median")
        return float(ms), [float(ms)]
    times = []
    for i in range(warmup + repeats):
        reset()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed * 1e3)
    return statistics.median(times), times


def measure(path: BenchPath, inputs: Inputs, device: str, mode: str = "timed", repeats: int = 5,
            warmup: int = 1) -> dict:
    """Parity (always), and for ``mode="timed"`` peak memory and time, of one path on ``inputs``."""
    op = path.op
    if device == "cpu" and op.max_cpu_repeats:
        repeats = min(repeats, op.max_cpu_repeats)
    leaves = {name: getattr(inputs, name) for name in op.leaves}
    result = {"status": "ok", "method": {"what": path.method}}
    run = lambda: forward_backward(path, inputs)  # noqa: E731
    if mode == "timed" and device == "cuda":
        run()  # compile and autotune before anything is measured
        clear_grads(inputs)
    elif mode == "timed":
        tiny_run(path, inputs)
    if mode == "timed":
        box = {}
        result["peak_bytes"], result["method"]["memory"] = peak_memory(
            lambda: box.setdefault("loss", run()), device)
        loss = box["loss"]
    else:
        loss = run()
    result.update(op.parity(inputs, loss, {name: t.grad for name, t in leaves.items()}))
    if mode == "timed":
        result["time_ms"], result["times_ms"] = median_ms(
            run, lambda: clear_grads(inputs), device, repeats, warmup, grad_to_none=list(leaves.values()))
        result["method"]["time"] = time_method(device, repeats, warmup)
        result["floor_bytes"] = op.floor_bytes(inputs)
        result["floor_gbps"] = result["floor_bytes"] / (result["time_ms"] * 1e-3) / 1e9
        result["method"]["floor"] = f"{op.floor_formula} / time"
        if op.gemm_floor is not None and path.name == op.baseline:   # once per shape and dtype
            gemms = op.gemm_floor(inputs)
            result["gemm_floor_ms"] = median_ms(gemms, lambda: None, device, repeats, max(warmup, 1))[0]
            result["method"]["gemm_floor"] = op.gemm_floor_method
            del gemms
    else:
        result["method"]["time"] = "not timed: Triton interpreter (numpy on the CPU); its times mean nothing"
    if path.extra is not None:
        result["extra"] = extra_facts(path, inputs)
    return result


def run_isolated(spec: dict, env: Optional[dict] = None, timeout: Optional[float] = None) -> dict:
    """Run ``spec`` (see ``worker.run_spec``) in a fresh ``python -m fusedce.tools.bench.worker`` process."""
    child_env = {**os.environ, **(env or {})}
    command = [sys.executable, "-m", "fusedce.tools.bench.worker"]
    try:
        done = subprocess.run(command, input=json.dumps(spec), capture_output=True, text=True,
                              env=child_env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "reason": f"timed out after {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    code = done.returncode
    why = "killed (out of memory?)" if code in (-9, 137) else f"exit code {code}"
    return {"status": "error", "reason": f"worker {why}: {' | '.join(tail)}"}
