"""What an LM head computes, module by module, so the fused loss can reproduce it exactly."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn


class Pieces:
    """The logits as ``sum_i hidden[i] @ weight[i].T + sum(biases)``; filled inside the head's call."""

    def __init__(self):
        self.hidden: List[torch.Tensor] = []
        self.weight: List[torch.Tensor] = []
        self.bias: List[torch.Tensor] = []

    def add(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            where: str) -> None:
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"{where}: the weight seen inside the module's own forward is not a 2-D (V, H) "
                            f"tensor (got {tuple(getattr(weight, 'shape', ()))}): patch_causal_lm supports "
                            "linear LM heads only")
        if hidden.shape[-1] != weight.shape[1]:
            raise ValueError(f"{where}: input of width {hidden.shape[-1]} for a weight of shape "
                             f"{tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != weight.shape[:1]:
            raise TypeError(f"{where}: bias of shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
        self.hidden.append(hidden)
        self.weight.append(weight)
        if bias is not None:
            self.bias.append(bias)

    def joined(self):
        """``(hidden (..., H'), weight (V, H'), bias (V,) or None)``: one piece as is (no copy); several
        concatenated along H in the first weight's dtype and device (a copy of ``V x H'``)."""
        device, dtype = self.weight[0].device, self.weight[0].dtype
        bias = None
        for b in self.bias:
            b = b.to(device, dtype)
            bias = b if bias is None else bias + b
        if len(self.weight) == 1:
            return self.hidden[0].to(device), self.weight[0], bias
        hidden = torch.cat([h.to(device, dtype) for h in self.hidden], dim=-1)
        weight = torch.cat([w.to(device, dtype) for w in self.weight], dim=1)
        return hidden, weight, bias


def _peft_lora_linear():
    try:
        from peft.tuners.lora import Linear
    except Exception:  # noqa: BLE001 - peft absent or broken: then no head is a peft LoRA layer
        return None
    return Linear


def _peft_modules_to_save():
    try:
        from peft.utils.other import ModulesToSaveWrapper
    except Exception:  # noqa: BLE001
        return None
    return ModulesToSaveWrapper


def kind(module: nn.Module, where: str) -> str:
    """``"linear"``, ``"lora"`` or ``"dispatch"`` after checking the whole subtree that the head's
    forward runs; ``ValueError`` (naming ``where`` and the reason) for anything not applied exactly."""
    cls = type(module)
    if getattr(cls, "forward", None) is nn.Linear.forward:
        return "linear"
    lora = _peft_lora_linear()
    if lora is not None and isinstance(module, lora):
        if cls.forward is not lora.forward:
            raise ValueError(f"{where} ({cls.__name__}) overrides peft's LoRA forward: patch_causal_lm "
                             "cannot tell what it computes")
        variants = sorted(getattr(module, "lora_variant", {}) or {})
        if variants:
            raise ValueError(f"{where}: the LoRA variant of adapter(s) {variants} (DoRA, aLoRA, ...) is not "
                             "x @ W.T + s * B(A(dropout(x))): patch_causal_lm cannot apply it exactly")
        if getattr(module, "fan_in_fan_out", False):
            raise ValueError(f"{where}: LoRA with fan_in_fan_out=True (a Conv1D base) is not supported")
        if kind(module.base_layer, f"{where}.base_layer") != "linear":
            raise ValueError(f"{where}.base_layer must be a plain linear layer under LoRA")
        for name in module.lora_A:
            for part in ("lora_A", "lora_B"):
                sub = getattr(module, part)[name]
                if getattr(type(sub), "forward", None) is not nn.Linear.forward:
                    raise ValueError(f"{where}.{part}.{name} ({type(sub).__name__}) is not an nn.Linear")
            if getattr(module.lora_A[name], "bias", None) is not None:
                raise ValueError(f"{where}.lora_A.{name} has a bias: not the LoRA form")
        return "lora"
    wrapper = _peft_modules_to_save()
    if wrapper is not None and cls is wrapper:
        for name, child in dispatch_children(module):
            kind(child, f"{where}.{name}")
        return "dispatch"
    raise ValueError(f"{where} ({cls.__module__}.{cls.__name__}) is neither an nn.Linear nor an adapter "
                     "patch_causal_lm applies exactly (peft LoRA, peft modules_to_save): its forward may "
                     "compute something other than x @ W.T + b, so the fused loss would silently differ")


def dispatch_children(module: nn.Module):
    """``(name, child)`` of a dispatch wrapper: the modules its forward may call (exactly one per call)."""
    children = [("original_module", module.original_module)]
    children += [(f"modules_to_save.{k}", m) for k, m in module.modules_to_save.items()]
    return children


def lora_adapters(module: nn.Module):
    """The adapters peft's ``lora.Linear.forward`` applies on this call, as ``(A, B, dropout, scaling)`` in its order;
    ``[]`` when merged or disabled."""
    if module.disable_adapters:
        if module.merged:
            module.unmerge()
        return []
    if module.merged:
        return []
    return [(module.lora_A[a], module.lora_B[a], module.lora_dropout[a], module.scaling[a])
            for a in module.active_adapters if a in module.lora_A.keys()]
