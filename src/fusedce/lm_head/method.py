"""The method of the LM head (``METHODS``, ``check_method``, ``resolve_method``), the head object for it
(``make_head``) and the chunk size of ``method="chunked"``: one place.

Rule for ``chunk_size=None``, per device type (``chunk_rows``):

- GPUs (and any device but the CPU): the chunk's logits (rows x V in hidden's dtype) may be as large as
  the hidden states of the whole batch (BT x H, which the caller holds anyway), i.e. ``rows = BT * H / V``,
  so the loss adds at most one hidden-sized buffer; but never fewer than ``MIN_ROWS`` rows, because short
  chunks under-fill the matmuls and each chunk re-reads and re-writes the V x H weight-gradient
  accumulator. Not yet timed on a GPU (``benchmarks/gpu_check.sh`` times the result).
- CPU: ``rows = max(CPU_MIN_ROWS, ceil(H / CPU_H_FRACTION))``, whatever BT and V. The idea is PyTorch's
  (``F.linear_cross_entropy``'s ``chunking_method="aspect_ratio"``: size the chunk from the problem's
  shape, not from a fixed row floor): the loss's own memory is the weight and hidden gradients it returns,
  ``(V + BT) x H x 4`` bytes, and a chunk of ``rows x V`` logits (plus as much again in fp32 temporaries)
  adds about ``2 rows / H`` of that, a quarter with ``rows = H / 4``. Speed does not need more: per chunk
  the update ``grad_W += g_c.T @ h_c`` moves 2 x V x H x 4 bytes of accumulator against 6 x rows x V x H
  FLOPs for the chunk's three matmuls, 0.75 x rows FLOP per byte, 48 at 64 rows, compute-bound on a CPU.
  Measured on the 2-core x86-64 dev VM under load from other jobs (real SmolLM2 input, BT = 4096 with
  2864 scored, H = 576, V = 49152, fp32, fwd+bwd, peak RSS beyond the inputs and their .grad buffers,
  ``fusedce bench``'s sweep method): 1024 rows (the GPU rule) 384 MiB, 256 rows 225 MiB, 128 rows 178 MiB,
  PyTorch's ``F.linear_cross_entropy`` (32-row chunks) 243 MiB; the process CPU time of 128-1024 rows
  within 20 % (20-24 s for one warm-up and two fwd+bwd, against 55 s for PyTorch's). With this rule (144
  rows there), ``fusedce bench``'s real-input row: 184 MiB (harness method, .grad included); forward+backward
  in rotation with the peers in one process: 8.1-8.7 s, PyTorch's 20.9-22.0 s, TRL's 11.9-12.5 s (README,
  "Measured").
- Under ``torch.compile`` every device takes the GPU rule: Dynamo traces the chunk loop (one copy of the
  chunk's ops per chunk; the PyTorch backend's per-chunk work is one custom op each, ``backends/pytorch/
  custom_ops.py``), so fewer, larger chunks keep the graph and the compile time small (at 600 tokens, H =
  16: 1 chunk instead of 10; the compile time over the eager call is pinned by ``tests/ce/test_compile_loops.py``).
"""
from __future__ import annotations

from typing import Optional

import torch

from .heads import ChunkedHead, TiledHead
from ..backends.protocol import ChunkCE, TiledCE

MIN_ROWS = 1024
CPU_MIN_ROWS = 64
CPU_H_FRACTION = 4


def chunk_rows(n_rows: int, hidden_size: int, vocab_size: int, device_type: str = "cuda") -> int:
    """Rows per chunk for ``chunk_size=None`` on a ``device_type`` device ("cpu", "cuda", ...): at least 1,
    at most ``n_rows`` (the rule in the module docstring)."""
    if device_type == "cpu" and not torch.compiler.is_compiling():
        rows = max(CPU_MIN_ROWS, -(-hidden_size // CPU_H_FRACTION))
    else:
        rows = max(MIN_ROWS, -(-n_rows * hidden_size // max(vocab_size, 1)))
    return max(1, min(n_rows, rows))


def resolve_method(method: str) -> str:
    """``"auto"`` -> ``"chunked"``, on every device, until GPU measurements say otherwise: the tiled
    method trades one more matmul per token (4 instead of 3: its backward recomputes the logits) for
    O(BT + tiles) memory, and no GPU timing of the two exists yet (the CPU sweep of ``fusedce bench``
    has both; ``benchmarks/gpu_check.sh`` times both on its GPU shapes). Names are checked by
    ``check_method``."""
    return "chunked" if method == "auto" else method


METHODS = ("auto", "chunked", "tiled")


def check_method(method, chunk_size) -> None:
    """``ValueError`` for a ``method`` not in ``METHODS`` and for a ``chunk_size`` with ``"tiled"``
    (which has no chunks; its tile sizes are the backend's)."""
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "tiled" and chunk_size is not None:
        raise ValueError(f"chunk_size applies to method='chunked'; with method='tiled' it must be None, "
                         f"got {chunk_size!r}")


LOGITS_DTYPES = ("float32", "input")


def check_logits_dtype(logits_dtype, method: str = "auto") -> str:
    """``ValueError`` unless ``logits_dtype`` is one of ``LOGITS_DTYPES`` (``"float32"``: fp32 logits from
    the operands' values, the default; ``"input"``: rounded to the operands' dtype, the stock
    composition's ``F.linear``), and for ``"input"`` with ``method="tiled"`` (its tiles form fp32 logits:
    the opt-out would be silently ignored); returns it."""
    if not isinstance(logits_dtype, str) or logits_dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits_dtype must be one of {LOGITS_DTYPES} (\"input\": the logits rounded to "
                         f"hidden's dtype, as F.linear), got {logits_dtype!r}")
    if logits_dtype == "input" and resolve_method(method) == "tiled":
        raise ValueError("logits_dtype='input' (F.linear's rounding, for stock parity) applies to "
                         "method='chunked': method='tiled' forms its logits tile by tile in fp32; use "
                         "method='chunked', or the default logits_dtype='float32'")
    return logits_dtype


def make_head(ce: ChunkCE, tiled: Optional[TiledCE], method: str, n_rows: int, hidden_size: int,
              vocab_size: int, chunk_size: Optional[int], deterministic: bool = False,
              device_type: str = "cuda", logits: str = "float32"):
    """The ``heads.py`` object for ``method`` ("auto" resolved by ``resolve_method``).
    ``deterministic`` selects the tiled backward without float atomics; the chunk loop has none (its
    kernels own their outputs, its matmuls are torch's), so it is deterministic anyway. ``device_type``
    picks the chunk rule (``chunk_rows``); ``logits`` the logits' dtype (``chunked.logits_dtype``)."""
    if resolve_method(method) == "tiled":
        if tiled is None:
            raise RuntimeError("this backend has no method='tiled' (no TiledCE); use method='chunked'")
        return TiledHead(tiled, deterministic)
    return ChunkedHead(ce, chunk_size or chunk_rows(n_rows, hidden_size, vocab_size, device_type), logits)
