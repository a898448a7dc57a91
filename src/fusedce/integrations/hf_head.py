"""The LM head of a Hugging Face causal LM, seen from the outside: what it is, what the family does to its
output, and a capture that takes its input (the final hidden states) without computing the logits.

Why capture instead of calling the base model ourselves: the family's own ``forward`` then keeps doing
everything it does before the head (cache, masks, position ids, ``logits_to_keep`` slicing, MoE router
logits, extra inputs such as GPT-2's ``token_type_ids``), so nothing of it is re-implemented here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn

# Values the placeholder "logits" hold (one column each). The family's forward applies its post-head
# transform to them; ``verify_transform`` checks that it is exactly the one ``logit_transform`` read
# from the config. -24 sits where a 30-softcap (Gemma 2) is visibly non-linear; both are exact in bf16.
PROBE_VALUES = (1.0, -24.0)


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
    """``model.get_output_embeddings()``, checked to be a linear head with a ``(V, H)`` weight."""
    name = type(model).__name__
    getter = getattr(model, "get_output_embeddings", None)
    if not callable(getter):
        raise TypeError(f"{name} has no get_output_embeddings(): patch_causal_lm needs a Hugging Face "
                        "*ForCausalLM model whose LM head is an nn.Linear-like module")
    head = getter()
    if not isinstance(head, nn.Module):
        raise TypeError(f"{name}.get_output_embeddings() returned {type(head).__name__}, not a module: "
                        "patch_causal_lm needs the LM head as an nn.Linear-like module")
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"the output embeddings of {name} ({type(head).__name__}) have no 2-D `weight` "
                        "(V, H): patch_causal_lm supports linear LM heads only")
    bias = getattr(head, "bias", None)
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != weight.shape[:1]):
        raise TypeError(f"the output embeddings of {name} have a `bias` that is not a ({weight.shape[0]},) "
                        "tensor")
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


class HeadCapture:
    """Context manager: while active, calling ``head`` records its input and returns either the real
    logits (``keep_logits=True``) or a ``(..., len(PROBE_VALUES))`` placeholder, so that no ``(BT, V)``
    tensor is made. The head's forward hooks still run (they see the placeholder)."""

    def __init__(self, head: nn.Module, keep_logits: bool):
        self.head, self.keep_logits, self.inputs, self.placeholder = head, keep_logits, [], None

    def _forward(self, hidden, *args, **kwargs):
        self.inputs.append(hidden)
        if self.keep_logits:
            return (self.previous or type(self.head).forward.__get__(self.head))(hidden, *args, **kwargs)
        probe = torch.tensor(PROBE_VALUES, dtype=hidden.dtype, device=hidden.device)
        self.placeholder = probe.expand(*hidden.shape[:-1], len(PROBE_VALUES)).contiguous()
        return self.placeholder

    def __enter__(self) -> "HeadCapture":
        self.previous = self.head.__dict__.get("forward")  # an instance-level forward (accelerate hooks)
        self.head.forward = self._forward
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is None:
            del self.head.forward
        else:
            self.head.forward = self.previous

    def hidden(self, model_name: str) -> torch.Tensor:
        """The one input the head received; ``TypeError`` if the forward never or repeatedly called it."""
        if len(self.inputs) != 1:
            raise TypeError(f"{model_name}.forward called its output embeddings {len(self.inputs)} times "
                            "(expected once, as self.lm_head(hidden_states)): patch_causal_lm cannot "
                            "find the final hidden states of this model")
        return self.inputs[0]


def verify_transform(capture: HeadCapture, logits, transform: LogitTransform, model_name: str) -> None:
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
