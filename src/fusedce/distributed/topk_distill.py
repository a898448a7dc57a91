"""Vocab-parallel top-k distillation: the single-process composition (``distill/topk.topk_loss``) with the
student's two passes replaced by their vocab-parallel forms (docs/internals.md)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch

from fusedce.core.entrance import public_op
from fusedce.core.types import TopkDistillationOutput
from fusedce.distill import checks as dc
from fusedce.distill.topk import HeadRows, topk_loss
from fusedce.distributed.layout import VocabLayout, vocab_layout
from fusedce.distributed.kclass_log_probs import VocabParallelLinearLogProbsK, VocabParallelLogProbsK
from fusedce.distributed.topk_tail import ShardTailLinear, ShardTailLogits


class _ShardLogitRows:
    """The student as this rank's logits slice (n, V_r): no compaction (as the single-process logits form)."""
    compacts = False

    def __init__(self, call: dc.TopkCall, logits_shard, layout: VocabLayout):
        n_local = logits_shard.shape[-1]
        rows = logits_shard.reshape(math.prod(call.lead), n_local)
        self.rows = rows.contiguous() if rows.stride(-1) != 1 and n_local > 1 else rows
        self.call, self.layout = call, layout

    def select(self, needed) -> None:
        pass

    def log_probs(self, classes, opts):
        flat = classes.reshape(-1, classes.shape[-1])
        return VocabParallelLogProbsK.apply(self.rows, flat, self.layout, opts, self.call.impl, False)[0]

    def log_tail(self, excluded):
        return ShardTailLogits.apply(self.rows, excluded, self.layout, self.call.opts)


class _ShardHeadRows(HeadRows):
    """The student as its hidden states and this rank's rows of the LM head: the single-process form's
    compaction (every rank keeps the same tokens: the inputs are identical), the passes vocab-parallel."""

    def __init__(self, call: dc.TopkCall, hidden, weight_shard, bias_shard, chunk_size, layout: VocabLayout):
        super().__init__(call, hidden, weight_shard, bias_shard, "chunked", chunk_size)
        self.layout = layout

    def class_log_probs(self, classes, opts):
        rows = None if self.chunk_size is None else int(self.chunk_size)   # None: the rule, in the loop op
        return VocabParallelLinearLogProbsK.apply(self.hidden, self.weight, self.bias, classes, self.layout, opts,
                                                  rows, self.call.impl, False)[0]

    def kept_log_tail(self, excluded):
        return ShardTailLinear.apply(self.hidden, self.weight, self.bias, excluded, self.layout, self.call.opts)


def _global(call: dc.TopkCall, n_local: int, teacher_ids, vocab_start_index, group, device) -> tuple:
    """The slices' layout (one ``all_gather``; its errors the same on every rank) and the call with the global V."""
    same = {"the token count": math.prod(call.lead), "teacher_ids.shape[-1] (K)": teacher_ids.shape[-1]}
    layout = vocab_layout(n_local, vocab_start_index, group, device, same=same)
    return dataclasses.replace(call, n_classes=layout.n_classes), layout


