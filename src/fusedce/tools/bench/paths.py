"""The registry of what the bench measures: ops (a loss and its floor) and paths (who computes it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import parity, peers
from .inputs import IGNORE_INDEX, Inputs
from .names import path_name


@dataclass(frozen=True)
class Op:
    """What is computed: the inputs it needs, the gradients checked, its byte floor and reference."""

    name: str
    needs: tuple[str, ...]          # ``Inputs`` fields built for it
    leaves: tuple[str, ...]         # ``Inputs`` fields whose gradients are compared
    floor_bytes: Callable[[Inputs], int]
    floor_formula: str
    parity: Callable[[Inputs, torch.Tensor, dict], dict]  # (inputs, loss, {leaf: grad}) -> errors
    parity_method: str              # what ``parity`` compares against, for the report
    baseline: str                   # the stock path: run on the interpreter's slice as the yardstick
    max_cpu_repeats: Optional[int] = None  # caps --repeats on CPU for ops whose one run takes seconds
    # the matrix products the op cannot avoid, as one call (built from the inputs; timed in the baseline's
    # worker, the table's "x GEMMs" column divides every path's time by it); None: no such floor
    gemm_floor: Optional[Callable[[Inputs], Callable[[], object]]] = None
    gemm_floor_method: str = ""


def ce_floor_bytes(rows: int, vocab: int, itemsize: int) -> int:
    """The bytes cross-entropy forward + backward must move on (BT, V) logits of ``itemsize`` bytes (the
    formula's one place; ``benchmarks/gpu_check.py`` uses it too, see ``_ce_floor_bytes``)."""
    return 3 * rows * vocab * itemsize


def _ce_floor_bytes(inputs: Inputs) -> int:
    # Cross-entropy forward + backward on (BT, V) logits moves at least
    #   forward  : read the logits once (online logsumexp and z[target] in one pass)   BT * V * b
    #   backward : read the logits again (softmax = exp(z - lse))                     BT * V * b
    #              write the gradient                                                 BT * V * b
    # = 3 * BT * V * b bytes, b = the logits' element size (the gradient has their dtype). Targets and
    # per-row lse are O(BT) and left out. (A single kernel that writes the gradient during the forward
    # could reach 2 * BT * V * b; the contract's separate forward/backward cannot.)
    rows, vocab = inputs.logits.shape
    return ce_floor_bytes(rows, vocab, inputs.logits.element_size())


def _ce_parity(inputs: Inputs, loss: torch.Tensor, grads: dict) -> dict:
    return parity.cross_entropy(inputs.logits, inputs.target, loss, grads["logits"], IGNORE_INDEX)


CROSS_ENTROPY = Op("cross_entropy", needs=("logits",), leaves=("logits",),
                   floor_bytes=_ce_floor_bytes, floor_formula="3 * BT * V * dtype_bytes",
                   parity=_ce_parity,
                   parity_method="F.cross_entropy on the same logits in float64 (chunked autograd)",
                   baseline="torch")


def _linear_floor_bytes(inputs: Inputs) -> int:
    # The LM head fused with the loss, forward + backward, moves at least
    #   read hidden (BT x H) and the weight (V x H)                          (BT * H + V * H) * b
    #   write their gradients, same shapes and dtype                         (BT * H + V * H) * b
    # = (2 * BT * H + 2 * V * H) * b bytes, b = the element size (no BT x V tensor needs to touch memory:
    # each logits tile can live in registers / shared memory). Targets are O(BT) and left out. The op
    # is compute-bound (6 * BT * V * H FLOPs), so GB/s over this floor stays far below the bandwidth.
    rows, hidden_size = inputs.hidden.shape
    vocab = inputs.weight.shape[0]
    return (2 * rows * hidden_size + 2 * vocab * hidden_size) * inputs.hidden.element_size()


def _linear_gemms(inputs: Inputs) -> Callable[[], object]:
    # The three products of a linear cross-entropy, in the operands' dtype, on the scored rows only (an
    # ignored row needs no logits): the logits h @ W.T, the hidden gradient g @ W and the weight gradient
    # g.T @ h, with g a (BT', V) tensor of the operands' dtype, BT' the rows whose target is not ignored.
    w = inputs.weight
    h = inputs.hidden.detach()[inputs.target.reshape(-1) != IGNORE_INDEX]
    g = torch.randn(h.shape[0], w.shape[0], device=h.device).to(h.dtype)
    return lambda: (h @ w.t(), g @ w, g.t() @ h)


def _linear_parity(inputs: Inputs, loss: torch.Tensor, grads: dict) -> dict:
    return parity.linear_cross_entropy(inputs.hidden, inputs.weight, inputs.target, loss, grads, IGNORE_INDEX)


LINEAR_CROSS_ENTROPY = Op(
    "linear_cross_entropy", needs=("hidden", "weight"), leaves=("hidden", "weight"),
    floor_bytes=_linear_floor_bytes, floor_formula="(2 * BT * H + 2 * V * H) * dtype_bytes",
    parity=_linear_parity,
    parity_method="F.cross_entropy(F.linear(hidden, weight)) in float64 on the same hidden and weight "
                  "(chunks of rows, autograd; weight gradient accumulated in float64)",
    baseline="linear-torch",
    # One fwd+bwd at the real shape is ~0.7 TFLOP (benchmarks/README.md: its CPU time).
    max_cpu_repeats=3, gemm_floor=_linear_gemms,
    gemm_floor_method="h @ W.T, g @ W, g.T @ h in the operands' dtype on the scored rows (g: a (BT', V) "
                      "tensor, BT' the rows not ignored), median of the same repeats, timed in the stock path's "
                      "worker")


@dataclass(frozen=True)
class BenchPath:
    """One way of computing an op. ``name`` is the id in JSON and ``--paths``; ``forward`` returns the
    scalar loss and must leave the backward to the caller."""

    name: str
    label: str        # the display name, ``names.path_name(name)``
    op: Op
    forward: Callable[[Inputs], torch.Tensor]
    method: str
    devices: tuple[str, ...] = ("cpu", "cuda")
    interpreter: bool = False
    peer: bool = False   # another library's implementation (``peers.py``), measured next to fusedce
    # facts about this run worth saving with it (e.g. what a peer's "auto" resolved to), computed from the
    # inputs after the measurement, outside the timing; JSON-able dict
    extra: Optional[Callable[[Inputs], dict]] = None


PATHS: dict[str, BenchPath] = {}


def register(path: BenchPath) -> BenchPath:
    if path.name in PATHS:
        raise ValueError(f"bench path {path.name!r} is already registered")
    PATHS[path.name] = path
    return path


def plan(device: str, names=None) -> list[tuple[BenchPath, str]]:
    """``(path, mode)`` for every registered path (or those in ``names``) that runs on ``device``, op
    by op; mode is ``"timed"`` or ``"parity"`` (on CPU: Triton interpreter paths on a slice of rows,
    preceded by their op's ``baseline`` on the same slice)."""
    unknown = set(names or ()) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown path(s) {sorted(unknown)}; registered: {', '.join(PATHS)}")
    chosen = [PATHS[name] for name in (names or PATHS)]
    runs = []
    for op in dict.fromkeys(p.op for p in chosen):
        mine = [p for p in chosen if p.op is op]
        runs += [(p, "timed") for p in mine if device in p.devices]
        interpreted = [p for p in mine if p.interpreter and "cpu" not in p.devices]
        if device == "cpu" and interpreted:
            runs += [(PATHS[op.baseline], "parity")] + [(p, "parity") for p in interpreted]
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


register(BenchPath("torch", path_name("torch"), CROSS_ENTROPY, _stock,
              "F.cross_entropy(logits.float(), target, ignore_index=-100), mean"))
register(BenchPath("fusedce-torch", path_name("fusedce-torch"), CROSS_ENTROPY, _fusedce("torch"),
              "fusedce.cross_entropy(logits, target, backend='torch'): chunked PyTorch, mean"))
register(BenchPath("fusedce-triton", path_name("fusedce-triton"), CROSS_ENTROPY, _fusedce("triton"),
              "fusedce.cross_entropy(logits, target, backend='triton'): Triton kernels, mean",
              devices=("cuda",), interpreter=True))


def _stock_linear(inputs: Inputs) -> torch.Tensor:
    # What a Hugging Face causal LM does today: the LM head's BT x V logits, upcast, F.cross_entropy.
    return F.cross_entropy(F.linear(inputs.hidden, inputs.weight).float(), inputs.target,
                           ignore_index=IGNORE_INDEX)


def _fusedce_linear(backend: str, method: str = "auto") -> Callable[[Inputs], torch.Tensor]:
    def forward(inputs: Inputs) -> torch.Tensor:
        import fusedce
        return fusedce.linear_cross_entropy(inputs.hidden, inputs.weight, inputs.target,
                                            ignore_index=IGNORE_INDEX, method=method, backend=backend)
    return forward


register(BenchPath("linear-torch", path_name("linear-torch"), LINEAR_CROSS_ENTROPY, _stock_linear,
              "F.cross_entropy(F.linear(hidden, weight).float(), target, ignore_index=-100), mean"))
register(BenchPath("linear-fusedce-torch", path_name("linear-fusedce-torch"), LINEAR_CROSS_ENTROPY,
                   _fusedce_linear("torch"),
              "fusedce.linear_cross_entropy(hidden, weight, target, backend='torch'): chunked PyTorch, "
              "chunk_size=None, mean"))
register(BenchPath("linear-fusedce-triton", path_name("linear-fusedce-triton"), LINEAR_CROSS_ENTROPY,
              _fusedce_linear("triton"),
              "fusedce.linear_cross_entropy(hidden, weight, target, backend='triton'): Triton CE kernels "
              "per chunk, chunk_size=None, mean", devices=("cuda",), interpreter=True))
register(BenchPath("linear-fusedce-torch-tiled", path_name("linear-fusedce-torch-tiled"), LINEAR_CROSS_ENTROPY,
              _fusedce_linear("torch", "tiled"),
              "fusedce.linear_cross_entropy(hidden, weight, target, method='tiled', backend='torch'): blocks "
              "of tokens x vocabulary, no logits tensor, mean"))
register(BenchPath("linear-fusedce-triton-tiled", path_name("linear-fusedce-triton-tiled"), LINEAR_CROSS_ENTROPY,
              _fusedce_linear("triton", "tiled"),
              "fusedce.linear_cross_entropy(hidden, weight, target, method='tiled', backend='triton'): tiled "
              "Triton kernels (logits tiles on chip only), mean", devices=("cuda",)))
# No interpreter parity run for the tiled kernels on CPU: on the real input's 32-row slice (V=49152,
# H=576) the interpreter takes about 150 s (one program per vocabulary tile, tl.dot per H block, each a
# Python-level step); tests/linear/test_triton_tiled.py and test_linear_tiled.py check them at small sizes.
register(BenchPath("linear-torch-lce", path_name("linear-torch-lce"), LINEAR_CROSS_ENTROPY,
              peers.torch_linear_cross_entropy,
              "torch.nn.functional.linear_cross_entropy(hidden, weight, target, ignore_index=-100, "
              "options=torch.nn.LinearCrossEntropyOptions()): torch's chunked path, 'auto' policy and chunking, "
              "mean; every row computed", peer=True, extra=peers.torch_lce_resolved))
register(BenchPath("linear-trl", path_name("linear-trl"), LINEAR_CROSS_ENTROPY, peers.trl_mean_nll,
              "trl.kernels.ChunkedLogProbFunction on the scored rows (ignored ones dropped first), "
              f"vocabulary tiles of {peers.TRL_VOCAB_TILE} (TRL's), -log_probs.sum() / scored; Triton on CUDA, "
              "torch ops on CPU", peer=True, extra=peers.trl_log_probs_check))
