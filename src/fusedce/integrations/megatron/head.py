"""What the patched ``output_layer`` hands to ``compute_language_model_loss`` instead of the ``[s, b, V/TP]`` logits,
and the two computations on it: the per-token cross-entropy (``loss``) and the per-token log-probs / entropy
(``log_probs``), both through fusedce's vocabulary-parallel fused linear ops over the output layer's tensor-parallel
group."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from fusedce.distributed import vocab_parallel_linear_cross_entropy, vocab_parallel_linear_token_log_probs


@dataclasses.dataclass(frozen=True)
class DeferredLogits:
    """The output layer's operands in place of its output: ``hidden`` ``[s, b, H]``, ``weight`` this
    rank's vocabulary rows ``(V/TP, H)`` (the output layer's or the tied embedding's), ``bias``
    ``(V/TP,)`` or None, ``group`` the tensor-parallel group the rows are split over."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    group: object


def loss(logits: DeferredLogits, labels: torch.Tensor, options: dict,
         token_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """``[b, s]`` fp32 per-token cross-entropy (contiguous, as Megatron's), ``labels`` ``[b, s]`` global class ids,
    ``token_weights`` ``[b, s]`` or None; ``options``: ``vocab_parallel_linear_cross_entropy``'s keywords."""
    weights = None if token_weights is None else token_weights.transpose(0, 1)
    rows = vocab_parallel_linear_cross_entropy(logits.hidden, logits.weight, labels.transpose(0, 1), logits.bias,
                                               group=logits.group, reduction="none", token_weights=weights,
                                               **options)
    return rows.transpose(0, 1).contiguous()


def log_probs(logits: DeferredLogits, labels: torch.Tensor, options: dict):
    """``[b, s]`` fp32 log-probs of ``labels`` (and entropy with ``options["return_entropy"]``:
    ``fusedce.TokenLogProbs`` of two ``[b, s]`` tensors); ``options``:
    ``vocab_parallel_linear_token_log_probs``'s keywords."""
    out = vocab_parallel_linear_token_log_probs(logits.hidden, logits.weight, labels.transpose(0, 1), logits.bias,
                                                group=logits.group, **options)
    if isinstance(out, torch.Tensor):
        return out.transpose(0, 1).contiguous()
    return type(out)(*(t.transpose(0, 1).contiguous() for t in out))
