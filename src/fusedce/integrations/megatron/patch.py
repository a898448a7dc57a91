"""``fusedce.patch_megatron(model, **loss_options)`` / ``unpatch_megatron(model)``: a Megatron-core ``GPTModel``
computes its language-model loss through the vocabulary-parallel fused linear cross-entropy."""
from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import torch
from torch import nn

from fusedce.core.entrance import public_op
from fusedce.integrations.megatron import head
from fusedce.integrations.megatron.options import validate_options
from fusedce.integrations.megatron.version import check_megatron, megatron_core

_STATE = "_fusedce_megatron"
_MODEL_ATTRS = ("forward", "_postprocess", "compute_language_model_loss")


@dataclasses.dataclass
class _Patch:
    loss_options: dict
    saved: dict                      # (owner, attribute) -> the instance attribute it had before, or None
    active: bool = False             # inside a labelled _postprocess
    token_weights: Optional[torch.Tensor] = None
    log_probs: Optional[dict] = None  # megatron_token_log_probs' options during its call


def gpt_model(model: nn.Module) -> nn.Module:
    """The ``GPTModel`` inside ``model`` (Megatron's DDP / ``Float16Module`` wrappers hold it as ``.module``);
    ``TypeError`` when there is none."""
    megatron_core()
    from megatron.core.models.gpt.gpt_model import GPTModel
    inner, seen = model, 0
    while not isinstance(inner, GPTModel) and isinstance(getattr(inner, "module", None), nn.Module) and seen < 8:
        inner, seen = inner.module, seen + 1
    if not isinstance(inner, GPTModel):
        raise TypeError(f"fusedce.patch_megatron expects a megatron.core GPTModel (or a wrapper holding one as "
                        f".module), got {type(model).__name__}")
    return inner


def _check_model(gpt) -> None:
    from megatron.core.config_logger import has_config_logger_enabled
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    if not gpt.post_process:
        raise ValueError("fusedce.patch_megatron: this GPTModel has no post_process (a pipeline stage before the "
                         "last): it computes no loss; patch the model chunk of the last pipeline stage only")
    layer = getattr(gpt, "output_layer", None)
    if not isinstance(layer, ColumnParallelLinear):
        raise TypeError(f"fusedce.patch_megatron: output_layer is {type(layer).__name__}, not megatron.core's "
                        "tensor_parallel.ColumnParallelLinear (the local layer spec's head); a Transformer Engine "
                        "or other head is not supported")
    config = gpt.config
    if config.sequence_parallel or layer.sequence_parallel:
        raise NotImplementedError("fusedce.patch_megatron: sequence_parallel=True is not supported (the hidden "
                                  "states reach the head sequence-sharded); set sequence_parallel=False")
    if config.defer_embedding_wgrad_compute:
        raise NotImplementedError("fusedce.patch_megatron: defer_embedding_wgrad_compute=True is not supported "
                                  "(the fused op computes the head's weight gradient in its own backward)")
    if has_config_logger_enabled(config):
        raise NotImplementedError("fusedce.patch_megatron: the config logger (config_logger_dir) logs the logits, "
                                  "which the patched model never forms; unset config_logger_dir")


def _set(state: _Patch, owner: nn.Module, name: str, value) -> None:
    state.saved[(owner, name)] = owner.__dict__.get(name)
    setattr(owner, name, value)


