"""torchtitan's RL ``compute_logprobs`` from the hidden states and the LM head, through fusedce (no
``[B, L, V]`` logits)."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchtitan.components.loss import IGNORE_INDEX

from fusedce.rl.log_probs import linear_token_log_probs
from fusedce.distributed import vocab_parallel_linear_token_log_probs
from fusedce.integrations.torchtitan.head import head_params, spmd_tp_group, to_partial

_WHERE = "fusedce.integrations.torchtitan.compute_logprobs"


def compute_logprobs(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, *,
                     return_entropy: bool = False, temperature: float = 1.0, chunk_size: int | None = None):
    """``torchtitan.components.loss.compute_logprobs(lm_head(hidden) / temperature, labels, ...)``.

    Args:
        hidden: ``[B, L, H]`` normed hidden states.
        lm_head: a plain linear head (full weight, ``Shard(0)`` DTensor, or this rank's rows).
        labels: ``[B, L]``; ``IGNORE_INDEX`` positions get log-prob 0.
        return_entropy: also return the entropy.
        temperature: > 0, divides the logits.
        chunk_size: None (automatic) or tokens per chunk.

    Returns:
        fp32 ``[B, L]`` log-probs, or ``(log-probs, entropy)`` with a detached entropy, as torchtitan's.

    Raises:
        TypeError: a head whose forward is not a plain linear layer.
    """
    weight, bias = head_params(lm_head, _WHERE)
    ignored = labels == IGNORE_INDEX
    if return_entropy:   # torchtitan's entropy covers the ignored positions too
        labels = labels.masked_fill(ignored, 0)
    kw = dict(temperature=temperature, ignore_index=IGNORE_INDEX, return_entropy=return_entropy,
              chunk_size=chunk_size)
    group = None if isinstance(weight, DTensor) else spmd_tp_group()
    if group is not None:
        out = vocab_parallel_linear_token_log_probs(to_partial(hidden, group), weight, labels, bias,
                                                    group=group, **kw)
    else:
        out = linear_token_log_probs(hidden, weight, labels, bias, **kw)

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    if not return_entropy:
        return local(out)
    return local(out[0]).masked_fill(ignored, 0.0), local(out[1]).detach()
