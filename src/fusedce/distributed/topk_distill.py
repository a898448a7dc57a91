"""Vocab-parallel top-k distillation: ``fusedce.topk_distillation_loss`` / ``linear_topk_distillation_loss``
with the student's logits (or LM head) split by vocabulary over the ranks, equal to the single-process op
on the concatenated vocabulary (loss, ``teacher_mass`` / ``student_mass``, gradients).

The single-process op's own composition (``distill/topk.topk_loss``: the teacher's side, the reduction,
the statistics) with the student's two passes replaced by their vocab-parallel forms:

- ``log s[id_k]`` (and the hard label): the vocab-parallel K-class log-probs (``multi_log_probs.py``: one
  exchange of row statistics plus one ``all_reduce(SUM)`` of the (n, K) target logits);
- ``log s_tail`` (``tail=True``): ``topk_tail.py`` (two ``all_reduce`` of (n, 2) fp32).

Only per-row statistics and the K teacher classes' logits travel, never a logits row (no gather of V).
Every rank gets the same (replicated) loss; backward gives each rank its slice's gradient (the LM-head form
all-reduces ``grad_hidden``).
"""
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
    """The slices' layout (one ``all_gather``, the setup's host sync; its errors the same on every rank, a
    token count or K differing between ranks among them) and the call with the GLOBAL V, which the range
    checks then use."""
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
    """``fusedce.topk_distillation_loss`` on the student's logits split by vocabulary over ``group``'s ranks.

    Equals ``fusedce.topk_distillation_loss(student_logits, teacher_ids, teacher_log_probs, target, ...)``
    with ``student_logits`` the slices concatenated over the vocabulary (the student's softmax over the
    GLOBAL V); every rank gets the same loss (and stats).

    Args:
        logits_shard: ``(..., V_r)`` float32 / bfloat16 / float16, this rank's contiguous vocabulary slice of
            the student's logits; ``V_r`` may differ between ranks (even 0). Never modified.
        teacher_ids, teacher_log_probs: ``(..., K)``, GLOBAL class ids and their log-probs, identical on every
            rank (as ``fusedce.topk_distillation_loss``; padding: ``-inf`` or ``ignore_index``).
        target: None or ``(...)`` GLOBAL class ids, identical on every rank (the hard labels; ``ignore_index``
            rows contribute 0 and get zero gradient).
        group, vocab_start_index: as in ``vocab_parallel_cross_entropy`` (None: the default group; slices in
            rank order).
        temperature, hard_label_weight, ignore_index, reduction: as in ``fusedce.topk_distillation_loss``.
        num_items_in_batch, student_softcap, logit_scale, tail, return_stats, backend: likewise.

    Returns:
        As ``fusedce.topk_distillation_loss`` (fp32 scalar, ``(...)`` for ``"none"``, or
        ``TopkDistillationOutput``), replicated; the gradient of ``logits_shard`` has its dtype and shape.

    Collectives (on ``group``; BT = tokens): setup ``all_gather`` of 3 int64 per rank (one host sync); forward
    ``all_reduce(MAX)`` of BT int64, ``all_reduce(SUM)`` of BT x 3 fp32 and of BT x K' fp32 (K' = K, + 1 with
    a hard label at temperature 1; a second such round for the hard label at another temperature); with
    ``tail`` two ``all_reduce`` of BT x 2 fp32; backward none. Host syncs: the setup's and the single-process
    op's range and value checks.

    Raises:
        The errors of ``fusedce.topk_distillation_loss`` (a teacher id or target outside the GLOBAL
        ``[0, V)``: ``IndexError``) and of ``vocab_parallel_cross_entropy``'s layout (slices that do not tile
        ``[0, V)``, ``vocab_start_index`` on some ranks only, V = 0, no initialized process group).
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
    """``fusedce.linear_topk_distillation_loss`` with the student's LM head split by vocabulary rows over
    ``group``'s ranks, never forming more than one chunk of ``rows x V_r`` logits.

    Args:
        student_hidden: ``(..., H)`` float32 / bfloat16 / float16, identical on every rank.
        weight_shard: ``(V_r, H)`` this rank's contiguous rows of the student's head, ``student_hidden``'s
            dtype (``V_r`` may differ between ranks, even 0); ``bias_shard`` its ``(V_r,)`` slice or None.
        teacher_ids, teacher_log_probs, target, group, vocab_start_index, and the loss options: as
            :func:`vocab_parallel_topk_distillation_loss`.
        chunk_size: tokens per chunk of the K-class pass (None: the rule of the vocab-parallel linear ops);
            the tail pass takes whole rows of the slice in blocks of ``distill/tail.py``. The chunked method
            only (no ``method`` keyword; a DTensor call passes ``method="auto"`` / ``"chunked"``).
        deterministic: accepted as in ``fusedce.linear_topk_distillation_loss``; this op is deterministic
            whatever its value (no float atomics).

    Returns:
        As ``fusedce.linear_topk_distillation_loss``, replicated; gradients of ``student_hidden`` (complete,
        the same on every rank), ``weight_shard`` and ``bias_shard`` (this rank's slice) in their dtypes.

    Tokens no pass needs cost no FLOPs and no communication (one compaction, one host sync, as the
    single-process op). Collectives: those of :func:`vocab_parallel_topk_distillation_loss` on the kept
    tokens, plus in the backward one ``all_reduce(SUM)`` of ``grad_hidden`` per pass (BT' x H; two with
    ``tail``).

    Raises:
        The errors of ``fusedce.linear_topk_distillation_loss`` for the student's head (named
        ``weight_shard`` / ``bias_shard``), ``chunk_size`` and ``deterministic``, and those of
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
