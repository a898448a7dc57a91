"""The registry of what the bench measures: ops (a loss and its floor) and paths (who computes it).

A path is one ``register(Path(...))`` entry: a forward that returns the scalar loss of an ``Inputs``
(the harness runs the backward). The bench runs every registered path on ``--device``: timed where
``device in path.devices``; on CPU, a path with ``interpreter=True`` gets a parity-only run on a slice of
rows under ``TRITON_INTERPRET=1`` (interpreter times mean nothing).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import parity
from .inputs import IGNORE_INDEX, Inputs


@dataclass(frozen=True)
class Op:
    """What is computed: the inputs it needs, the gradients checked, its byte floor and reference."""

    name: str
    needs: tuple[str, ...]          # ``Inputs`` fields built for it
    leaves: tuple[str, ...]         # ``Inputs`` fields whose gradients are compared
    floor_bytes: Callable[[Inputs], int]
    floor_formula: str
    parity: Callable[[Inputs, torch.Tensor, dict], dict]  # (inputs, loss, {leaf: grad}) -> errors


def _ce_floor_bytes(inputs: Inputs) -> int:
    # Cross-entropy forward + backward on (BT, V) logits moves at least
    #   forward  : read the logits once (online logsumexp and z[target] in one pass)   BT * V * b
    #   backward : read the logits again (softmax = exp(z - lse))                     BT * V * b
    #              write the gradient                                                 BT * V * b
    # = 3 * BT * V * b bytes, b = the logits' element size (the gradient has their dtype). Targets and
    # per-row lse are O(BT) and left out. (A single kernel that writes the gradient during the forward
    # could reach 2 * BT * V * b; the contract's separate forward/backward cannot.)
    rows, vocab = inputs.logits.shape
    return 3 * rows * vocab * inputs.logits.element_size()


def _ce_parity(inputs: Inputs, loss: torch.Tensor, grads: dict) -> dict:
    return parity.cross_entropy(inputs.logits, inputs.target, loss, grads["logits"], IGNORE_INDEX)


CROSS_ENTROPY = Op("cross_entropy", needs=("logits",), leaves=("logits",),
                   floor_bytes=_ce_floor_bytes, floor_formula="3 * BT * V * dtype_bytes",
                   parity=_ce_parity)


@dataclass(frozen=True)
class Path:
    """One way of computing an op. ``name`` is the id in JSON and ``--paths``; ``forward`` returns the
    scalar loss and must leave the backward to the caller."""

    name: str
    label: str
    op: Op
    forward: Callable[[Inputs], torch.Tensor]
    method: str
    devices: tuple[str, ...] = ("cpu", "cuda")
    interpreter: bool = False


PATHS: dict[str, Path] = {}


def register(path: Path) -> Path:
    if path.name in PATHS:
        raise ValueError(f"bench path {path.name!r} is already registered")
    PATHS[path.name] = path
    return path


BASELINE = "torch"  # also run on the interpreter's slice of rows: its error is the yardstick there


def plan(device: str, names=None) -> list[tuple[Path, str]]:
    """``(path, mode)`` for every registered path (or those in ``names``) that runs on ``device``;
    mode is ``"timed"`` or ``"parity"`` (on CPU: Triton interpreter paths on a slice of rows, preceded
    by ``BASELINE`` on the same slice)."""
    unknown = set(names or ()) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown path(s) {sorted(unknown)}; registered: {', '.join(PATHS)}")
    chosen = [PATHS[name] for name in (names or PATHS)]
    runs = [(p, "timed") for p in chosen if device in p.devices]
    interpreted = [p for p in chosen if p.interpreter and "cpu" not in p.devices]
    if device == "cpu" and interpreted:
        runs += [(PATHS[BASELINE], "parity")] + [(p, "parity") for p in interpreted]
    return runs


def _stock(inputs: Inputs) -> torch.Tensor:
    # What a Hugging Face model does today: upcast to fp32, then F.cross_entropy (classes on dim 1).
    return F.cross_entropy(inputs.logits.float(), inputs.target, ignore_index=IGNORE_INDEX)


def _fusedce(backend: str) -> Callable[[Inputs], torch.Tensor]:
    def forward(inputs: Inputs) -> torch.Tensor:
        import fusedce
        return fusedce.cross_entropy(inputs.logits, inputs.target, ignore_index=IGNORE_INDEX,
                                     backend=backend)
    return forward


register(Path("torch", "torch", CROSS_ENTROPY, _stock,
              "F.cross_entropy(logits.float(), target, ignore_index=-100), mean"))
register(Path("fusedce-torch", "fusedce torch", CROSS_ENTROPY, _fusedce("torch"),
              "fusedce.cross_entropy(logits, target, backend='torch'): chunked PyTorch, mean"))
register(Path("fusedce-triton", "fusedce triton", CROSS_ENTROPY, _fusedce("triton"),
              "fusedce.cross_entropy(logits, target, backend='triton'): Triton kernels, mean",
              devices=("cuda",), interpreter=True))
