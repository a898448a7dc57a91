"""Ignored rows cost no matmul FLOPs: the linear ops keep only the non-ignored rows before the LM head
(``compact_rows``) and put the per-row results back in place afterwards (``scatter_rows``); the
vocab-parallel linear op does the same."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.validation import sync_allowed


def compact_rows(hidden: torch.Tensor, target: torch.Tensor, ignore_index: int):
    """``(hidden, target, index)``: the non-ignored rows and their positions, or the inputs and None
    when no row is ignored, under torch.compile / CUDA-graph capture (no host sync allowed), with fake or
    meta tensors or under make_fx / export tracing (no values to count), or for an
    empty batch. The one documented host sync of the linear ops (the count of kept rows)."""
    if hidden.shape[0] == 0 or not sync_allowed(hidden, target):
        return hidden, target, None
    index = (target != ignore_index).nonzero().squeeze(1)
    if index.shape[0] == hidden.shape[0]:
        return hidden, target, None
    return hidden.index_select(0, index), target.index_select(0, index), index


def scatter_rows(values: torch.Tensor, index: Optional[torch.Tensor], n: int, fill) -> torch.Tensor:
    """``values`` (n', ...) of the kept rows back at their positions ``index`` in a new (n,) tensor filled
    with ``fill`` elsewhere (ignored rows); ``values`` itself when nothing was compacted (index None)."""
    if index is None:
        return values
    out = torch.full((n,), fill, dtype=values.dtype, device=values.device)
    return out.index_copy(0, index, values)
