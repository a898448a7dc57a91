"""verl's fused log-prob + entropy functions (``linear_cross_entropy``, ``FusedLinearForPPO``) computed by
fusedce under verl 0.9.1's call contracts, with the running model's head transform and the plugin's options
(docs/verl.md)."""
from __future__ import annotations

import numbers

import torch
from torch import nn

from fusedce.rl.log_probs import linear_token_log_probs
from fusedce.integrations.hf.head import LogitTransform
from fusedce.integrations.verl import head as verl_head
from fusedce.integrations.verl.options import OPTIONS
from fusedce.integrations.verl import tensor_parallel


def _temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"fusedce.integrations.verl: temperature must be a Python number (verl passes the "
                        f"rollout's uniform temperature), got {type(temperature).__name__}")
    return float(temperature)


def compute(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature, group=None):
    """``(log_probs, entropy)`` of ``labels.shape`` (module docstring), flattened rows of ``hidden``
    ``(..., H)`` against ``labels`` ``(...)`` with the same number of rows."""
    temperature = _temperature(temperature)
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor) or \
            not isinstance(labels, torch.Tensor):
        raise TypeError("fusedce.integrations.verl: hidden, weight and labels must be tensors")
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"fusedce.integrations.verl: hidden (..., H) {tuple(hidden.shape)} and weight (V, H) "
                         f"{tuple(weight.shape)} do not match (the LM head's weight is (vocab, hidden))")
    if labels.dtype not in (torch.int64, torch.int32):
        hint = " (class indices stored as floats? pass labels.long())" if labels.is_floating_point() else ""
        raise TypeError(f"fusedce.integrations.verl: labels must be int64 or int32 token ids, got "
                        f"{labels.dtype}{hint}")
    if group is not None and not isinstance(group, getattr(torch.distributed, "ProcessGroup", object)):
        raise TypeError(f"fusedce.integrations.verl: the process group must be a torch.distributed.ProcessGroup "
                        f"or None, got {type(group).__name__}")
    rows = hidden.numel() // max(hidden.shape[-1], 1)
    if labels.numel() != rows:
        raise ValueError(f"fusedce.integrations.verl: labels {tuple(labels.shape)} have {labels.numel()} tokens, "
                         f"hidden {tuple(hidden.shape)} has {rows} rows (one label per hidden row)")
    frame = verl_head.current()
    transform = frame.transform if frame is not None else LogitTransform()
    want_sq = frame is not None and frame.sum_pi_squared
    if want_sq and (OPTIONS["top_k"] is not None or OPTIONS["top_p"] is not None):
        raise ValueError("fusedce.integrations.verl: calculate_sum_pi_squared with top_k / top_p set: the sum of "
                         "squared probabilities is defined on the full softmax, the log-probs on the truncated "
                         "one; unset one of them")
    flat_hidden, flat_labels = hidden.reshape(rows, hidden.shape[-1]), labels.reshape(rows)
    if group is not None and tensor_parallel.world_size(group) > 1:
        out = tensor_parallel.log_probs(flat_hidden, weight, flat_labels, temperature, transform, group, OPTIONS,
                                        want_sq)
    else:
        out = _single(flat_hidden, weight, flat_labels, temperature, transform, want_sq)
    log_probs, entropy, sum_sq = out
    if want_sq:
        frame.results["sum_pi_squared"] = sum_sq.reshape(labels.shape)
    return log_probs.reshape(labels.shape), entropy.reshape(labels.shape)


def _single(hidden, weight, labels, temperature: float, transform: LogitTransform, want_sq: bool):
    if transform.n_classes is not None:
        weight = weight[:transform.n_classes]
    truncated = OPTIONS["top_k"] is not None or OPTIONS["top_p"] is not None
    kwargs = dict(temperature=temperature, softcap=transform.softcap, logit_scale=transform.scale,
                  return_entropy=True, method=OPTIONS["method"], chunk_size=OPTIONS["chunk_size"],
                  backend=OPTIONS["backend"], logits_dtype=OPTIONS["logits_dtype"],
                  batch_invariant=OPTIONS["batch_invariant"])
    if truncated:
        kwargs.update(top_k=OPTIONS["top_k"], top_p=OPTIONS["top_p"])
    out = linear_token_log_probs(hidden, weight, labels.long(), return_stats=want_sq, **kwargs)
    return out.log_probs, out.entropy, (out.log_sum_sq_probs.exp() if want_sq else None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature=1.0,
                         reduction: str = "none", dist_process_group=None):
    """verl's ``linear_cross_entropy``: ``hidden`` ``(..., H)``, ``weight`` ``(V, H)`` (or this rank's ``(V/TP, H)``
    with ``dist_process_group``), ``labels`` int, one per row -> fp32 ``(log_probs, entropy)`` of
    ``(labels.numel(),)``.

    Raises:
        ValueError: ``reduction`` other than ``"none"``, mismatched shapes.
        TypeError: a temperature that is not a Python number.
    """
    if reduction != "none":
        raise ValueError(f"fusedce.integrations.verl.linear_cross_entropy: reduction must be 'none' (per-token "
                         f"log-probs and entropy, what verl's engines ask for), got {reduction!r}")
    log_probs, entropy = compute(hidden, weight, labels, temperature, dist_process_group)
    return log_probs.reshape(-1), entropy.reshape(-1)


class FusedLinearForPPO(nn.Module):
    """verl's ``FusedLinearForPPO``: ``forward(hidden_states, vocab_weights, input_ids, temperature=1.0) ->
    (log_probs, entropy)`` fp32 of ``input_ids.shape``; ``chunk_size`` / ``impl_backend`` checked and unused."""

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"Unsupported FusedLinearForPPO backend: {impl_backend}. Choose 'torch' or 'liger'.")
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend

    def forward(self, hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor,
                temperature=1.0):
        return compute(hidden_states, vocab_weights, input_ids, temperature)
