"""``megatron_token_log_probs``: the per-token log-probs (and entropy) of a Megatron-core ``GPTModel``'s
next tokens, what RL frameworks on Megatron (verl, slime, NeMo RL) compute from its ``[s, b, V/TP]``
logits, through :func:`fusedce.distributed.vocab_parallel_linear_token_log_probs` without forming them."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from fusedce.core.entrance import public_op
from fusedce.core.types import TokenLogProbs
from fusedce.integrations.megatron.patch import gpt_model, patch_megatron, patched_state, unpatch_megatron


@public_op("integration")
def megatron_token_log_probs(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                             attention_mask: Optional[torch.Tensor], target: torch.Tensor, *,
                             temperature: float = 1.0, softcap: Optional[float] = None, logit_scale: float = 1.0,
                             ignore_index: int = -100, return_entropy: bool = False,
                             chunk_size: Optional[int] = None, backend: Optional[str] = None,
                             deterministic: Optional[bool] = None, batch_invariant: bool = False,
                             **forward_kwargs,
                             ) -> Union[torch.Tensor, TokenLogProbs]:
    """Run ``model(input_ids, position_ids, attention_mask, labels=target, **forward_kwargs)`` and return, instead
    of its loss, the per-token log-probs (and entropy) of ``target`` on the global vocabulary.

    Equal to :func:`fusedce.distributed.vocab_parallel_token_log_probs` on the stock model's logits, which are
    never formed (docs/megatron.md).

    Args:
        model: as :func:`fusedce.patch_megatron` takes it, patched or not; no MTP heads.
        input_ids, position_ids, attention_mask: the model's forward arguments, and so is ``**forward_kwargs``.
        target: ``[b, s]`` int (Megatron's shifted ``labels``), or ``[b, s, K]``: K classes per token.
        temperature, softcap, logit_scale, ignore_index, return_entropy: as
            :func:`fusedce.distributed.vocab_parallel_linear_token_log_probs`.
        chunk_size, backend, deterministic, batch_invariant: likewise.

    Returns:
        fp32 ``[b, s]`` (or ``[b, s, K]``) log-probs, or ``fusedce.TokenLogProbs(log_probs, entropy)``.

    Raises:
        The errors of :func:`fusedce.patch_megatron` and of ``vocab_parallel_linear_token_log_probs``;
        ``ValueError`` for a model with MTP heads.
    """
    gpt = gpt_model(model, caller="fusedce.integrations.megatron.megatron_token_log_probs")
    temporary = patched_state(gpt) is None
    if temporary:
        patch_megatron(gpt)
    state = patched_state(gpt)
    state.log_probs = dict(temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                           ignore_index=ignore_index, return_entropy=return_entropy, chunk_size=chunk_size,
                           backend=backend, deterministic=deterministic, batch_invariant=batch_invariant)
    try:
        out = model(input_ids, position_ids, attention_mask, labels=target, **forward_kwargs)
    finally:
        state.log_probs = None
        if temporary:
            unpatch_megatron(gpt)
    if return_entropy and not isinstance(out, TokenLogProbs):   # a wrapper's output conversion made it a tuple
        out = TokenLogProbs(*out)
    return out