@public_op("logits")
def vocab_parallel_topk_distillation_loss(
    logits_shard: torch.Tensor, teacher_ids: torch.Tensor, teacher_log_probs: torch.Tensor,
    target: Optional[torch.Tensor] = None, *, group=None, vocab_start_index: Optional[int] = None,
    temperature: float = 1.0, hard_label_weight: float = 0.0, ignore_index: int = -100, reduction: str = "mean",
    num_items_in_batch: Union[int, torch.Tensor, None] = None, student_softcap: Optional[float] = None,
    logit_scale: float = 1.0, tail: bool = False, return_stats: bool = False, backend: Optional[str] = None,
) -> Union[torch.Tensor, TopkDistillationOutput]:
    """:func:`fusedce.topk_distillation_loss` on the student's logits split by vocabulary over ``group``'s ranks.

    Equals the single-process op on the concatenated vocabulary; replicated loss (and stats). Semantics:
    docs/contract.md, "Integrations"; collectives: docs/integrations.md, "Collectives".

    Args:
        logits_shard: ``(..., V_r)`` float32 / bfloat16 / float16, this rank's slice of the student's logits.
        teacher_ids, teacher_log_probs: ``(..., K)`` global ids and their log-probs, identical on every rank.
        target: None or ``(...)`` global class ids, identical on every rank.
        group, vocab_start_index: as :func:`vocab_parallel_cross_entropy`.
        temperature, hard_label_weight, ignore_index, reduction: as :func:`fusedce.topk_distillation_loss`.
        num_items_in_batch, student_softcap, logit_scale, tail, return_stats, backend: likewise.

    Returns:
        As :func:`fusedce.topk_distillation_loss`, replicated.

    Raises:
        The errors of :func:`fusedce.topk_distillation_loss` (ids and target against the global V) and of
        :func:`vocab_parallel_cross_entropy`'s layout.
    """
    call = dc.checked_topk("logits_shard", logits_shard, None, None, teacher_ids, teacher_log_probs, target,
                           temperature=temperature, hard_label_weight=hard_label_weight, ignore_index=ignore_index,
                           reduction=reduction, num_items_in_batch=num_items_in_batch,
                           student_softcap=student_softcap, logit_scale=logit_scale, backend=backend, tail=tail,
                           return_stats=return_stats)
    call, layout = _global(call, logits_shard.shape[-1], teacher_ids, vocab_start_index, group, logits_shard.device)
    return topk_loss(_ShardLogitRows(call, logits_shard, layout), teacher_ids, teacher_log_probs, call, reduction,
                     num_items_in_batch)


@public_op("linear", linear=(("student_hidden", "weight_shard", "bias_shard"),))
def vocab_parallel_linear_topk_distillation_loss(
    student_hidden: torch.Tensor, weight_shard: torch.Tensor, teacher_ids: torch.Tensor,
    teacher_log_probs: torch.Tensor, target: Optional[torch.Tensor] = None, *,
    bias_shard: Optional[torch.Tensor] = None, group=None, vocab_start_index: Optional[int] = None,
    temperature: float = 1.0, hard_label_weight: float = 0.0, ignore_index: int = -100, reduction: str = "mean",
    num_items_in_batch: Union[int, torch.Tensor, None] = None, student_softcap: Optional[float] = None,
    logit_scale: float = 1.0, tail: bool = False, return_stats: bool = False, chunk_size: Optional[int] = None,
    backend: Optional[str] = None, deterministic: Optional[bool] = None,
) -> Union[torch.Tensor, TopkDistillationOutput]:
    """:func:`fusedce.linear_topk_distillation_loss` with the student's LM head split by vocabulary over
    ``group``'s ranks (one chunk of ``rows x V_r`` logits at a time).

    Args:
        student_hidden: ``(..., H)`` float32 / bfloat16 / float16, identical on every rank.
        weight_shard: ``(V_r, H)`` this rank's rows of the student's head, ``student_hidden``'s dtype.
        teacher_ids, teacher_log_probs, target, group, vocab_start_index: as
            :func:`vocab_parallel_topk_distillation_loss`, and so are the loss options.
        bias_shard: None or ``(V_r,)``.
        chunk_size: tokens per chunk of the K-class pass; None: automatic.
        deterministic: None or a bool, accepted; this op is deterministic whatever its value.

    Returns:
        As :func:`fusedce.linear_topk_distillation_loss`, replicated; ``student_hidden``'s gradient complete
        on every rank, the slices' gradients this rank's.

    Raises:
        The errors of :func:`fusedce.linear_topk_distillation_loss` for the student's head and of
        :func:`vocab_parallel_topk_distillation_loss`.
    """
    call = dc.checked_topk("student_hidden", student_hidden, weight_shard, bias_shard, teacher_ids,
                           teacher_log_probs, target, temperature=temperature, hard_label_weight=hard_label_weight,
                           ignore_index=ignore_index, reduction=reduction, num_items_in_batch=num_items_in_batch,
                           student_softcap=student_softcap, logit_scale=logit_scale, backend=backend,
                           method="chunked", chunk_size=chunk_size, deterministic=deterministic, tail=tail,
                           return_stats=return_stats, sharded=True)
    call, layout = _global(call, weight_shard.shape[0], teacher_ids, vocab_start_index, group, student_hidden.device)
    student = _ShardHeadRows(call, student_hidden, weight_shard, bias_shard, chunk_size, layout)
    return topk_loss(student, teacher_ids, teacher_log_probs, call, reduction, num_items_in_batch)
