"""TRL's distillation losses computed by :func:`fusedce.linear_distillation_loss` (installed on a trainer by
``distill.patch_distillation_trainer``): no logits of either model exist, not even a chunk of them
(``method="tiled"``; ``"chunked"`` holds one chunk of tokens' logits of each model at a time)."""
from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Optional

import torch

PLACEHOLDER_CLASS = 0   # target of the kept rows: only which rows are ignored matters (hard_label_weight = 0)


@dataclasses.dataclass(frozen=True)
class Options:
    """fusedce's options of a patched trainer (as :func:`fusedce.patch_distillation_trainer` takes them)."""

    method: str = "auto"
    chunk_size: Optional[int] = None
    backend: Optional[str] = None
    deterministic: Optional[bool] = None
    entropy: bool = True


def _full(tensor):
    """A DTensor (FSDP2) as one plain tensor, as TRL gathers it; anything else unchanged."""
    dtensor = getattr(getattr(torch.distributed, "tensor", None), "DTensor", None)
    return tensor.full_tensor() if dtensor is not None and isinstance(tensor, dtensor) else tensor


def _scaled(hidden, bias, scale: float):
    """``scale * (hidden @ W.T + bias)`` as ``(scale * hidden) @ W.T + scale * bias`` (exact in real
    arithmetic; autograd flows through the product)."""
    if scale == 1.0:
        return hidden, bias
    return hidden * scale, None if bias is None else bias * scale


def divergence_loss(student_hidden_states: torch.Tensor, teacher_hidden_states: torch.Tensor,
                    student_lm_head_weight: torch.Tensor, teacher_lm_head_weight: torch.Tensor,
                    completion_mask: torch.Tensor, beta: float, num_items_in_batch=None,
                    student_lm_head_bias: Optional[torch.Tensor] = None,
                    teacher_lm_head_bias: Optional[torch.Tensor] = None, student_logit_scale: float = 1.0,
                    teacher_logit_scale: float = 1.0, student_final_logit_softcapping: Optional[float] = None,
                    teacher_final_logit_softcapping: Optional[float] = None, temperature: float = 1.0, *,
                    options: Options = Options()):
    """TRL 1.16's ``_chunked_divergence_loss`` through :func:`fusedce.linear_distillation_loss`."""
    from fusedce.distill.distillation import linear_distillation_loss
    from fusedce.rl.log_probs import linear_token_log_probs

    w_s, w_t = _full(student_lm_head_weight), _full(teacher_lm_head_weight)
    b_s = None if student_lm_head_bias is None else _full(student_lm_head_bias)
    b_t = None if teacher_lm_head_bias is None else _full(teacher_lm_head_bias)
    h_s = student_hidden_states.reshape(-1, student_hidden_states.shape[-1])
    h_t = teacher_hidden_states.reshape(-1, teacher_hidden_states.shape[-1]).detach()
    w_s = w_s if w_s.dtype == h_s.dtype else w_s.to(h_s.dtype)
    w_t = (w_t if w_t.dtype == h_t.dtype else w_t.to(h_t.dtype)).detach()
    b_t = None if b_t is None else b_t.detach()
    valid = completion_mask.reshape(-1) != 0
    target = torch.where(valid, PLACEHOLDER_CLASS, -100)
    h_s, b_s = _scaled(h_s, b_s, float(student_logit_scale))
    h_t, b_t = _scaled(h_t, b_t, float(teacher_logit_scale))
    total = linear_distillation_loss(
        h_s, w_s, h_t, w_t, target, student_bias=b_s, teacher_bias=b_t, beta=float(beta),
        temperature=float(temperature), ignore_index=-100, reduction="sum",
        student_softcap=student_final_logit_softcapping, teacher_softcap=teacher_final_logit_softcapping,
        method=options.method, chunk_size=options.chunk_size, backend=options.backend,
        deterministic=options.deterministic)
    n_valid = valid.sum()
    if num_items_in_batch is None:
        loss = total / n_valid.clamp(min=1)
    else:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        loss = total / num_items_in_batch
    if options.entropy:
        with torch.no_grad():
            entropy = linear_token_log_probs(
                h_s.detach(), w_s.detach(), target, None if b_s is None else b_s.detach(),
                temperature=float(temperature), softcap=student_final_logit_softcapping, return_entropy=True,
                chunk_size=options.chunk_size if options.method == "chunked" else None,
                method=options.method, backend=options.backend, deterministic=options.deterministic).entropy
        entropy_sum = entropy.sum()
    else:
        entropy_sum = torch.full((), math.nan, device=total.device)
    return loss, entropy_sum, n_valid


