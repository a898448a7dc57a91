"""The body of TRL's fused-LM-head forward, computed through fusedce (installed by ``patch.py``)."""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import nn

from fusedce.rl.log_probs import linear_token_log_probs
from fusedce.integrations.hf.call import HeadCall, module_name

STATS = ("log_sum_sq_probs", "mean_logits", "is_top1")
# patch_trl's options, passed to every linear_token_log_probs call (process-wide, as the patch)
OPTIONS = {"batch_invariant": False, "logits_dtype": "float32"}


class Settings(NamedTuple):
    """The eight values TRL 1.16's ``add_fused_lm_head`` closes over, in its closure's order."""

    backbone_attr: str
    cast_lm_head_to_fp32: bool
    final_logit_softcapping: object
    logit_scale: float
    original_forward: object
    outputs: tuple
    temperature: float
    text_config: object


def forward(model: nn.Module, settings: Settings, args: tuple, kwargs: dict, fused_lm_head, labels, shift_labels,
            num_items_in_batch):
    """``model.forward`` as TRL's fused head defines it (module docstring), the head through fusedce."""
    if not fused_lm_head:
        extra = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
        return settings.original_forward(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
    from trl.trainer.utils import FusedCausalLMOutput

    config = settings.text_config
    kwargs["use_cache"] = False
    if getattr(config, "output_router_logits", False):
        kwargs.setdefault("output_router_logits", True)
    backbone = getattr(model, settings.backbone_attr)(*args, **kwargs)
    if shift_labels is None:
        hidden, labels = backbone.last_hidden_state[:, :-1], labels[:, 1:]
    else:
        hidden, labels = backbone.last_hidden_state, shift_labels
    head = model.get_output_embeddings()
    device = head.weight.device
    hidden, labels = hidden.to(device), labels.to(device)
    mask = labels != -100
    autocast = contextlib.nullcontext()
    if settings.cast_lm_head_to_fp32:
        hidden = hidden.float()
        autocast = torch.autocast(hidden.device.type, enabled=False)
    per_token, where = {}, module_name(model, head)

    def compute(h, weight, bias):   # inside the head's call: its hooks have run, the adapters recorded
        per_token.update(_head_outputs(h, weight, bias, labels, settings, where))
        grads = [per_token[k] for k in ("log_probs", "entropy") if per_token.get(k) is not None]
        return grads[0] if len(grads) == 1 else torch.stack(grads)
    with autocast, HeadCall(head, where, compute, keep_logits=False, verify=False) as call:
        placeholder = head(hidden)
    tied = call.final_loss(placeholder)   # the backward reaches the head's output (hooks) before the loss
    if per_token.get("entropy") is None:
        per_token["log_probs"] = tied
    else:
        per_token["log_probs"], per_token["entropy"] = tied.unbind(0)
    per_token = {k: None if v is None else v.reshape(mask.shape) for k, v in per_token.items()}
    log_probs = per_token["log_probs"]
    loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
    aux_loss = None
    if kwargs.get("output_router_logits"):
        aux_loss = _load_balancing(model, config, backbone, kwargs.get("attention_mask"))
        loss = loss + getattr(config, "router_aux_loss_coef", 0.0) * aux_loss
    return FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=aux_loss, **per_token)


def _head_outputs(hidden, weight, bias, labels, settings: Settings, where: str) -> dict:
    """TRL's per-token fields (flattened, (N,)) of the head's pieces ``hidden`` (..., H'), ``weight``
    (V, H'), ``bias``; the ones not in ``settings.outputs`` are None (``log_probs`` always)."""
    outputs = settings.outputs
    if settings.cast_lm_head_to_fp32:   # TRL: fp32 hidden states, the head's weight cast up for the matmul
        if hidden.dtype != torch.float32:
            raise ValueError(f"{where}: cast_lm_head_to_fp32 with an adapter on the LM head (its pieces are not "
                             "fp32): fusedce cannot reproduce that head exactly")
        weight = weight.float()
        bias = None if bias is None else bias.float()
    want_entropy, want_stats = "entropy" in outputs, any(name in outputs for name in STATS)
    out = linear_token_log_probs(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), bias,
        temperature=settings.temperature, softcap=settings.final_logit_softcapping,
        logit_scale=settings.logit_scale, return_entropy=want_entropy, return_stats=want_stats, **OPTIONS)
    fields = dict.fromkeys(("log_probs", "entropy") + STATS)
    if want_stats:
        fields.update({name: getattr(out, name) for name in STATS if name in outputs})
    if want_stats or want_entropy:
        fields.update(log_probs=out.log_probs, entropy=out.entropy)
    else:
        fields["log_probs"] = out
    return fields


def _load_balancing(model, config, backbone, attention_mask):
    """The MoE load-balancing loss TRL 1.16 adds (Mixtral's formula, which the MoE families share)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    import transformers
    from packaging.version import Version

    version = Version(transformers.__version__)
    if version < Version("5.0.0") or (config.model_type == "gpt_oss" and version < Version("5.6.0")):
        experts, per_token = model.num_experts, model.num_experts_per_tok
    else:
        experts, per_token = config.num_experts, config.num_experts_per_tok
    return load_balancing_loss_func(backbone.router_logits, experts, per_token, attention_mask)
