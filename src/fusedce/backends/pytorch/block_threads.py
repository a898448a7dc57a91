"""Threads for the PyTorch backend's loops of small blocks (``tiled.py``), and why."""
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
    """Call ``work(k, n)`` for ``k`` in ``range(n)`` on ``n = min(torch.get_num_threads(), n_items)`` threads (at least
    1; ``k = 0`` in the calling thread), each with one intra-op thread, grad mode off and the caller's inference
    mode; returns the ``n`` results in order."""
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
