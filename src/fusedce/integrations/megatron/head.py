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
    """The output layer's operands in place of its output: ``hidden`` ``[s, b, H]``, this rank's ``weight`` rows
    ``(V/TP, H)``, ``bias``, the tensor-parallel ``group``, MuP's ``scale``, and ``outputs`` left for later readers."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    group: object
    scale: float = 1.0
    outputs: dict = dataclasses.field(default_factory=dict, compare=False)


def scaled(logits: DeferredLogits, factor: float) -> DeferredLogits:
    """``logits`` times ``factor`` (still deferred)."""
    return dataclasses.replace(logits, scale=logits.scale * factor)


def _with_scale(options: dict, logits: DeferredLogits) -> dict:
    if logits.scale == 1.0:
        return options
    return {**options, "logit_scale": options.get("logit_scale", 1.0) * logits.scale}


def loss(logits: DeferredLogits, labels: torch.Tensor, options: dict,
         token_weights: Optional[torch.Tensor], predictions: bool = False) -> torch.Tensor:
    """``[b, s]`` fp32 per-token cross-entropy of ``labels`` ``[b, s]``; with ``predictions`` the argmax is left in
    ``logits.outputs["predicted"]``."""
    weights = None if token_weights is None else token_weights.transpose(0, 1)
    out = vocab_parallel_linear_cross_entropy(logits.hidden, logits.weight, labels.transpose(0, 1), logits.bias,
                                              group=logits.group, reduction="none", token_weights=weights,
                                              return_stats=predictions, **_with_scale(options, logits))
    if predictions:
        logits.outputs["predicted"] = out.predicted_tokens
        out = out.loss
    return out.transpose(0, 1).contiguous()


def log_probs(logits: DeferredLogits, labels: torch.Tensor, options: dict):
    """``[b, s]`` fp32 log-probs of ``labels`` (and entropy with ``options["return_entropy"]``:
    ``fusedce.TokenLogProbs`` of two ``[b, s]`` tensors); ``options``:
    ``vocab_parallel_linear_token_log_probs``'s keywords."""
    out = vocab_parallel_linear_token_log_probs(logits.hidden, logits.weight, labels.transpose(0, 1), logits.bias,
                                                group=logits.group, **_with_scale(options, logits))
    if isinstance(out, torch.Tensor):
        return out.transpose(0, 1).contiguous()
    return type(out)(*(t.transpose(0, 1).contiguous() for t in out))
