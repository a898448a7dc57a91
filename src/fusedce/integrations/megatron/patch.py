"""``fusedce.patch_megatron(model, **loss_options)`` / ``unpatch_megatron(model)``: a Megatron-core ``GPTModel``
computes its language-model loss through the vocabulary-parallel fused linear cross-entropy."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Optional

import torch
from torch import nn

from fusedce.core.entrance import public_op
from fusedce.integrations.megatron import acceptance, head
from fusedce.integrations.megatron.options import validate_options
from fusedce.integrations.megatron.sequence import gather_sequence
from fusedce.integrations.megatron.version import Release, check_megatron, megatron_core

_STATE = "_fusedce_megatron"


@dataclasses.dataclass
class _Patch:
    loss_options: dict
    saved: dict                      # (owner, attribute) -> the instance attribute it had before, or None
    release: Release
    active: bool = False             # inside a labelled call
    token_weights: Optional[torch.Tensor] = None
    log_probs: Optional[dict] = None  # megatron_token_log_probs' options during its call


def gpt_model(model: nn.Module, caller: str = "fusedce.patch_megatron") -> nn.Module:
    """The ``GPTModel`` inside ``model`` (Megatron's DDP / ``Float16Module`` wrappers hold it as ``.module``);
    ``TypeError`` when there is none (a ``HybridModel`` named: not supported)."""
    megatron_core()
    from megatron.core.models.gpt.gpt_model import GPTModel
    inner, seen = model, 0
    while not isinstance(inner, GPTModel) and isinstance(getattr(inner, "module", None), nn.Module) and seen < 8:
        inner, seen = inner.module, seen + 1
    if type(inner).__name__ == "HybridModel":
        raise TypeError(f"{caller}: HybridModel (megatron-core 0.18+) is not supported: it computes "
                        "its logits and loss inline in forward, with no output_processor hook; build a GPTModel "
                        "or leave the model unpatched")
    if not isinstance(inner, GPTModel):
        raise TypeError(f"{caller} expects a megatron.core GPTModel (or a wrapper holding one as "
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
                        "tensor_parallel.ColumnParallelLinear; a Transformer Engine (or other) head is not "
                        "supported: build the model with the local layer spec (get_gpt_layer_local_spec, "
                        "transformer_impl='local')")
    if getattr(layer, "gtp_remat_size", 1) > 1:
        raise NotImplementedError(f"fusedce.patch_megatron: the output layer's weight is GTP-sharded "
                                  f"(gtp_remat_size={layer.gtp_remat_size}); the fused head needs each rank's "
                                  "whole vocabulary shard: run without the gtp_remat group (size 1)")
    config = gpt.config
    if config.defer_embedding_wgrad_compute:
        raise NotImplementedError("fusedce.patch_megatron: defer_embedding_wgrad_compute=True is not supported "
                                  "(the fused op computes the head's weight gradient in its own backward)")
    if has_config_logger_enabled(config):
        raise NotImplementedError("fusedce.patch_megatron: the config logger (config_logger_dir) logs the logits, "
                                  "which the patched model never forms; unset config_logger_dir")


def _set(state: _Patch, owner: nn.Module, name: str, value) -> None:
    state.saved[(owner, name)] = owner.__dict__.get(name)
    setattr(owner, name, value)


def _output_processor(*, hidden_states, output_layer, output_weight, labels, runtime_gather_output,
                      compute_language_model_loss, scale_logits, **_context):
    """The ``output_processor`` hook of ``GPTModel.forward`` (0.18+): the stock head's three steps, each
    of them the patched one (deferred logits, their MuP scale, the fused loss)."""
    logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
    return compute_language_model_loss(labels, scale_logits(logits))


def _install(gpt, state: _Patch) -> None:
    release, config = state.release, gpt.config
    stock_forward, stock_post, stock_loss = gpt.forward, gpt._postprocess, gpt.compute_language_model_loss
    layer = gpt.output_layer
    stock_layer = layer.forward
    forward_signature, post_signature = inspect.signature(stock_forward), inspect.signature(stock_post)

    @contextlib.contextmanager
    def active(on: bool):
        before, state.active = state.active, on
        try:
            yield
        finally:
            state.active = before

    def forward(*args, token_weights: Optional[torch.Tensor] = None, **kwargs):
        bound = forward_signature.bind(*args, **kwargs).arguments
        labels = bound.get("labels")
        _check_call(gpt, state, labels, token_weights)
        hook = release.output_processor and labels is not None and bound.get("output_processor") is None
        if hook:   # 0.18+: the head through the hook; MTP heads (before it) through the patched pieces
            kwargs["output_processor"] = _output_processor
        state.token_weights = token_weights
        try:
            with active(hook or state.active):
                return stock_forward(*args, **kwargs)
        finally:
            state.token_weights = None

    def _postprocess(*args, **kwargs):   # 0.16 / 0.17: active while a labelled _postprocess runs
        with active(post_signature.bind(*args, **kwargs).arguments.get("labels") is not None):
            return stock_post(*args, **kwargs)

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
        if layer.sequence_parallel:
            input_ = gather_sequence(input_, layer.tp_group)
        return head.DeferredLogits(input_, weight, bias, layer.tp_group), None

    def compute_language_model_loss(labels, logits):
        if not isinstance(logits, head.DeferredLogits):
            return stock_loss(labels, logits)
        if state.log_probs is not None:
            return head.log_probs(logits, labels, state.log_probs)
        predictions = release.acceptance_counts and gpt.training and bool(config.mtp_num_layers)
        return head.loss(logits, labels, state.loss_options, state.token_weights, predictions)

    _set(state, gpt, "forward", forward)
    if not release.output_processor:
        _set(state, gpt, "_postprocess", _postprocess)
    _set(state, gpt, "compute_language_model_loss", compute_language_model_loss)
    _set(state, layer, "forward", output_forward)
    if release.scale_logits:
        stock_scale = gpt._scale_logits

        def _scale_logits(logits):
            if not isinstance(logits, head.DeferredLogits):
                return stock_scale(logits)
            if config.use_mup and config.mup_output_mult != 1.0:
                return head.scaled(logits, config.mup_output_mult)
            return logits

        _set(state, gpt, "_scale_logits", _scale_logits)
    if release.acceptance_counts:
        acceptance.install()


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
    """Make a Megatron-core ``GPTModel`` compute its loss with
    :func:`fusedce.distributed.vocab_parallel_linear_cross_entropy` over its output layer's tensor-parallel group.

    Patches this instance in place and returns it. With ``labels`` (``[b, s]`` int) ``forward`` returns
    Megatron's ``[b, s]`` fp32 per-token loss, equal values and gradients, without forming the ``[s, b, V/TP]``
    logits; without labels the stock forward runs. Releases, routes and what is refused: docs/megatron.md;
    semantics: docs/contract.md, "Integrations".

    Args:
        model: a ``GPTModel`` or a wrapper holding one as ``.module``, on the last pipeline stage, with
            megatron-core's ``ColumnParallelLinear`` head.
        **loss_options: the options of :func:`fusedce.distributed.vocab_parallel_linear_cross_entropy` but
            ``reduction`` / ``num_items_in_batch``; ``forward`` also takes ``token_weights=`` (``[b, s]`` float).

    Raises:
        ImportError: megatron-core is not installed.
        RuntimeError: an unsupported megatron-core release, or a changed source of the pieces relied on.
        TypeError: no ``GPTModel`` in ``model``, a head that is not ``ColumnParallelLinear``, an unknown option.
        ValueError: not the last pipeline stage; a bad option value; at a call, bad ``token_weights`` or MTP
            heads with them.
        NotImplementedError: ``defer_embedding_wgrad_compute``, the config logger, a GTP-sharded output weight.
    """
    release = check_megatron()
    gpt = gpt_model(model)
    _check_model(gpt)
    options = validate_options(loss_options)
    unpatch_megatron(gpt)
    state = _Patch(options, {}, release)
    _install(gpt, state)
    gpt.__dict__[_STATE] = state
    return model


@public_op("integration")
def unpatch_megatron(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_megatron` on ``model`` (its ``GPTModel``); a no-op when it is not patched.
    Returns ``model``."""
    gpt = gpt_model(model, "fusedce.unpatch_megatron")
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
