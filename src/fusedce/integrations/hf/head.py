"""The LM head of a Hugging Face causal LM, seen from the outside: which module it is, and what the family does to its
output (``logit_transforms``, the transforms its config declares; the one applied is chosen once, or read off the
forward, by ``hf_fit.choose_transform``)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
import textwrap
from typing import Optional

import torch
from torch import nn

from fusedce.integrations.hf.settings import text_configs, wrapper_setting


@dataclasses.dataclass(frozen=True)
class LogitTransform:
    """What the family does to the head's output ``x = h @ W.T + b`` (``(..., V)``, V = the head's rows)
    before its loss: ``z = softcap * tanh(scale * x / softcap)`` (each part optional), then keeps the first
    ``n_classes`` columns only (``z[..., :n_classes]``, a head padded beyond the real vocabulary)."""

    scale: float = 1.0
    softcap: Optional[float] = None
    n_classes: Optional[int] = None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        z = x * self.scale if self.scale != 1.0 else x
        z = z if self.softcap is None else torch.tanh(z / self.softcap) * self.softcap
        return z[..., :self.width(z.shape[-1])]

    def width(self, head_rows: int) -> int:
        """The number of classes the family's logits have for a head of ``head_rows`` rows."""
        return head_rows if self.n_classes is None else min(self.n_classes, head_rows)


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


def check_causal_loss(model: nn.Module) -> None:
    """``ValueError`` unless ``model``'s stock loss is the one the patch computes: Hugging Face's causal LM loss,
    labels shifted by one (``ForCausalLMLoss``)."""
    name = type(model).__name__
    if wrapper_setting(model, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model (config.is_encoder_decoder): its loss is over the "
                         "decoder's unshifted labels, not a causal LM's shifted ones, so patch_causal_lm refuses it")
    for cls in type(model).__mro__:
        forward = cls.__dict__.get("forward")
        try:
            source = _code(forward) if forward is not None else ""
        except (OSError, TypeError, SyntaxError):
            continue
        if "loss_function" in source:
            used = getattr(getattr(model, "loss_function", None), "__name__", "an unknown loss")
            if used == "ForCausalLMLoss":
                return
            raise ValueError(f"{name}.forward computes its loss with {used}, not transformers' ForCausalLMLoss "
                             "(labels shifted by one): patch_causal_lm would train a different loss, so it refuses")
        if re.search(r"CrossEntropyLoss|cross_entropy\(", source):
            if "shift" in source:
                return
            raise ValueError(f"{name}.forward computes a cross-entropy of its logits against labels it does not "
                             "shift (labels aligned with the logits), not transformers' ForCausalLMLoss: "
                             "patch_causal_lm would train a different loss, so it refuses")


def _code(function) -> str:
    """``function``'s code without its docstring and comments (a docstring may say "not shifted")."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function))))
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    return "\n".join(ast.unparse(node) for node in body)


# Config attributes of a post-head transform, and how each enters ``LogitTransform``.
DECLARED = {
    "final_logit_softcapping": "softcap",          # Gemma 2/3/4, PaliGemma 2: softcap * tanh(x / softcap)
    "logit_scale": "scale",                         # Cohere, Cohere 2: x * s
    "lm_head_multiplier": "scale",                  # FalconH1: x * s
    "logits_scaling": "inverse scale",              # Granite (and its vision models): x / s
    "unpadded_vocab_size": "classes",               # Inkling: x[..., :n] (a head padded beyond V)
}


def _declared(*configs) -> dict:
    """``DECLARED`` attributes set to a number, from the first of ``configs`` that sets each."""
    found = {}
    for name in DECLARED:
        for config in configs:
            value = getattr(config, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                found[name] = value
                break
    return found


def _transform(found: dict) -> LogitTransform:
    scale = 1.0
    for name, value in found.items():
        if DECLARED[name] == "scale":
            scale *= float(value)
        elif DECLARED[name] == "inverse scale":
            scale = scale / float(value) if value != 0 else math.inf
    if not math.isfinite(scale) or scale == 0.0:
        raise ValueError(f"the config's logit scale {scale} is not a finite non-zero number")
    softcap = found.get("final_logit_softcapping")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"the config's final_logit_softcapping {softcap} is not a finite number > 0")
    n_classes = found.get("unpadded_vocab_size")
    if n_classes is not None and (not float(n_classes).is_integer() or n_classes < 1):
        raise ValueError(f"the config's unpadded_vocab_size {n_classes} is not an integer >= 1")
    return LogitTransform(scale=scale, softcap=None if softcap is None else float(softcap),
                          n_classes=None if n_classes is None else int(n_classes))


def logit_transforms(config) -> tuple:
    """The post-head transforms ``config`` declares, as candidates for ``hf_fit.choose_transform``: the text
    config's first, then the top-level config's alone if different."""
    configs = text_configs(config)
    if not configs:
        return (LogitTransform(),)
    if len(configs) == 1:
        return (_transform(_declared(config)),)
    first, top = _transform(_declared(*configs)), _transform(_declared(config))
    return (first,) if first == top else (first, top)


# Agreement required between the family's logits and ``LogitTransform.apply`` of what the head returned,
# per dtype of those logits: a few roundings of that dtype (the family may compute its transform in it).
_VERIFY_RTOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def verify_rtol(dtype: torch.dtype) -> float:
    """The relative agreement asked of logits of ``dtype`` (``_VERIFY_RTOL``; 3e-2 for other dtypes)."""
    return _VERIFY_RTOL.get(dtype, 3e-2)


def describe(transform: LogitTransform) -> str:
    return f"scale={transform.scale}, softcap={transform.softcap}, classes={transform.n_classes or 'all'}"


def width_mismatch(logits, head_rows, widths: set):
    """Why the family's logit width is none of ``widths`` (a sentence), or None."""
    if logits.shape[-1] in widths:
        return None
    return (f"it turns its LM head's {head_rows.shape[-1]} columns into {logits.shape[-1]} logit columns, "
            f"not {' or '.join(str(w) for w in sorted(widths))} (a vocabulary slice such as "
            "logits[..., :unpadded_vocab_size] that the config does not declare?)")


def mismatch(got, head_rows, transform: LogitTransform):
    """Why ``got`` (R, n) is not ``transform.apply(head_rows)`` (R, V) (a sentence), or None."""
    expected = transform.apply(head_rows.float())
    reason = width_mismatch(got, head_rows, {expected.shape[-1]})
    if reason is not None:
        return reason
    rtol = verify_rtol(got.dtype)
    got = got.float()
    if torch.allclose(got, expected, rtol=rtol, atol=rtol * float(expected.abs().max())):
        return None
    row, worst = divmod(int((got - expected).abs().argmax()), got.shape[-1])
    return (f"at column {worst} the head gave {float(head_rows[row, worst]):.6g}, the model returned "
            f"{float(got[row, worst]):.6g}, the declared transform gives {float(expected[row, worst]):.6g}")
