"""Peer implementations of the fused LM head + loss that the bench measures next to stock and fusedce."""
from __future__ import annotations

import torch

from . import parity
from .inputs import IGNORE_INDEX, Inputs

# trl/trainer/utils.py ``_CHUNKED_LOGPROB_CHUNK_SIZE`` (TRL 1.16): the vocabulary width of a tile in TRL's
# fused head (its token height is ``trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE``). Copied, not imported:
# that module imports TRL's trainers (seconds). tests/tools/test_bench_peers.py checks it against TRL's.
TRL_VOCAB_TILE = 32768
LOG_PROBS_CHECK_ROWS = 256   # rows of the float64 log-prob check (a V x H float64 matmul per 341 rows)


def torch_linear_cross_entropy(inputs: Inputs) -> torch.Tensor:
    """``F.linear_cross_entropy(hidden, weight, target, ignore_index=-100, options=...)``: mean loss (in
    hidden's dtype: torch rounds its bf16 loss to bf16)."""
    options = torch.nn.LinearCrossEntropyOptions()
    return torch.nn.functional.linear_cross_entropy(inputs.hidden, inputs.weight, inputs.target,
                                                    ignore_index=IGNORE_INDEX, options=options)


def torch_lce_resolved(inputs: Inputs) -> dict:
    """What ``LinearCrossEntropyOptions()``'s ``"auto"`` became for these inputs: ``acc_policy``,
    ``chunking_method``, ``batch_chunk_size`` (rows per chunk), ``acc_dtype``."""
    hidden, weight = inputs.hidden, inputs.weight
    resolved = torch.nn.LinearCrossEntropyOptions()._adjust(
        num_batches=hidden.shape[0], in_features=hidden.shape[1], num_classes=weight.shape[0],
        dtype=hidden.dtype, device=hidden.device)
    return {"acc_policy": resolved.acc_policy, "chunking_method": resolved.chunking_method,
            "batch_chunk_size": resolved.batch_chunk_size,
            "acc_dtype": str(resolved.acc_dtype).removeprefix("torch.")}


def _trl_log_probs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    from trl.kernels import ChunkedLogProbFunction
    # (hidden, weight, bias, targets, temperature, vocabulary tile, softcap, logit_scale, extra outputs)
    return ChunkedLogProbFunction.apply(hidden, weight, None, target, 1.0, TRL_VOCAB_TILE, None, 1.0, ())[0]


def trl_mean_nll(inputs: Inputs) -> torch.Tensor:
    """Mean ``-log p(target)`` over the scored tokens through TRL's ``ChunkedLogProbFunction`` (fp32)."""
    keep = inputs.target != IGNORE_INDEX
    target = inputs.target[keep]
    log_probs = _trl_log_probs(inputs.hidden[keep], inputs.weight, target)
    return -log_probs.sum() / max(int(target.shape[0]), 1)


def trl_log_probs_check(inputs: Inputs) -> dict:
    """TRL's per-token log-probs (no gradient) against ``fusedce.linear_token_log_probs`` on every scored
    token (max |difference|) and both against float64 on ``LOG_PROBS_CHECK_ROWS`` scored rows."""
    import fusedce
    keep = (inputs.target != IGNORE_INDEX).nonzero().squeeze(1)
    hidden, weight, target = inputs.hidden.detach()[keep], inputs.weight.detach(), inputs.target[keep]
    with torch.no_grad():
        theirs = _trl_log_probs(hidden, weight, target)
        ours = fusedce.linear_token_log_probs(hidden, weight, target, ignore_index=IGNORE_INDEX)
    rows = parity.subset_rows(target, LOG_PROBS_CHECK_ROWS, IGNORE_INDEX)
    vs64 = {name: parity.linear_token_log_probs(hidden, weight, target, lp, None, rows, IGNORE_INDEX)
            for name, lp in (("trl", theirs), ("fusedce", ours))}
    return {"log_probs_vs_fusedce_max_abs": float((theirs - ours).abs().max()) if keep.numel() else 0.0,
            "trl_log_probs_vs_fp64_max_abs": vs64["trl"]["log_probs_max_abs_err"],
            "fusedce_log_probs_vs_fp64_max_abs": vs64["fusedce"]["log_probs_max_abs_err"],
            "fp64_rows": vs64["trl"]["rows"], "scored_rows": int(keep.numel())}


def liger_flce(inputs: Inputs) -> torch.Tensor:
    """Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss(ignore_index=-100)(weight, hidden, target)``."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)(inputs.weight, inputs.hidden, inputs.target)


def cce_linear_cross_entropy(inputs: Inputs) -> torch.Tensor:
    """cut-cross-entropy's ``linear_cross_entropy(hidden, weight, target, ignore_index=-100)`` (mean)."""
    from cut_cross_entropy import linear_cross_entropy
    return linear_cross_entropy(inputs.hidden, inputs.weight, inputs.target, ignore_index=IGNORE_INDEX,
                                reduction="mean")


def quack_linear_cross_entropy(inputs: Inputs) -> torch.Tensor:
    """quack's ``chunked_linear_cross_entropy(hidden, weight, target, ignore_index=-100)`` (mean; its
    default chunk of 4096 rows)."""
    from quack.linear_cross_entropy import chunked_linear_cross_entropy
    return chunked_linear_cross_entropy(inputs.hidden, inputs.weight, inputs.target, ignore_index=IGNORE_INDEX,
                                        reduction="mean")
