"""Chunked cross-entropy in PyTorch: forward saves only the per-row lse, backward recomputes.

Memory: the stock path keeps an fp32 softmax (BT x V) for backward and builds fp32 temporaries of the
same size; this one holds fp32 temporaries of one chunk of rows (``tuning.chunk_rows``) at a time and
writes the gradient straight into its output (or into ``logits`` with ``inplace_backward``).
The two loops here (``chunk_loss``, ``chunk_grad_``) are called as torch custom ops (``custom_ops.py``)
by the autograd Function (``cross_entropy.py``) and by the chunk loop of the linear ops.
"""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.options import LossOptions
from fusedce.core.row_math import rows_forward, rows_grad
from .block_threads import one_thread
from .tuning import chunk_rows


def class_weights(weight: Optional[torch.Tensor]):
    """(fp32 weights, their sum as a device tensor), or (None, None)."""
    if weight is None:
        return None, None
    w = weight.float()
    return w, w.sum()


class Scratch:
    """fp32 row-chunk buffers reused by every chunk of one call: on CPU a fresh 64 MiB tensor per chunk
    costs more in page faults than the arithmetic on it (measured on the 2-core dev machine: allocating
    and filling 341 x 49152 fp32 took 26 ms, copying into a reused buffer 2 ms), since the allocator
    returns such blocks to the OS. ``upcast(block)``: the block in fp32 (itself when already fp32);
    ``work(n)``: a second fp32 (n, V) buffer."""

    def __init__(self, step: int, n_classes: int, dtype: torch.dtype, device: torch.device):
        shape = (step, n_classes)
        self._x = None if dtype == torch.float32 else torch.empty(shape, device=device)
        self._work = torch.empty(shape, device=device)

    def upcast(self, block: torch.Tensor) -> torch.Tensor:
        return block if self._x is None else self._x[: block.shape[0]].copy_(block)

    def work(self, n: int) -> torch.Tensor:
        return self._work[:n]


def row_chunks(logits: torch.Tensor):
    """Yield ``(rows, block, work)`` for each row chunk of ``logits`` ((n, V), ``tuning.chunk_rows`` rows a
    chunk): ``rows`` the chunk's slice, ``block`` its rows in fp32 (a reused buffer unless ``logits`` is
    fp32), ``work`` a second fp32 buffer of ``block``'s shape (``Scratch``). The loops of every forward here."""
    n_rows, n_classes = logits.shape
    step = min(chunk_rows(n_classes), max(n_rows, 1))
    scratch = Scratch(step, n_classes, logits.dtype, logits.device)
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        with one_thread(_single_row(logits, start, step)):
            block = scratch.upcast(logits[rows])
            yield rows, block, scratch.work(block.shape[0])


def _single_row(logits: torch.Tensor, start: int, step: int) -> bool:
    """Whether the chunk from ``start`` is a single row on the CPU: reduced on one intra-op thread then
    (``block_threads.one_thread``: the same bits as each row of a larger chunk gets)."""
    return logits.device.type == "cpu" and min(step, logits.shape[0] - start) == 1


def grad_chunks_(logits: torch.Tensor, out: torch.Tensor, row_grad) -> torch.Tensor:
    """``out[rows] = row_grad(rows, block, buf)`` for each row chunk of ``logits`` ((n, V)), returning
    ``out`` ((n, V), may be ``logits``): ``block`` the chunk in fp32, ``buf`` where ``row_grad`` may write
    its fp32 result (``out[rows]`` itself when ``out`` is fp32: no (n, V) temporary, else a reused chunk
    buffer converted into ``out`` once per chunk). The loops of every backward here."""
    n_rows, n_classes = logits.shape
    step = min(chunk_rows(n_classes), max(n_rows, 1))
    scratch = None if out.dtype == torch.float32 else Scratch(step, n_classes, logits.dtype, logits.device)
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        dst = out[rows]
        with one_thread(_single_row(logits, start, step)):
            block = logits[rows] if scratch is None else scratch.upcast(logits[rows])
            grad = row_grad(rows, block, dst if scratch is None else scratch.work(dst.shape[0]))
            if grad is not dst:
                dst.copy_(grad)
    return out


def chunk_loss(logits, target, w, weight_sum, opts: LossOptions, stats: bool = True, entropy: bool = False):
    """Per-row ``(loss, lse, lse_lo, predicted)`` of ``logits`` ((n, V)), no gradient: fp32 (n,) each
    (cross-entropy without z-loss; lse as the pair lse + lse_lo, see ``core/row_math.py``), predicted (n,) int64
    or None without stats; with ``entropy`` a fifth element, the entropy (n,) fp32."""
    n_rows = logits.shape[0]
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse, lse_lo = torch.empty_like(loss), torch.empty_like(loss)
    ent = torch.empty_like(loss) if entropy else None
    predicted = torch.empty(n_rows, dtype=torch.int64, device=logits.device) if stats else None
    for rows, block, work in row_chunks(logits):
        out = rows_forward(block, target[rows], w, weight_sum, opts, stats, work, entropy)
        loss[rows], lse[rows], lse_lo[rows] = out[:3]
        if stats:
            predicted[rows] = out[3]
        if entropy:
            ent[rows] = out[4]
    if entropy:
        return loss, lse, lse_lo, predicted, ent
    return loss, lse, lse_lo, predicted


def chunk_grad_(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, opts: LossOptions,
                out=None, grad_entropy=None, entropy=None) -> torch.Tensor:
    """Write d(sum_i grad_row[i] loss_i + grad_lse[i] lse_i + grad_entropy[i] entropy_i)/d logits into
    ``out`` (default: ``logits`` itself). ``grad_lse`` / ``grad_entropy`` None mean 0; ``entropy`` is
    the forward's, read only with ``grad_entropy``.

    fp32 ``out``: the gradient is computed in it, no (n, V) temporary besides softcap's; other dtypes
    go through two reused fp32 chunk buffers (``Scratch``) and one conversion pass per chunk.
    """
    def row_grad(rows, block, buf):
        return rows_grad(block, target[rows], w, weight_sum, lse[rows], lse_lo[rows], grad_row[rows],
                         None if grad_lse is None else grad_lse[rows], opts, out=buf,
                         grad_entropy=None if grad_entropy is None else grad_entropy[rows],
                         entropy=None if grad_entropy is None else entropy[rows])

    return grad_chunks_(logits, logits if out is None else out, row_grad)
