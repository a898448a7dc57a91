"""Rows per chunk of the chunked LM head when ``chunk_size=None`` (``chunk_rows``), one place.

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
- Under ``torch.compile`` the chunk loops run inside custom ops (``loop_ops.py``, ``soft_loop.py``,
  ``distill/chunk_op.py``, ``rl/multi_ops.py``), where the rule sees the real token count and is not compiling:
  the same rows as eager. A caller that traces a loop itself (none of the linear ops now) would call it while
  compiling: every device then takes the GPU rule (fewer, larger chunks keep a traced graph small).
"""
from __future__ import annotations

import torch

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
