"""The internal K-class op of the RL ops (a ``(..., K)`` target) on arguments already checked; the top-k
distillation calls it too."""
from __future__ import annotations

import torch

from fusedce.rl import kclass_head as head_kclass, kclass_ops
from fusedce.core.options import LossOptions
from fusedce.core.types import TokenLogProbs


def result(log_probs, entropy, target_shape, return_entropy: bool):
    """The public form of the K-class op's outputs: ``log_probs`` of ``target_shape`` ``(..., K)``, or
    ``TokenLogProbs(log_probs, entropy (...))``."""
    log_probs = log_probs.reshape(target_shape)
    if not return_entropy:
        return log_probs
    return TokenLogProbs(log_probs, entropy.reshape(target_shape[:-1]))


def log_probs_rows(impl, logits: torch.Tensor, classes: torch.Tensor, opts: LossOptions, return_entropy: bool):
    """The K-class op on checked ``logits`` ``(..., V)`` and ``classes`` ``(..., K)`` (in [0, V) or
    ``ignore_index``); ``impl`` the backend."""
    n_classes = logits.shape[-1]
    flat = logits.reshape(-1, n_classes)
    if flat.stride(-1) != 1 and n_classes > 1:
        flat = flat.contiguous()
    return head_kclass.token_log_probs_kclass(impl.CHUNK_CE, flat, classes.reshape(-1, classes.shape[-1]), opts,
                                            return_entropy)


def linear_log_probs_rows(impl, hidden, weight, classes, bias, opts: LossOptions, return_entropy: bool, chunk_size,
                          method: str, deterministic: bool, logits: str = "float32", compact: bool = True):
    """The K-class op of the LM head on checked arguments: ``hidden`` ``(..., H)``, ``weight`` ``(V, H)``, ``bias``
    ``(V,)`` or None, ``classes`` ``(..., K)``."""
    return kclass_ops.linear_token_log_probs_kclass(
        impl.CHUNK_CE, hidden.reshape(-1, hidden.shape[-1]), weight, classes.reshape(-1, classes.shape[-1]), bias,
        opts, return_entropy, None if chunk_size is None else int(chunk_size), method, tiled=impl.TILED_CE,
        deterministic=deterministic, logits=logits, compact=compact)