def _install(gpt, state: _Patch) -> None:
    stock_forward, stock_post, stock_loss = gpt.forward, gpt._postprocess, gpt.compute_language_model_loss
    layer = gpt.output_layer
    stock_layer = layer.forward
    forward_signature, post_signature = inspect.signature(stock_forward), inspect.signature(stock_post)

    def forward(*args, token_weights: Optional[torch.Tensor] = None, **kwargs):
        _check_call(gpt, state, forward_signature.bind(*args, **kwargs).arguments.get("labels"), token_weights)
        state.token_weights = token_weights
        try:
            return stock_forward(*args, **kwargs)
        finally:
            state.token_weights = None

    def _postprocess(*args, **kwargs):
        if post_signature.bind(*args, **kwargs).arguments.get("labels") is None:
            return stock_post(*args, **kwargs)
        state.active = True
        try:
            return stock_post(*args, **kwargs)
        finally:
            state.active = False

    def output_forward(input_, weight=None, runtime_gather_output=None):
        if not state.active:
            return stock_layer(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if weight is None:
            weight = layer.weight
        if weight is None or weight.shape != (layer.output_size_per_partition, layer.input_size):
            raise RuntimeError(f"fusedce.patch_megatron: the output layer's weight is "
                               f"{None if weight is None else tuple(weight.shape)}, expected "
                               f"{(layer.output_size_per_partition, layer.input_size)}")
        bias = None if layer.skip_bias_add else layer.bias
        return head.DeferredLogits(input_, weight, bias, layer.tp_group), None

    def compute_language_model_loss(labels, logits):
        if not isinstance(logits, head.DeferredLogits):
            return stock_loss(labels, logits)
        if state.log_probs is not None:
            return head.log_probs(logits, labels, state.log_probs)
        return head.loss(logits, labels, state.loss_options, state.token_weights)

    _set(state, gpt, "forward", forward)
    _set(state, gpt, "_postprocess", _postprocess)
    _set(state, gpt, "compute_language_model_loss", compute_language_model_loss)
    _set(state, layer, "forward", output_forward)


def _check_call(gpt, state: _Patch, labels: Optional[torch.Tensor], weights) -> None:
    """A call's ``labels`` and ``token_weights`` checked before the model runs."""
    if weights is not None:
        if labels is None:
            raise ValueError("fusedce.patch_megatron: token_weights was given without labels")
        if gpt.config.mtp_num_layers:
            raise ValueError("fusedce.patch_megatron: token_weights with multi-token prediction heads "
                             "(mtp_num_layers) is not supported: Megatron rolls the labels per head; use loss_mask")
        if not isinstance(weights, torch.Tensor) or weights.shape != labels.shape:
            raise ValueError(f"fusedce.patch_megatron: token_weights must be a tensor of the labels' shape "
                             f"{tuple(labels.shape)} ([b, s]), got "
                             f"{tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__}")
    if state.log_probs is not None and gpt.config.mtp_num_layers and labels is not None:
        raise ValueError("fusedce.megatron_token_log_probs: a model with multi-token prediction heads "
                         "(mtp_num_layers) is not supported (their losses need the main head's loss)")


@public_op("integration")
def patch_megatron(model: nn.Module, **loss_options) -> nn.Module:
    """Make a Megatron-core ``GPTModel`` compute its loss with the vocabulary-parallel fused linear
    cross-entropy (:func:`fusedce.distributed.vocab_parallel_linear_cross_entropy`) over its output
    layer's tensor-parallel group (``parallel_state.get_tensor_model_parallel_group()`` by default).
    Patches this instance only, in place; returns ``model``.

    When ``forward`` receives ``labels`` (``[b, s]`` int, the next-token ids Megatron expects), it returns
    what Megatron returns, the ``[b, s]`` fp32 per-token cross-entropy, with equal values and gradients
    (hidden states, every parameter, the tied embedding or the untied output layer), but the ``[s, b,
    V/TP]`` logits are never formed: ``output_layer`` does not multiply (its module call and hooks still
    run). Multi-token prediction heads (``mtp_num_layers``) go through the same path. Without ``labels``
    the stock forward runs and returns the logits. Megatron's loss mask and reduction are applied by the
    caller, as before. Precision: the logits are formed in fp32 from the operands' values (bf16 / fp16
    models included; the stock head rounds them to the model's dtype before its fp32 cross-entropy), so
    fp32 models agree to fp32 rounding and bf16 ones to bf16 precision.

    Args:
        model: a ``GPTModel`` or a wrapper holding one as ``.module`` (Megatron's DDP, ``Float16Module``),
            on the last pipeline stage (``post_process``), with megatron-core's ``ColumnParallelLinear``
            head (the local layer spec).
        **loss_options: ``label_smoothing`` (torch's definition over the global V), ``lse_square_scale``
            (z-loss), ``softcap``, ``logit_scale``, ``use_token_scaling``, ``ignore_index`` (default -100:
            labels of that value get loss 0), ``deterministic``, ``chunk_size``, ``accum_dtype``, ``backend``:
            as in :func:`fusedce.distributed.vocab_parallel_linear_cross_entropy`. The forward also takes
            ``token_weights=`` (``[b, s]`` float, each token's loss multiplied by it, no gradient).

    Raises:
        ImportError: megatron-core is not installed.
        RuntimeError: the installed megatron-core is not 0.16.x, or the source of the pieces the patch
            relies on differs (``version.py``).
        TypeError: ``model`` holds no ``GPTModel``; its ``output_layer`` is not ``ColumnParallelLinear``;
            an unknown loss option (``reduction``, ``num_items_in_batch`` included).
        ValueError: no ``post_process`` (not the last pipeline stage); a bad option value. At a call:
            ``token_weights`` of another shape than ``labels`` or without labels, or with MTP heads.
        NotImplementedError: ``sequence_parallel``, ``defer_embedding_wgrad_compute``, the config logger.
    """
    check_megatron()
    gpt = gpt_model(model)
    _check_model(gpt)
    options = validate_options(loss_options)
    unpatch_megatron(gpt)
    state = _Patch(options, {})
    _install(gpt, state)
    gpt.__dict__[_STATE] = state
    return model


@public_op("integration")
def unpatch_megatron(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_megatron` on ``model`` (its ``GPTModel``); a no-op when it is not patched.
    Returns ``model``."""
    gpt = gpt_model(model)
    state = gpt.__dict__.pop(_STATE, None)
    if state is None:
        return model
    for (owner, name), before in state.saved.items():
        if before is None:
            owner.__dict__.pop(name, None)
        else:
            setattr(owner, name, before)
    return model


def patched_state(gpt) -> Optional[_Patch]:
    """The patch's state on ``gpt``, or None when it is not patched."""
    return gpt.__dict__.get(_STATE)
