"""Hugging Face integration: one call makes a causal LM train through :func:`linear_cross_entropy`."""
from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Optional

import torch
from torch import nn

from fusedce.core.entrance import public_op
from fusedce.core.options import check_flag
from fusedce.integrations.hf.adapters import kind as head_kind
from fusedce.integrations.hf.call import HeadCall, module_name
from fusedce.integrations.hf.options import LOSS_OPTIONS, validate_options  # noqa: F401  (hf.LOSS_OPTIONS: the public list)
from fusedce.integrations.hf.fit import choose_transform
from fusedce.integrations.hf.head import base_model, check_causal_loss, describe, logit_transforms, output_head
from fusedce.integrations.hf.loss import causal_loss
from fusedce.integrations.hf.settings import model_config, router_aux_coef, wrapper_setting
from fusedce.integrations.hf.output import as_tuple, replace

_STATE = "_fusedce_patch"
@dataclasses.dataclass
class _Patch:
    original: Optional[object]   # the instance-level forward before patching (None: the class's)
    signature: inspect.Signature  # the original forward's, without self
    loss_options: dict
    keep_logits: Optional[bool]  # None: the logits when autograd is off (evaluation), not in training
    transforms: tuple            # the candidate post-head transforms (hf_head.logit_transforms); one once
    verified: bool = False       # checked against the family's forward (first labelled call)


@public_op("integration")
def patch_causal_lm(model: nn.Module, *, keep_logits: Optional[bool] = None, **loss_options) -> nn.Module:
    """Make ``model`` (a Hugging Face ``*ForCausalLM``) compute its training loss with the fused
    :func:`fusedce.linear_cross_entropy`; patches this instance in place and returns it.

    What the patched forward does: docs/integrations.md (Hugging Face, the patched forward). Patching again
    replaces the options; :func:`unpatch_causal_lm` undoes it.

    Args:
        model: a causal LM whose ``get_output_embeddings()`` is a linear head called once on the base model's
            last hidden state.
        keep_logits: None (the logits only when autograd is off), True (always) or False (never).
        **loss_options: the options of :func:`fusedce.linear_cross_entropy`, checked here.

    Raises:
        TypeError: the model's class instead of an instance; an unknown option or a bad ``keep_logits``; no output
            embedding or base model; at a call, a head called with extra arguments or not exactly once.
        ValueError: a bad option value, a ``softcap`` contradicting the config, a head or adapter the patch
            cannot apply exactly, an encoder-decoder or unshifted family; at a call, the same for a replaced
            head, labels that do not match the kept positions, a logit transform it cannot reproduce.
        IndexError: (at a call) a label neither ``ignore_index`` nor in ``[0, V)``, named as ``labels[b, t]``.
    """
    if isinstance(model, type):
        raise TypeError(f"patch_causal_lm patches a model instance, got the class {model.__name__}: pass "
                        f"{model.__name__}(config) or {model.__name__}.from_pretrained(...)")
    _make_verifying_forward()
    head = output_head(model)
    head_kind(head, module_name(model, head))
    base_model(model)
    check_causal_loss(model)
    transforms = logit_transforms(model_config(model))
    options = validate_options(model, loss_options, transforms[0])
    state = getattr(model, _STATE, None)
    keep_logits = None if keep_logits is None else check_flag("keep_logits", keep_logits)
    if state is not None:  # idempotent: new options, same single wrapper
        state.loss_options, state.keep_logits, state.transforms = options, keep_logits, transforms
        state.verified = False
        return model
    original = model.__dict__.get("forward")
    signature = inspect.signature(model.forward)

    def forward(self, *args, **kwargs):
        return _forward(self, *args, **kwargs)

    # Bound method (not a closure): accelerate re-binds ``model.forward.__func__``, deepcopy re-binds to
    # the copy. The original's signature keeps Trainer's column filter and generate's introspection right.
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[self_param, *signature.parameters.values()])
    forward.__doc__ = f"{type(model).__name__}.forward, patched by fusedce.patch_causal_lm."
    object.__setattr__(model, _STATE, _Patch(original, signature, options, keep_logits, transforms))
    model.forward = types.MethodType(forward, model)
    return model


@public_op("integration")
def unpatch_causal_lm(model: nn.Module) -> nn.Module:
    """Restore the forward ``model`` had before :func:`patch_causal_lm` (no-op if not patched)."""
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return model
    if state.original is None:
        model.__dict__.pop("forward", None)
    else:
        model.forward = state.original
    return model


def _call_original(model, state: _Patch, args, kwargs):
    if state.original is not None:
        return state.original(*args, **kwargs)
    return type(model).forward(model, *args, **kwargs)


