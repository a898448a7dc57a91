"""``batch_invariant=True`` of the linear ops: every GEMM and row kernel sees one shape whatever the batch.

A row's result can depend on the rest of the batch only through the shapes the kernels see: a GEMM
library picks its blocking (and so the order of each dot product's partial sums) from the matrix
sizes, and torch's CPU reductions split a long row across threads when there are few rows. The chunked
method already computes every row from its own hidden state; what varies with the batch is the number
of rows in a chunk (``chunk_size``, the automatic rule, the last chunk, the rows left after ignored ones
are dropped). So with ``batch_invariant=True`` the rows (after the ignored ones are dropped) are
processed in chunks of exactly ``ROWS`` = 64, the last one padded with zero hidden rows whose target
is ``ignore_index`` (they add nothing, and their outputs are dropped):

- logits: ``(64, H) @ (H, V)`` per chunk (fp32: the weight upcast in blocks of a fixed number of rows,
  ``fp32_linear.weight_block_rows(H, 64, V)``), each logit a dot product over H in the library's order for
  that one shape;
- the row kernels on ``(64, V)`` logits (Triton: one program per row, a fixed ``BLOCK_V`` loop over
  the vocabulary; PyTorch: its row loops on the same shape every chunk);
- the hidden gradient: ``(64, V) @ (V, H)`` per chunk, fp32 over the same weight blocks in order.

Measured on the 2-core CPU VM (loaded), PyTorch backend, one probe row placed in batches of 2 to 200
rows at 12 positions with random and ignored neighbours and several chunk sizes: without the flag its
fp32 bits changed in 11 of 12 placements (H = 256, V = 4099, fp32) and 10 of 12 (H = 64, V = 301, bf16);
with it in 0 of 12 (also H = 1024, V = 8192, fp32; and the Triton backend, bf16). Cost (BT = 256,
H = 576, V = 49152, bf16, fwd+bwd of ``linear_cross_entropy``): 5.5 s against 4.2 s without the flag
(x1.3: four 64-row chunks instead of two of 144, each re-reading the weight), noisy under the load.

The reduction order of a row is therefore that of those fixed shapes; an inference engine reproduces
it by computing the same ``(64, H) x (H, V)`` GEMM (same library, thread count and dtype). The weight
and bias gradients are sums over rows, so they depend on the batch by definition: exempt. Cost: the
padded rows of the last chunk (at most 63 rows of work) and 64-row GEMMs (a GPU would prefer larger
ones); one copy of the kept rows when padding is needed. A ``(..., K)`` target, probability targets and
the CuTe backend are refused (``refuse``, ``check_backend``).

``method="tiled"`` needs no chunks: its tiles are fixed per backend and never depend on BT, and each
row meets the vocabulary tiles in order. What could still vary is the height of the last token tile,
a row's place in its tile and, on Triton, the order of the hidden gradient's atomic sums. So with the
flag (passed to the backend: ``TiledCE.forward`` / ``backward``, the tiled distillation op) the kept
rows are padded to a multiple of the backend's token tile (``TiledCE.invariant_rows``), whose rows are a
multiple of 64: PyTorch: ``tuning.tile_sizes(V, True)``, 128 x 256 at V = 49152 (191 x 256 without the
flag; ATen's elementwise loops compute a block's last ``numel % (2 x vector width)`` values (up to 31 with
AVX-512) with scalar code, whose exp / log round differently from the vector code: measured, a probe in the
last row of 9-row tiles changed its bits); Triton: 64 (``BLOCK_N``; its kernels mask a partial tile's rows and compute each row's dots
from its own hidden state, so the padding only fills the last tile and keeps the torch ops around the
kernels in whole vectors on a CPU). The backward runs without atomics (Triton: the ``deterministic``
kernels, whose grad_hidden program owns its rows and walks the vocabulary tiles in order; PyTorch: no
atomics anyway, the vocabulary blocks shared among a number of threads set by the thread count and V
alone). Cost: docs/contract.md (``batch_invariant``).

The logits ops (``cross_entropy``, ``token_log_probs``) need no padding: the Triton row kernels run one
program per row with a ``BLOCK_V`` chosen from V alone, and the PyTorch row loops reduce each row whole
on one thread (their blocks run on threads with one intra-op thread each: ``backends/pytorch/launch.for_row_blocks``),
so ``batch_invariant=True`` there only checks that the call is one of those.
"""
from __future__ import annotations

from typing import Optional

import torch

ROWS = 64   # rows per chunk: small enough that padding costs little (module docstring, "Cost")


def check(batch_invariant) -> bool:
    """``batch_invariant`` checked: ``TypeError`` unless a bool (every method takes it). Returns it."""
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {batch_invariant!r}")
    return batch_invariant


def check_backend(batch_invariant: bool, impl) -> None:
    """``ValueError`` for ``batch_invariant=True`` on a backend other than "torch" / "triton" (the CuTe
    kernels have not been checked for it)."""
    if batch_invariant and getattr(impl, "NAME", None) not in ("torch", "triton"):
        raise ValueError(f"batch_invariant=True is provided by the 'torch' and 'triton' backends, not "
                         f"{getattr(impl, 'NAME', impl)!r}")


def refuse(batch_invariant: bool, what: str) -> None:
    """``ValueError`` for ``batch_invariant=True`` together with ``what`` (an input it does not support)."""
    if batch_invariant:
        raise ValueError(f"batch_invariant=True does not support {what}")


def pad_rows(hidden: torch.Tensor, target: torch.Tensor, ignore_index: int,
             extra: Optional[torch.Tensor] = None, rows: int = ROWS):
    """``(hidden, target, extra)`` padded to a multiple of ``rows`` rows (the head's ``invariant_rows``:
    ``ROWS`` for the chunk loop, the token tile for the tiled method): zero hidden rows (differentiable:
    the gradient of the real rows flows back through the concatenation), ``ignore_index`` targets and
    zero ``extra`` rows (per-row weights, or None). The inputs themselves when no padding is needed (under
    torch.compile the padding is always concatenated, possibly 0 rows: a traced ``pad == 0`` would specialize
    the graph on the token count)."""
    n = hidden.shape[0]
    pad = -n % rows
    if not torch.compiler.is_compiling() and pad == 0:
        return hidden, target, extra
    F = torch.nn.functional
    hidden = F.pad(hidden, (0, 0, 0, pad))
    target = F.pad(target, (0, 0) * (target.dim() - 1) + (0, pad), value=ignore_index)
    if extra is not None:
        extra = F.pad(extra, (0, pad))
    return hidden, target, extra
