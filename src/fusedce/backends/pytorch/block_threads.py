"""Threads for the PyTorch backend's loops of small blocks (``tiled.py``), and why.

The tiled method works on blocks of fewer than V logits (191 x 256 at V = 49152): about 30 ATen ops per
block, ~4200 blocks per forward and as many per backward at BT = 4096. With the default intra-op pool
(OpenMP, one thread per core) each op on a block of more than 32768 elements, and each matmul, is a
parallel region that ends at a barrier where every pool thread must have run its share. On idle cores a
region costs microseconds; when another process competes for the cores, the thread that finished first
waits at the barrier for its partner to be scheduled again, a scheduler time slice (milliseconds) per
op: the same call took 7.6 s quiet and 24-391 s on a 2-core machine at load ~4 (at load ~12, BT = 1024:
137 s with 2 intra-op threads, 20 s with 1). The chunked method runs ~100 times fewer, larger ops, so
it only slows down in proportion to the cores it loses.

So the block loops run here instead on ``n`` Python threads (``n`` = the intra-op thread count the
caller set, ``torch.get_num_threads()``, at most one per independent share of the work) that each run
their ops with ONE intra-op thread: no barrier per op; torch ops release the GIL while they compute,
and the threads are joined once per loop. A competing process then slows a thread down as it slows
a single-threaded program, without stalling the others.

``torch.set_num_threads`` is process-wide: while a loop runs, the intra-op pool is set to 1 thread
(restored afterwards, also on an exception); loops from several threads run one at a time.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List

import torch

_LOCK = threading.Lock()


def _no_grad(work: Callable, k: int, n: int, inference: bool = False):
    """``work(k, n)`` with grad mode off and the caller's inference mode (both are per thread: the block
    ops must never record a graph, and under ``torch.inference_mode`` they write into inference tensors,
    which only code in inference mode may update in place)."""
    with torch.inference_mode(inference), torch.no_grad():
        return work(k, n)


def run(work: Callable[[int, int], object], n_items: int, device: torch.device) -> List[object]:
    """Call ``work(k, n)`` for ``k`` in ``range(n)`` on ``n = min(torch.get_num_threads(), n_items)``
    threads (at least 1; ``k = 0`` in the calling thread), each with one intra-op thread, grad mode off
    and the caller's inference mode; returns the ``n`` results in order. ``work(k, n)`` must touch only
    its own share of the outputs (e.g. items ``k, k + n, ...``); an exception in any share is re-raised
    here. On a device
    other than the CPU ``work(0, 1)`` runs in the calling thread as it is (its current stream is per
    thread)."""
    if device.type != "cpu":
        return [_no_grad(work, 0, 1, torch.is_inference_mode_enabled())]
    inference = torch.is_inference_mode_enabled()
    with _LOCK:
        threads = torch.get_num_threads()
        n = max(1, min(threads, n_items))
        torch.set_num_threads(1)
        try:
            if n == 1:
                return [_no_grad(work, 0, 1, inference)]
            with ThreadPoolExecutor(n - 1, thread_name_prefix="fusedce-blocks") as pool:
                others = [pool.submit(_no_grad, work, k, n, inference) for k in range(1, n)]
                first = _no_grad(work, 0, n, inference)
                return [first] + [f.result() for f in others]
        finally:
            torch.set_num_threads(threads)