def _unpeft(model):
    """A peft model's underlying transformers model (as TRL's trainers unwrap it); else ``model``."""
    from accelerate.utils import is_peft_model
    return model.base_model.model if is_peft_model(model) else model


def _last_hidden_state(model, input_ids, attention_mask):
    """The decoder's last hidden state ``(B, T, H)`` of a Hugging Face causal LM (a peft model: its
    underlying model), without the LM head."""
    from fusedce.integrations.hf.head import base_model
    model = _unpeft(model)
    return base_model(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


_VERIFIED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # unwrapped model -> LogitTransform


def _head(model, role: str, wrapped=None, probe_ids=None):
    """``(weight, bias, scale, softcap)`` of the model's plain ``nn.Linear`` LM head and what the family does to the
    head's output."""
    from fusedce.integrations.hf.head import output_head
    model = _unpeft(model)
    head = output_head(model)
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"the {role}'s LM head is a {type(head).__name__}, not a plain nn.Linear: "
                         "fusedce.patch_distillation_trainer would ignore what it adds (e.g. a LoRA adapter)")
    transform = _VERIFIED.get(model)
    if transform is None:
        transform = _verified_transform(model, head, role, wrapped if wrapped is not None else model, probe_ids)
    return head.weight, head.bias, transform.scale, transform.softcap


def _verified_transform(model, head, role: str, wrapped, probe_ids):
    """The family's head transform, checked on one token of its forward (see ``_head``), cached per model."""
    from fusedce.integrations.hf.fit import fit_transform
    from fusedce.integrations.hf.head import logit_transforms, mismatch
    config = getattr(model, "config", None)
    transforms = logit_transforms(config)
    if len(transforms) != 1 or transforms[0].n_classes is not None:
        raise ValueError(f"the {role}'s config declares a logit transform fusedce's GKD loss does not apply "
                         f"({transforms}): run TRL's own loss")
    if probe_ids is None:
        return transforms[0]
    seen = []
    hook = head.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            logits = wrapped(input_ids=probe_ids, use_cache=False).logits
    finally:
        hook.remove()
    raw, got = seen[-1].reshape(-1, seen[-1].shape[-1]).float(), logits.reshape(-1, logits.shape[-1]).float()
    family = type(model).__name__
    if mismatch(got, raw, transforms[0]) is None:
        found = transforms[0]
    else:
        found, why, _settled = fit_transform(got.flatten(), raw.flatten(), config, None, True)
        if found is None:
            raise ValueError(f"the {role} ({family}) transforms its LM head's output in a way fusedce's GKD "
                             f"loss cannot reproduce: {why}; run TRL's own loss")
    _VERIFIED[model] = found
    return found


def gkd_loss(trainer, model, inputs: dict, num_items_in_batch, options: Options) -> torch.Tensor:
    """TRL 1.16 ``GKDTrainer.compute_loss``'s loss without logits: ``generalized_jsd_loss`` at temperature 1 on
    the positions whose shifted label is not -100, over ``num_items_in_batch`` or ``max(count, 1)``."""
    from trl.models.utils import _ForwardRedirection

    from fusedce.distill.distillation import linear_distillation_loss

    redirect = _ForwardRedirection()
    unwrap = trainer.accelerator.unwrap_model
    student, teacher = unwrap(model), unwrap(trainer.teacher_model)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    h_s = redirect(model, student, _last_hidden_state, student, ids, mask)[:, :-1]
    trainer.teacher_model.eval()
    with torch.no_grad():
        h_t = redirect(trainer.teacher_model, teacher, _last_hidden_state, teacher, ids, mask)[:, :-1]
    labels = inputs["labels"][:, 1:]
    probe = ids[:1, :1]
    w_s, b_s, scale_s, cap_s = _head(student, "student", model, probe)
    w_t, b_t, scale_t, cap_t = _head(teacher, "teacher", trainer.teacher_model, probe)
    h_s, b_s = _scaled(h_s.reshape(-1, h_s.shape[-1]), b_s, scale_s)
    h_t, b_t = _scaled(h_t.reshape(-1, h_t.shape[-1]).to(w_s.device), b_t, scale_t)
    target = labels.reshape(-1).to(w_s.device)
    total = linear_distillation_loss(
        h_s.to(w_s.device), w_s, h_t.detach(), w_t.detach(), target, student_bias=b_s,
        teacher_bias=None if b_t is None else b_t.detach(), beta=float(trainer.beta), temperature=1.0,
        ignore_index=-100, reduction="sum", student_softcap=cap_s, teacher_softcap=cap_t,
        method=options.method, chunk_size=options.chunk_size, backend=options.backend,
        deterministic=options.deterministic)
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / (target != -100).sum().clamp_min(1)
