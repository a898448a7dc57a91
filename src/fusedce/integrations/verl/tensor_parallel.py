"""The Megatron engine's call (``weight`` this rank's ``(V/TP, H)`` shard) through
``vocab_parallel_linear_token_log_probs``; the hidden gradient is passed back divided by the group's size,
this rank's share as verl's kernel returns it. ``method="tiled"`` and a head padded beyond the
vocabulary are refused."""
from __future__ import annotations

import torch
import torch.distributed as dist

from fusedce.distributed.linear_log_probs import vocab_parallel_linear_token_log_probs


def world_size(group) -> int:
    return dist.get_world_size(group)


class _Share(torch.autograd.Function):
    """Identity forward; the backward divides the gradient by ``size`` (this rank's share of it)."""

    @staticmethod
    def forward(ctx, hidden, size):
        ctx.size = size
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.size, None


def _refuse(what: str, instead: str):
    raise ValueError(f"fusedce.integrations.verl: {what} is not available on a tensor-parallel (vocabulary-"
                     f"sharded) LM head; {instead}")


def log_probs(hidden, weight_shard, labels, temperature: float, transform, group, options: dict, want_sq: bool):
    """``(log_probs, entropy, sum_pi_squared or None)`` fp32 ``(N,)`` for ``hidden`` ``(N, H)`` and global
    ``labels`` ``(N,)``."""
    if options["method"] == "tiled":
        _refuse("method='tiled'", "the vocabulary-parallel op has no tiled form (its chunk of logits is "
                "rows x V/TP, already TP times smaller): set method='chunked' (or 'auto'), docs/verl.md")
    if transform.n_classes is not None:
        _refuse("a head padded beyond the vocabulary (unpadded_vocab_size)", "run with "
                "tensor_model_parallel_size=1, or without the padded rows")
    if options["batch_invariant"] and (want_sq or options["logits_dtype"] == "input"):
        _refuse("batch_invariant=1 with calculate_sum_pi_squared or logits_dtype='input'", "set one of them "
                "(their vocabulary-parallel row path is not the batch-invariant one)")
    size = world_size(group)
    if hidden.requires_grad:
        hidden = _Share.apply(hidden, size)
    out = vocab_parallel_linear_token_log_probs(
        hidden, weight_shard, labels.long(), group=group, temperature=temperature, softcap=transform.softcap,
        logit_scale=transform.scale, return_entropy=True, backend=options["backend"],
        batch_invariant=options["batch_invariant"], chunk_size=options["chunk_size"], return_stats=want_sq,
        logits_dtype=options["logits_dtype"], top_k=options["top_k"], top_p=options["top_p"])
    return out.log_probs, out.entropy, (out.log_sum_sq_probs.exp() if want_sq else None)
