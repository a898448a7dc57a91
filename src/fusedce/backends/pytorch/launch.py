"""The PyTorch backend's row loops (blocks of rows on threads, ``run``) and chunked cross-entropy on them."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional

import torch

from fusedce.core.options import LossOptions
from fusedce.core.row_math import rows_forward, rows_grad
from .fused_rows import rows_loss_grad_
from .tuning import chunk_rows, cpu_block_rows


_LOCK = threading.Lock()


def add_shares(total: Optional[torch.Tensor], shares: List) -> Optional[torch.Tensor]:
    """``total`` (share 0's partial sum) plus every other share's, in share order: deterministic."""
    for part in shares[1:]:
        if part is not None:
            total += part
    return total


def _no_grad(work: Callable, k: int, n: int, inference: bool = False):
    """``work(k, n)`` with grad mode off and the caller's inference mode (both per thread)."""
    with torch.inference_mode(inference), torch.no_grad():
        return work(k, n)


def run(work: Callable[[int, int], object], n_items: int, device: torch.device) -> List[object]:
    """``work(k, n)`` for ``k`` in ``range(n)`` on ``n`` threads (``k = 0`` the caller's), each with one intra-op
    thread; returns the results in order."""
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


def class_weights(weight: Optional[torch.Tensor]):
    """(fp32 weights, their sum as a device tensor), or (None, None)."""
    if weight is None:
        return None, None
    w = weight.float()
    return w, w.sum()


class Scratch:
    """fp32 row-chunk buffers reused by every chunk of a call (on CPU fresh large tensors cost page faults)."""

    def __init__(self, step: int, n_classes: int, dtype: torch.dtype, device: torch.device, work: bool = True):
        shape = (step, n_classes)
        self._x = None if dtype == torch.float32 else torch.empty(shape, device=device)
        self._work = torch.empty(shape, device=device) if work else None

    def upcast(self, block: torch.Tensor) -> torch.Tensor:
        return block if self._x is None else self._x[: block.shape[0]].copy_(block)

    def work(self, n: int):
        return None if self._work is None else self._work[:n]


def block_rows(logits: torch.Tensor) -> int:
    """Rows per block of ``logits``: cache-sized on the CPU, ``tuning.chunk_rows`` elsewhere; in ``[1, n]``."""
    n_rows, n_classes = logits.shape
    rows = cpu_block_rows(n_classes) if logits.device.type == "cpu" else chunk_rows(n_classes)
    return min(rows, max(n_rows, 1))


def for_row_blocks(logits: torch.Tensor, each, work: bool = True) -> None:
    """``each(rows, block, work)`` for every row block of ``logits``: the slice, its fp32 rows and an fp32 work
    buffer (None unless ``work``)."""
    n_rows, n_classes = logits.shape
    step = block_rows(logits)
    n_blocks = -(-n_rows // step)

    def share(k: int, n: int) -> None:
        scratch = Scratch(step, n_classes, logits.dtype, logits.device, work=work)
        for b in range(k, n_blocks, n):
            rows = slice(b * step, b * step + step)
            block = scratch.upcast(logits[rows])
            each(rows, block, scratch.work(block.shape[0]))

    run(share, n_blocks, logits.device)


def grad_chunks_(logits: torch.Tensor, out: torch.Tensor, row_grad) -> torch.Tensor:
    """``out[rows] = row_grad(rows, block, buf)`` for each row block of ``logits``; returns ``out`` (may be
    ``logits``)."""
    fp32_out = out.dtype == torch.float32

    def each(rows, block, work):
        dst = out[rows]
        grad = row_grad(rows, block, dst if fp32_out else work)
        if grad is not dst:
            dst.copy_(grad)

    for_row_blocks(logits, each, work=not fp32_out)
    return out


def chunk_loss(logits, target, w, weight_sum, opts: LossOptions, stats: bool = True, entropy: bool = False):
    """Per-row ``(loss, lse, lse_lo, predicted[, entropy])`` of ``logits``, no gradient (predicted None without
    stats)."""
    n_rows = logits.shape[0]
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse, lse_lo = torch.empty_like(loss), torch.empty_like(loss)
    ent = torch.empty_like(loss) if entropy else None
    predicted = torch.empty(n_rows, dtype=torch.int64, device=logits.device) if stats else None
    def each(rows, block, work):
        out = rows_forward(block, target[rows], w, weight_sum, opts, stats, work, entropy)
        loss[rows], lse[rows], lse_lo[rows] = out[:3]
        if stats:
            predicted[rows] = out[3]
        if entropy:
            ent[rows] = out[4]

    for_row_blocks(logits, each)
    if entropy:
        return loss, lse, lse_lo, predicted, ent
    return loss, lse, lse_lo, predicted


def chunk_grad_(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, opts: LossOptions,
                out=None, grad_entropy=None, entropy=None) -> torch.Tensor:
    """Write d(sum_i grad_row[i] loss_i + grad_lse[i] lse_i + grad_entropy[i] entropy_i)/d logits into ``out``."""
    def row_grad(rows, block, buf):
        return rows_grad(block, target[rows], w, weight_sum, lse[rows], lse_lo[rows], grad_row[rows],
                         None if grad_lse is None else grad_lse[rows], opts, out=buf,
                         grad_entropy=None if grad_entropy is None else grad_entropy[rows],
                         entropy=None if grad_entropy is None else entropy[rows])

    return grad_chunks_(logits, logits if out is None else out, row_grad)


def chunk_loss_grad_(logits, target, w, weight_sum, grad_row, z_grad_row, opts: LossOptions, stats: bool):
    """This backend's ``ChunkCE.loss_and_grad_`` (see ``protocol.loss_then_grad_``), one pass per block."""
    n_rows = logits.shape[0]
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse, lse_lo = torch.empty_like(loss), torch.empty_like(loss)
    predicted = torch.empty(n_rows, dtype=torch.int64, device=logits.device) if stats else None
    token_weight = torch.empty_like(loss) if opts.use_token_scaling else None
    upcast = logits.dtype != torch.float32

    def each(rows, block, _work):
        res = rows_loss_grad_(block, target[rows], w, weight_sum, grad_row[rows], z_grad_row[rows], opts, stats)
        loss[rows], lse[rows], lse_lo[rows] = res[:3]
        if stats:
            predicted[rows] = res[3]
        if token_weight is not None:
            token_weight[rows] = res[4]
        if upcast:   # the block was an fp32 copy: its gradient back into the caller's dtype
            logits[rows].copy_(res[5])

    for_row_blocks(logits, each, work=False)
    return loss, lse, lse_lo, predicted, token_weight
