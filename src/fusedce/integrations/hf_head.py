"""The LM head of a Hugging Face causal LM, seen from the outside: which module it is, and what the family
does to its output (``logit_transform``, checked once by ``verify_transform``).

The loss itself is computed inside the head's call (``hf_call.HeadCall``) during the family's own
``forward``, which keeps doing everything it does before the head (cache, masks, position ids,
``logits_to_keep`` slicing, MoE router logits, extra inputs such as GPT-2's ``token_type_ids``), so
nothing of it is re-implemented here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn

from .hf_call import PROBE_VALUES


@dataclasses.dataclass(frozen=True)
class LogitTransform:
    """What the family applies to the head's output ``h @ W.T + b`` before the loss:
    ``z = softcap * tanh(scale * logits / softcap)`` (each part optional)."""

    scale: float = 1.0
    softcap: Optional[float] = None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        z = x * self.scale if self.scale != 1.0 else x
        return z if self.softcap is None else torch.tanh(z / self.softcap) * self.softcap


def output_head(model: nn.Module) -> nn.Module:
    """``model.get_output_embeddings()``, checked to be a module. What it computes is checked by
    ``hf_adapters.kind`` (``ValueError``); its weight's shape inside its own call (a ZeRO-3 or FSDP2
    partition may be empty or 1-D outside it)."""
    name = type(model).__name__
    getter = getattr(model, "get_output_embeddings", None)
    if not callable(getter):
        raise TypeError(f"{name} has no get_output_embeddings(): patch_causal_lm needs a Hugging Face "
                        "*ForCausalLM model whose LM head is an nn.Linear-like module")
    head = getter()
    if not isinstance(head, nn.Module):
        raise TypeError(f"{name}.get_output_embeddings() returned {type(head).__name__}, not a module: "
                        "patch_causal_lm needs the LM head as an nn.Linear-like module")
    return head


def base_model(model: nn.Module) -> nn.Module:
    """The decoder that returns the last hidden state: ``model.model``, ``model.transformer`` or
    ``model.base_model`` (Hugging Face's ``base_model_prefix``), whichever is a different module."""
    for attr in ("model", "transformer", "base_model"):
        found = getattr(model, attr, None)
        if isinstance(found, nn.Module) and found is not model:
            return found
    raise TypeError(f"{type(model).__name__} has no base model (looked for .model, .transformer and "
                    ".base_model): patch_causal_lm needs a *ForCausalLM whose decoder returns the last "
                    "hidden state")


def logit_transform(config) -> LogitTransform:
    """The post-head transform a family's config declares:

    - ``final_logit_softcapping`` (Gemma 2, Gemma 3): softcap.
    - ``logit_scale`` (Cohere, Cohere 2: ``logits * logit_scale``): scale.
    - ``logits_scaling`` (Granite: ``logits / logits_scaling``): scale = 1 / logits_scaling.
    Llama, Mistral, Qwen2/3, Gemma, Phi3, GPT-2 declare none.
    """
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = 1.0
    if isinstance(getattr(config, "logit_scale", None), (int, float)):
        scale = float(config.logit_scale)
    if isinstance(getattr(config, "logits_scaling", None), (int, float)):
        scale = 1.0 / float(config.logits_scaling)
    if not math.isfinite(scale) or scale == 0.0:
        raise ValueError(f"the config's logit scale {scale} is not a finite non-zero number")
    return LogitTransform(scale=scale, softcap=None if softcap is None else float(softcap))


def verify_transform(capture, logits, transform: LogitTransform, model_name: str) -> None:
    """Check that the forward turned the placeholder into ``transform.apply(placeholder)`` (one host sync;
    run once per patch). ``ValueError`` if the family does something else to its logits."""
    placeholder = capture.placeholder
    if not isinstance(logits, torch.Tensor) or logits.shape != placeholder.shape:
        raise ValueError(f"{model_name}.forward does not return its LM head's output as `logits`: "
                         "patch_causal_lm cannot tell what it does to the logits")
    got = logits.detach().reshape(-1, placeholder.shape[-1])[:1].float()
    expected = transform.apply(placeholder.reshape(-1, placeholder.shape[-1])[:1].float())
    if not torch.allclose(got, expected, rtol=1e-2, atol=1e-3):
        raise ValueError(
            f"{model_name}.forward transforms the LM head's output in a way its config does not declare "
            f"(probe {list(PROBE_VALUES)} -> {got[0].tolist()}, expected {expected[0].tolist()} for "
            f"scale={transform.scale}, softcap={transform.softcap}): patch_causal_lm would train a "
            "different loss, so it refuses; call the model unpatched")
