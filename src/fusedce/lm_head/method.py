"""The method of the LM head (``METHODS``, ``check_method``, ``resolve_method``), the head object for it
(``make_head``) and the chunk size of ``method="chunked"``: one place.

The rule for ``chunk_size=None`` (``chunk_rows``) lives in ``chunk_rule.py``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .chunk_rule import CPU_H_FRACTION, CPU_MIN_ROWS, MIN_ROWS, chunk_rows  # noqa: F401 (re-exported)
from .heads import ChunkedHead, TiledHead
from ..backends.protocol import ChunkCE, TiledCE

def resolve_method(method: str) -> str:
    """``"auto"`` -> ``"chunked"``, on every device: the tiled method trades memory for time (on an H100,
    BT x H x V = 8192 x 4096 x 128256 bf16: chunked 42 ms, tiled 687 ms fwd+bwd; ``benchmarks/README.md``).
    Names are checked by ``check_method``."""
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
              device_type: str = "cuda", logits: str = "float32", batch_invariant: bool = False):
    """The ``heads.py`` object for ``method`` ("auto" resolved by ``resolve_method``).
    ``deterministic`` selects the tiled backward without float atomics; the chunk loop has none (its
    kernels own their outputs, its matmuls are torch's), so it is deterministic anyway. ``device_type``
    picks the chunk rule (``chunk_rows``); ``logits`` the logits' dtype (``chunked.logits_dtype``).
    ``batch_invariant``: the tiled backend's fixed tiles and a backward without atomics (``invariant.py``);
    the caller pads the rows to ``head.invariant_rows(V)`` (and passes ``chunk_size=invariant.ROWS``)."""
    if resolve_method(method) == "tiled":
        if tiled is None:
            raise RuntimeError("this backend has no method='tiled' (no TiledCE); use method='chunked'")
        return TiledHead(tiled, deterministic, getattr(ce, "NAME", ""), batch_invariant)
    return ChunkedHead(ce, chunk_size, logits)   # rows decided inside the loop's op (loop_ops.py)


def head_spec(head) -> tuple:
    """``(backend, tiled, chunk_size, deterministic, logits)``: constants from which ``rebuild_head`` makes the
    same head again (inside a custom op's body, ``rl/multi_ops.py``); ``chunk_size`` 0 for the rule."""
    if isinstance(head, TiledHead):
        return head.backend, True, 0, head.deterministic, "float32"
    return head.ce.NAME, False, head.chunk_size or 0, False, head.logits


def rebuild_head(backend: str, tiled: bool, chunk_size: int, deterministic: bool, logits: str,
                 device: torch.device):
    """The head ``head_spec`` describes, with the backend's ``CHUNK_CE`` / ``TILED_CE``."""
    from fusedce import backends
    impl = backends.get(backend, device, tiled=tiled)
    return make_head(impl.CHUNK_CE, impl.TILED_CE, "tiled" if tiled else "chunked", 0, 0, 0, chunk_size or None,
                     deterministic, device.type, logits)
