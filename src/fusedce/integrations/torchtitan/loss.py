"""``FusedLinearCrossEntropy``: torchtitan's token-sum cross-entropy / ``global_valid_tokens`` from the LM
head's weight through fusedce (the trainer/PP/FSDP flow of ``ChunkedLossWrapper``, one fused call instead of
``num_chunks`` logits chunks)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import spmd_types as spmd
import torch
from torch.distributed.tensor import DTensor

from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.config import CompileConfig

from fusedce.backends import check_name
from fusedce.ce.functional import linear_cross_entropy
from fusedce.distributed import vocab_parallel_linear_cross_entropy
from fusedce.integrations.torchtitan.head import head_params, local_view, spmd_tp_group, to_partial

_WHERE = "fusedce.integrations.torchtitan.FusedLinearCrossEntropy"


def token_sum_loss(hidden, weight, bias, labels, chunk_size, backend):
    """fp32 sum over the non-ignored tokens of the cross-entropy of ``hidden @ weight.T (+ bias)``:
    ``weight`` full, a ``Shard(0)`` DTensor, or (spmd_types TP) this rank's rows."""
    kw = dict(reduction="sum", ignore_index=IGNORE_INDEX, chunk_size=chunk_size, backend=backend)
    group = None if isinstance(weight, DTensor) else spmd_tp_group()
    if group is not None:
        return vocab_parallel_linear_cross_entropy(to_partial(hidden, group), weight, labels, bias,
                                                   group=group, **kw)
    loss = linear_cross_entropy(hidden, weight, labels, bias, **kw)
    return loss.to_local() if isinstance(loss, DTensor) else loss


class FusedLinearCrossEntropy(ChunkedLossWrapper):
    """torchtitan's ``ChunkedLossWrapper`` + ``CrossEntropyLoss`` (token-sum / ``global_valid_tokens``) computed by
    :func:`fusedce.linear_cross_entropy` from the LM head's weight; ``num_chunks`` is unused.

    Raises:
        TypeError: a head that is not a plain linear layer (at the first call).
        ValueError: ``loss_fn`` other than ``CrossEntropyLoss.Config``; ``pred`` sharded over H or partial.
        RuntimeError: called before ``set_lm_head``.
        NotImplementedError: under torchtitan's SPMD type checking.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        chunk_size: int | None = None
        """Tokens per fusedce chunk (logits are ``chunk_size x V`` (``V/TP`` under TP)); None: fusedce's rule."""

        backend: str | None = None
        """fusedce backend (None: its default for the device)."""

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        if type(config.loss_fn) is not CrossEntropyLoss.Config:
            raise ValueError(f"{_WHERE}: loss_fn must be CrossEntropyLoss.Config (the fused loss is the "
                             f"cross-entropy), got {type(config.loss_fn).__name__}; use ChunkedLossWrapper for it")
        chunk = config.chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"{_WHERE}: chunk_size must be an int >= 1 or None, got {chunk!r}")
        if config.backend is not None:
            check_name(config.backend)   # the name only: the device is known at the first call
        super().__init__(config, compile_config=compile_config)
        self.chunk_size = config.chunk_size
        self.backend = config.backend

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | None = None,
                 **loss_inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``pred`` ``[B, L, H]`` normed hidden states (``_skip_lm_head``), ``labels`` ``[B, L]`` -> (the detached fp32
        loss whose backward hands the hidden-state gradient to the decoder, ``{}``)."""
        del loss_inputs   # as CrossEntropyLoss (e.g. ``positions``)
        from torch.distributed._composable.fsdp import FSDPModule

        if spmd.is_type_checking():
            raise NotImplementedError(f"{_WHERE}: torchtitan's SPMD type checking (debug.spmd_typechecking=True) "
                                      "is not supported; turn it off, or use ChunkedLossWrapper to type-check")
        lm_head = self.lm_head
        if lm_head is None:
            raise RuntimeError(f"{_WHERE}: set_lm_head(model.lm_head) must be called first (the trainer does)")
        head_params(lm_head, _WHERE)   # its checks, before FSDP gathers anything
        hidden, hidden_dt = local_view(pred, "pred", _WHERE)
        labels_local, _ = local_view(labels, "labels", _WHERE)
        if labels_local.is_floating_point() or labels_local.is_complex() or labels_local.dtype == torch.bool:
            swapped = labels.is_floating_point() and not pred.is_floating_point()
            raise TypeError(f"{_WHERE}: labels must be integer token ids (int64 / int32), got {labels_local.dtype} of "
                            f"shape {tuple(labels.shape)}; " + ("pred and labels swapped? pass (pred [B, L, H], labels "
                            "[B, L])" if swapped else "pass labels.long() if they hold ids"))
        requires_grad = pred.requires_grad
        fsdp = isinstance(lm_head, FSDPModule)
        if fsdp:   # the head's parameters unsharded as FSDP hands them to its forward
            lm_head.unshard()
        try:
            weight, bias = head_params(lm_head, _WHERE)
            leaf = hidden.detach().requires_grad_(requires_grad)
            with torch.enable_grad() if requires_grad else torch.no_grad():
                h = leaf.to(weight.dtype) if fsdp else leaf   # FSDP's cast of the forward inputs
                loss = token_sum_loss(h, weight, bias, labels_local, self.chunk_size, self.backend)
                if global_valid_tokens is not None:
                    loss = loss / global_valid_tokens
                if requires_grad:
                    loss.backward()
        finally:
            if fsdp:
                lm_head.reshard()   # the weight gradient is reduce-scattered by FSDP's post-backward
        loss = loss.detach()
        if not requires_grad:
            return loss, {}
        grad = leaf.grad.to(hidden.dtype)
        if hidden_dt is not None:
            grad = DTensor.from_local(grad, hidden_dt.device_mesh, hidden_dt.placements)
        return self._gradient_backprop(pred, grad, loss, lm_head, fsdp), {}
