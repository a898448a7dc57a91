"""Where each rank's vocabulary slice sits: one small ``all_gather`` per call."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from fusedce.core import validation as val
from fusedce.core.validation import values_unavailable


@dataclass(frozen=True)
class VocabLayout:
    """This rank's slice ``[start, start + size)`` of a global vocabulary of ``n_classes`` classes."""

    start: int
    size: int
    n_classes: int
    group: Any  # the process group (None = the default group)

    @property
    def end(self) -> int:
        return self.start + self.size


def _describe(pairs) -> str:
    return ", ".join(f"rank {r}: [{s}, {s + n})" for r, (s, n) in enumerate(pairs))


def _gather(mine: list, world: int, group, device: torch.device, flag=None) -> list:
    row = torch.tensor(mine, dtype=torch.int64, device=device)
    if isinstance(flag, torch.Tensor):   # the probability check's flag, a device tensor: no sync here
        row[3] = flag.to(device=device, dtype=torch.int64)
    table = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(table, row, group=group)
    return torch.stack(table).tolist()  # the setup's one host sync


def vocab_layout(shard_size: int, vocab_start_index: Optional[int], group,
                 device: torch.device, probabilities: Optional[torch.Tensor] = None,
                 same: Optional[dict] = None) -> VocabLayout:
    """Gather every rank's ``(start, size)`` (and ``same``: ``{what: int}`` every rank must pass equal) and check
    that the slices tile ``[0, V)``."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed."
                           "init_process_group first (gloo for CPU tensors, nccl for CUDA tensors)")
    world = dist.get_world_size(group)
    given = vocab_start_index is not None
    mine = [int(given), int(vocab_start_index) if given else 0, int(shard_size)]
    flag = None
    if probabilities is not None:
        mine.append(0)
        flag = val.bad_probabilities(probabilities)
    base = len(mine)
    mine.extend(int(v) for v in (same or {}).values())
    if not (values_unavailable() or device.type == "meta"):
        rows = _gather(mine, world, group, device, flag)
    elif world == 1:   # tracing (fake / meta tensors, make_fx, export) on one rank: nothing to exchange
        rows = [mine]
    else:   # tracing: the table is host integers of the set-up, exchanged with real tensors outside the trace
        with _disable_current_modes():
            rows = _gather(mine, world, group, torch.device("cpu") if device.type == "meta" else device)
    flags = {r[0] for r in rows}
    if len(flags) != 1:
        raise ValueError("vocab_start_index must be given on every rank or on none; given on ranks "
                         f"{[i for i, r in enumerate(rows) if r[0]]} of {world}")
    if same and len({tuple(r[base:]) for r in rows}) != 1:
        raise ValueError(f"{', '.join(same)} must be the same on every rank (every rank passes the same tokens); "
                         "got " + "; ".join(f"rank {i}: {tuple(r[base:])}" for i, r in enumerate(rows)))
    sizes = [r[2] for r in rows]
    if given:
        starts = [r[1] for r in rows]
    else:
        starts = [sum(sizes[:i]) for i in range(world)]
    pairs = list(zip(starts, sizes))
    n_classes = sum(sizes)
    if n_classes == 0:
        raise ValueError(f"V = 0: every rank's vocabulary slice is empty ({world} ranks); the global "
                         "number of classes must be > 0 (one rank's slice may be empty)")
    expected = 0
    for start, size in sorted(p for p in pairs if p[1] > 0):  # an empty slice sits anywhere
        if start != expected:
            raise ValueError("the vocabulary slices must tile [0, V) without gaps or overlaps; got "
                             + _describe(pairs))
        expected = start + size
    rank = dist.get_rank(group)
    if probabilities is not None and any(r[3] for r in rows):
        ranks = [i for i, r in enumerate(rows) if r[3]]
        if rank in ranks:   # this rank's slice: the position within it
            try:
                val.raise_bad_probabilities(probabilities)
            except ValueError as error:
                raise ValueError(f"{error} (rank {rank}'s slice of the vocabulary: the last index is local)") from None
        raise ValueError(f"target (the probabilities) holds a negative, NaN or +inf value on rank(s) {ranks} "
                         f"of {world} (that rank's error names the position): probabilities must be >= 0 and not "
                         "NaN or +inf")
    return VocabLayout(start=starts[rank], size=sizes[rank], n_classes=n_classes, group=group)
