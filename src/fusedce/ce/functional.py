"""Public functions: normalize arguments, validate, pick the backend, apply the reduction."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import torch

from fusedce.core.entrance import public_op
from fusedce import backends
from fusedce.ce import linear_function, linear_soft, soft_targets as soft
from fusedce.ce.checks import checked_cross_entropy, checked_linear_cross_entropy
from fusedce.core import reduction as red
from fusedce.core.row_math import target_probability
from fusedce.core.rows import rows_view
from fusedce.core.types import CrossEntropyOutput
from fusedce.core.options import LossOptionValues

if TYPE_CHECKING:
    from typing_extensions import Unpack


@public_op("logits")
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None, *,
                  reduction: str = "mean", num_items_in_batch: Union[int, torch.Tensor, None] = None,
                  inplace_backward: bool = False, return_stats: bool = False, backend: Optional[str] = None,
                  token_weights: Optional[torch.Tensor] = None, batch_invariant: bool = False,
                  **options: Unpack[LossOptionValues]) -> Union[torch.Tensor, CrossEntropyOutput]:
    """Cross-entropy over the LAST dimension of ``logits`` (the LLM layout), computed in fp32.

    Args:
        logits: ``(..., V)`` float32 / bfloat16 / float16. Any row stride; if the last dim is not
            stride 1, or rows overlap in memory (expanded) with ``inplace_backward``, it is copied once
            (``inplace_backward`` then writes into that copy).
        target: ``(...)`` = ``logits.shape[:-1]``, int64 or int32, same device; ``ignore_index`` marks
            rows that contribute nothing. Or class probabilities ("soft" targets: mixup, distillation
            from stored teacher distributions): a float32 / bfloat16 / float16 / float64 tensor of
            ``logits.shape`` (its dtype independent of the logits'; used in fp32), with
            ``F.cross_entropy``'s semantics: per row ``-sum_c w_c q'_c log softmax(z)_c``, ``q' = (1 -
            eps) q + eps / V`` (label smoothing mixes q with the uniform distribution first); no row is
            ignored (``ignore_index`` does not apply); ``"mean"`` divides the loss and the z-loss by the
            number of rows (torch's rule for probability targets, whatever the class weights) or
            ``num_items_in_batch``. Softcap, logit scale, z-loss, ``token_weights``, ``inplace_backward``
            and the stats as for class indices (``token_accuracy``: the argmax of the logits equals the
            argmax of the target, every row counted); ``use_token_scaling`` is a ``ValueError`` (its
            ``p_t`` needs a target class). The target is a constant (a tensor that requires grad is a
            ``TypeError``); a negative, NaN or +inf value is a ``ValueError`` naming ``target`` and its first
            position (one host sync, the target-range check's: skipped under torch.compile and CUDA-graph
            capture, where the value reaches the loss); its rows need not sum to 1 and values above 1 are
            accepted (as in torch); a class with ``q'_c w_c
            = 0`` adds exactly 0, also at a -inf logit (torch's composition gives NaN there). Both
            ``"torch"`` and ``"triton"`` (a one-pass forward and a one-pass backward, no host sync);
            ``"cute"``: ``NotImplementedError``. Source: ``ce/soft_targets.py``.
        weight: optional ``(V,)`` float class weights (``F.cross_entropy`` semantics); constants: they
            get no gradient.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (fp32 tensor of ``target.shape``). The mean is
            ``sum(ce_row) / D + sum(z_row) / N`` (``z_row`` the z-loss): ``D = num_items_in_batch`` if
            given, else ``sum(w[t])`` over non-ignored rows; ``N = num_items_in_batch`` if given, else
            their count (so the z-loss is not class-weighted); a zero denominator gives 0.0 for its part
            and zero gradient.
        num_items_in_batch: int or 0-dim tensor, the mean's denominator under gradient accumulation.
        token_weights: optional ``(...)`` = ``target.shape`` float tensor (any float dtype, same device;
            used in fp32): each non-ignored row's loss and z-loss (and its ``z_loss`` stat) is
            multiplied by it, after ``use_token_scaling``'s ``p_t`` if both are given (they multiply);
            per-token loss weights (curriculum, reward-weighted SFT, confidence masking). A constant:
            detached, no gradient reaches it (as the class weights). The mean's denominators ``D`` and
            ``N`` are unchanged (divide by ``sum(token_weights)`` yourself through
            ``num_items_in_batch`` for a weighted average). Values on ignored rows are never read
            (NaN there is fine); a NaN or infinite weight on a non-ignored row is a ``ValueError`` in
            the target-range check's host sync (no extra sync), and where that check is skipped
            (torch.compile, CUDA-graph capture) it propagates: that row's loss, the reduced loss and
            that row's gradient become NaN / inf. With probability targets (every row counts) any
            non-finite weight is that ``ValueError``, in the probability value check's host sync.
        inplace_backward: the backward pass writes the gradient into ``logits``' storage (destroys the
            caller's logits after backward, saves one BT x V buffer). Default: nothing of the caller's
            is ever modified.
        return_stats: return ``CrossEntropyOutput(loss, z_loss, lse, token_accuracy, predicted_tokens)``;
            ``lse`` is 0 on ignored rows (as in :func:`linear_cross_entropy`, which never computes them).
        backend: ``"auto"`` / ``"torch"`` / ``"triton"``; None reads ``$FUSEDCE_BACKEND`` (unset or
            empty: auto).
        batch_invariant: True promises (and checks that the call allows) that each row's outputs
            (``"none"`` rows, ``lse``, the statistics) and its row of the gradient are bitwise the same
            whatever the other rows, their number and the row's position (a fixed device, dtype, thread
            count and version): the Triton kernels run one program per row, the PyTorch row loops
            reduce each row whole on one thread (``lm_head/invariant.py``); it costs nothing here.
            ``ValueError`` with probability targets or ``backend="cute"``, ``TypeError`` unless a bool.
        **options: the loss options (``ignore_index``, ``label_smoothing``, ...), listed with their
            defaults and domains under "Loss options" below.

    Returns:
        The fp32 loss (scalar, or ``target.shape`` for ``"none"``), or ``CrossEntropyOutput``.
        The gradient w.r.t. ``logits`` has their dtype and shape; ignored rows get exactly 0.

    Raises:
        TypeError: non-float logits; a target neither int64 / int32 nor float32 / bfloat16 / float16 /
            float64 (bool, uint8, int16, float8, ...); a probability target that requires grad; class
            weights (``weight``; the linear op's ``ce_weight``) that require grad in grad mode; an unknown
            keyword; a loss option of the
            wrong kind (``ignore_index`` not an integer, e.g. a float or a bool: nothing is rounded; a
            real option not a real number, e.g. a string, or a tensor that requires grad; a flag not a
            bool); ``inplace_backward`` / ``return_stats`` not a bool; ``num_items_in_batch`` a bool or
            neither a number nor a tensor; ``token_weights`` not a floating-point tensor.
        ValueError: shape mismatch, V = 0 (``logits`` of shape ``(..., 0)``), bad reduction, a loss
            option outside its domain (below; NaN and infinities never are, nor numbers beyond fp32's
            range: the kernels compute in fp32), ``num_items_in_batch`` negative, non-finite or beyond fp32
            (a number or a CPU tensor; a CUDA tensor is not read), weight not (V,), tensors on
            different devices, unknown backend; ``token_weights`` not of ``target.shape`` or on
            another device, or (host-checked, see ``token_weights``) NaN / infinite on a non-ignored row;
            a float (probability) target whose shape is not ``logits.shape`` (naming both), or with
            ``use_token_scaling``.
            (An int32 ``target`` with an ``ignore_index`` outside int32 is fine: it is converted to
            int64 once, a BT-element copy.)
        IndexError: a target neither ``ignore_index`` nor in [0, V), naming the first bad position
            (a host sync; skipped under torch.compile / CUDA-graph capture, where that row's loss is NaN).
        RuntimeError: ``backend="triton"`` on CPU tensors without ``TRITON_INTERPRET=1``;
            ``backend="cute"`` on CPU tensors or without the ``cute`` extra (naming which is missing).
        NotImplementedError: probability targets with ``backend="cute"``.
    """
    call = checked_cross_entropy(logits, target, weight, reduction=reduction, num_items_in_batch=num_items_in_batch,
                                 inplace_backward=inplace_backward, return_stats=return_stats, backend=backend,
                                 token_weights=token_weights, batch_invariant=batch_invariant, options=options)
    rows = rows_view(logits, inplace_backward)
    impl = backends.named(call.backend)
    if call.probs:   # ce/soft_targets.py: F.cross_entropy's probability targets
        return soft.cross_entropy(call, impl, rows)
    opts, flat_target = call.opts, call.target
    ce_rows, lse, lse_lo, predicted = impl.cross_entropy_rows(
        rows, flat_target, call.class_weights, opts, inplace_backward, return_stats)
    token_weight = None
    if opts.use_token_scaling:
        token_weight = target_probability(rows, flat_target, lse.detach(), lse_lo, opts)
    return red.loss_and_stats(ce_rows, lse, predicted, flat_target, opts, reduction, call.scales, call.lead,
                              return_stats, red.times(token_weight, call.token_weights))


@public_op("linear", hints=dict(weight="the second argument is the LM head's weight (V, H); class weights of the loss are `ce_weight=`"))
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, *, ce_weight: Optional[torch.Tensor] = None,
                         reduction: str = "mean", num_items_in_batch: Union[int, torch.Tensor, None] = None,
                         chunk_size: Optional[int] = None, method: str = "auto",
                         accum_dtype: torch.dtype = torch.float32, return_stats: bool = False,
                         backend: Optional[str] = None, deterministic: Optional[bool] = None,
                         token_weights: Optional[torch.Tensor] = None, logits_dtype: str = "float32",
                         batch_invariant: bool = False,
                         **options: Unpack[LossOptionValues]) -> Union[torch.Tensor, CrossEntropyOutput]:
    """The LM head fused with the loss: ``cross_entropy(hidden @ weight.T + bias, target)`` without
    ever allocating the BT x V logits.

    Args:
        hidden: ``(..., H)`` float32 / bfloat16 / float16 (the last hidden states).
        weight: ``(V, H)``, the LM head in ``nn.Linear`` layout, same dtype as ``hidden``.
        target: ``(...)`` = ``hidden.shape[:-1]``, int64 or int32; or class probabilities: a float32 /
            bfloat16 / float16 / float64 tensor of ``hidden.shape[:-1] + (V,)`` (dtype independent of the
            operands'), with :func:`cross_entropy`'s probability-target semantics (label smoothing mixes
            with the uniform first; ``ce_weight``, z-loss, softcap, ``logit_scale``, ``token_weights``,
            ``return_stats``; no row ignored; ``"mean"`` over the rows or ``num_items_in_batch``), every
            reduction with backward. ``method="chunked"``: the backend's probability-target row ops on
            each chunk of logits; ``method="tiled"``: the target streamed block by block with the weight
            (blocks of tokens x a vocabulary block smaller than V, torch ops on the tensors' device on
            EVERY backend: no tiled Triton kernel for probability targets; ``backends/pytorch/
            soft_tiled.py``). Backends ``"torch"`` / ``"triton"``; ``"cute"``: ``NotImplementedError``.
            A constant: one that requires grad is a ``TypeError`` naming ``target.detach()``; a negative
            or NaN value is a ``ValueError`` naming ``target`` (one host sync, the target-range check's
            rule: skipped under torch.compile / CUDA-graph capture). Source: ``ce/linear_soft.py``.
        bias: optional ``(V,)``, same dtype as ``hidden``.
        ce_weight: optional ``(V,)`` class weights of the loss.
        reduction, num_items_in_batch, ``**options`` (the loss options, listed below): as in
            :func:`cross_entropy`, on fp32 logits (``logits_dtype``); the loss math is fp32.
        chunk_size: tokens per chunk; logits exist for one chunk at a time (``chunk_size x V``).
            None = automatic: ``max(64, H / 4)`` rows on CPU, ``max(1024, BT * H / V)`` elsewhere, capped
            at BT (rule and its measurement in ``lm_head/head.py``). Only with ``method="chunked"`` (or "auto").
        method: ``"chunked"``: logits of one chunk of tokens at a time (3 matmuls per token);
            ``"tiled"``: no tensor with V or more elements besides ``weight``, ``bias``, ``ce_weight``
            and their gradients (Triton: tiles on chip; PyTorch: blocks of tokens x a vocabulary block
            smaller than V); its backward recomputes the logits tile by tile (4 matmuls per token);
            ``"auto"``: the rule in ``lm_head/head.py`` (chunked today).
        accum_dtype: dtype in which the ``weight`` and ``bias`` gradients accumulate across chunks.
        return_stats: return ``CrossEntropyOutput``; its ``lse`` is 0 on ignored rows (never computed),
            as in :func:`cross_entropy`.
        backend: as in :func:`cross_entropy`.
        deterministic: True: results bitwise identical run to run on the same device (no float atomics:
            with ``method="tiled"`` on Triton the backward runs two atomic-free kernels, 8 instead of 6
            V H FLOPs per token; every other path is deterministic anyway). None (default) follows
            ``torch.are_deterministic_algorithms_enabled()``; False allows the faster atomic backward.
        token_weights: optional ``(...)`` = ``target.shape`` float per-token loss weights, as in
            :func:`cross_entropy` (both methods, every backend: they scale each row's upstream gradient,
            so no kernel sees them; the chunked method's gradient headroom includes their largest finite
            magnitude, on the device). The NaN / infinity check shares the target-range check's sync.
        logits_dtype: ``"float32"`` (default): the logits are formed in fp32 from the operands' values
            (products of bf16 / fp16 values are exact in fp32, summed in fp32; no fp32 copy of the weight:
            ``lm_head/fp32_linear.py``), so bf16 / fp16 results are within fp32 rounding of float64 of
            the same values; ``"input"``: rounded to ``hidden``'s dtype first, as ``F.linear`` (the stock
            composition's values, for exact parity with it). No effect on fp32 operands.
        batch_invariant: True: each row's outputs (``"none"`` rows, ``lse``, the statistics) and its row of
            ``hidden``'s gradient are bitwise the same whatever the other rows are, their number, the
            row's position, the ignored rows and ``chunk_size`` (for a fixed device, dtype, thread
            count and version): the kept rows are processed in chunks of exactly 64 (``"tiled"``: in
            whole token tiles, the backward without atomics), the last padded with ignored zero rows (the
            reduction order: ``lm_head/invariant.py``); ``chunk_size`` has no effect then. The weight and
            bias gradients (sums over rows) are exempt. Class-index targets only (``ValueError`` otherwise).

    Returns:
        The fp32 loss, or ``CrossEntropyOutput``. Gradients of ``hidden``, ``weight``, ``bias`` have their
        tensors' dtypes; every reduction supports backward ("none" recomputes each chunk's logits in
        backward: +2 BT V H FLOPs). Nothing of the caller's is modified.

    Ignored tokens cost no matmul FLOPs: the non-ignored rows are gathered first, which host-syncs once
    per call (skipped under torch.compile and CUDA-graph capture, where every row is computed).

    Raises:
        The errors of :func:`cross_entropy` (V = 0 here is ``weight`` of shape ``(0, H)``), plus
        ``ValueError`` when H = 0 (``hidden`` ``(..., 0)`` or ``weight`` ``(V, 0)``), ``hidden.shape[-1]
        != weight.shape[1]``, ``weight`` is not 2-D, ``bias`` is not ``(V,)``, ``chunk_size`` < 1 or
        ``accum_dtype`` is narrower than ``weight``'s dtype (fewer bits, or fp16 / bf16 for the other), and
        ``TypeError`` when ``hidden``, ``weight`` and ``bias`` dtypes differ, ``chunk_size`` is not an
        integer (a float or a bool) or ``accum_dtype`` is not a floating-point ``torch.dtype``;
        ``ValueError`` for an unknown ``method``, a ``chunk_size`` with ``method="tiled"`` or a
        ``logits_dtype`` not in ``("float32", "input")``, ``batch_invariant=True`` with probability
        targets; ``TypeError`` for a ``batch_invariant`` that is not a bool;
        ``TypeError`` for a ``deterministic`` that is neither None nor a bool.
    """
    call = checked_linear_cross_entropy(
        hidden, weight, target, bias, ce_weight=ce_weight, reduction=reduction, num_items_in_batch=num_items_in_batch,
        chunk_size=chunk_size, method=method, accum_dtype=accum_dtype, return_stats=return_stats, backend=backend,
        deterministic=deterministic, token_weights=token_weights, logits_dtype=logits_dtype,
        batch_invariant=batch_invariant, options=options)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    if call.probs:   # ce/linear_soft.py: probability targets
        return linear_soft.linear_cross_entropy(call, flat_hidden, weight, bias)
    loss, lse, predicted, token_weight = linear_function.linear_cross_entropy(call, flat_hidden, weight, bias)
    if reduction == "none":
        loss = loss.reshape(call.lead)
    if not return_stats:
        return loss
    return red.stats(loss, lse, predicted, call.target, call.opts, reduction, call.scales, call.lead, token_weight)