def _as_kwargs(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """Positional arguments named by the original signature, so ``labels`` can be found and removed."""
    if not args:
        return dict(kwargs)
    merged = {}
    for name, value in signature.bind_partial(*args, **kwargs).arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            raise TypeError("patch_causal_lm: extra positional arguments are not supported; pass keywords")
        merged.update(value if kind is inspect.Parameter.VAR_KEYWORD else {name: value})
    return merged


def _forward(model, *args, **kwargs):
    state: _Patch = model.__dict__[_STATE]
    kwargs = _as_kwargs(state.signature, args, kwargs)
    if kwargs.get("fused_lm_head"):  # TRL's own fused LM head (add_fused_lm_head) answers this call
        return _call_original(model, state, (), kwargs)
    if not state.verified and kwargs.get("labels") is not None and torch.compiler.is_compiling():
        return _verifying_forward(model, **kwargs)   # a graph break: this call runs eagerly (see below)
    token_scaling = kwargs.pop("use_token_scaling", None)   # Liger's forward keyword (TRL's "dft")
    token_weights = kwargs.pop("token_weights", None)
    labels = kwargs.pop("labels", None)
    if labels is None:
        if token_weights is not None:
            raise ValueError("token_weights weigh the loss of the labels: pass labels with them")
        return _call_original(model, state, (), kwargs)
    num_items = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    config = model_config(model)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:  # transformers' can_return_tuple rule
        return_dict = wrapper_setting(model, "return_dict", True)
    name = type(model).__name__
    head = output_head(model)
    keep = state.keep_logits if state.keep_logits is not None else not torch.is_grad_enabled()
    verify = not state.verified

    # Several candidate transforms (a multimodal config whose text config declares one, which some wrappers
    # ignore): the verifying call computes the loss for each, inside the head's call, and keeps the one the
    # forward applied (the others get a zero gradient: one extra fused forward and backward, once).
    candidates = state.transforms if verify else state.transforms[:1]

    def compute(hidden, weight, bias):  # runs inside the head's call (its hooks have run)
        losses = [causal_loss(model, state.loss_options, t, hidden, weight, bias, labels, shift_labels, num_items,
                              token_scaling, token_weights) for t in candidates]
        return losses[0] if len(losses) == 1 else torch.stack(losses)
    with HeadCall(head, module_name(model, head), compute, keep, verify) as call:
        out = _call_original(model, state, (), {**kwargs, "return_dict": True})
    if not hasattr(out, "logits"):
        raise TypeError(f"{name}.forward(return_dict=True) returned {type(out).__name__}, not a model "
                        "output with `logits`")
    if call.calls != 1:
        raise TypeError(f"{name}.forward called its output embeddings {call.calls} times (expected once, "
                        "as self.lm_head(hidden_states)): patch_causal_lm cannot find the final hidden "
                        "states of this model")
    chosen = 0
    if verify and call.head_rows is not None:
        chosen, transform, settled = choose_transform(out.logits, call.head_rows, call.rows, call.head_shape,
                                                      candidates, config, name, probe=not keep)
        if chosen is None:   # read off the forward: this call's loss again, for that transform
            validate_options(model, state.loss_options, transform)
            call.recompute(lambda h, w, b: causal_loss(model, state.loss_options, transform, h, w, b, labels,
                                                       shift_labels, num_items, token_scaling, token_weights),
                           name, describe(transform))
            candidates, chosen = (transform,), 0
        if settled:   # else (real logits too small to tell) the next labelled call looks again
            state.transforms, state.verified = (transform,), True
    loss = call.final_loss(out.logits)
    if len(candidates) > 1:
        loss = loss[chosen]
    aux = getattr(out, "aux_loss", None)
    coef = None if aux is None else router_aux_coef(model)
    if coef:
        loss = loss + coef * aux.to(loss.device)
    out = replace(out, loss=loss, logits=out.logits if keep else None)
    return out if return_dict else as_tuple(out)


# The first labelled call reads the family's logit transform off its forward (host reads of the probe row):
# under torch.compile it runs outside the graph, eagerly; the next call is traced with the transform found
# (``state.verified`` is guarded, so the change recompiles). With ``fullgraph=True`` the graph break is an error
# whose message, this reason, says how to proceed.
_REASON = ("fusedce.patch_causal_lm checks the family's logit transform on the first labelled call, outside the "
           "graph: make one labelled forward call of the patched model before compiling it with fullgraph=True, "
           "or compile without fullgraph")
_verifying_forward = None   # made by patch_causal_lm (eagerly: torch.compiler.disable imports Dynamo, ~1.3 s)


def _make_verifying_forward() -> None:
    global _verifying_forward
    if _verifying_forward is None:
        try:
            _verifying_forward = torch.compiler.disable(_forward, reason=_REASON)
        except TypeError:   # a torch whose disable takes no reason (before 2.8): the same graph break, torch's message
            _verifying_forward = torch.compiler.disable(_forward)
