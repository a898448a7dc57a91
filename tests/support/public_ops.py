"""Every public function of fusedce, found by walking ``fusedce.__all__``, ``fusedce.distributed.__all__``
and ``fusedce.nn.functional`` (its fusedce-defined names), and one small call of each tensor op.

``PUBLIC_FUNCTIONS``: ``{qualified name: function}``. ``CALLS``: ``{qualified name: (kind, call)}`` for the
ops that take tensors, ``kind`` as the entrance's (``"logits"`` / ``"linear"``); ``call(x, backend)`` runs the
op on the inputs ``x`` (``make_inputs``) and returns its tensor outputs as a tuple. A new public op with
no entry here fails ``tests/core/test_entrance.py``, so the autocast and DTensor tests cannot miss it.
``tests/core/test_entrance.py`` and ``tests/distributed/test_dtensor.py`` run over ``CALLS``.

Shapes: 10 tokens (two ignored), H = 12, V = 37 (odd), K = 3 top-k teacher classes.
"""
from __future__ import annotations

import inspect

import torch

import fusedce
import fusedce.distributed
import fusedce.nn.functional

BT, H, V, K = 10, 12, 37, 3


def _public_functions() -> dict:
    out = {}
    for prefix, module, names in (("fusedce", fusedce, fusedce.__all__),
                                  ("fusedce.distributed", fusedce.distributed, fusedce.distributed.__all__),
                                  ("fusedce.nn.functional", fusedce.nn.functional,
                                   [n for n, v in vars(fusedce.nn.functional).items()
                                    if inspect.isfunction(v) and not n.startswith("_")
                                    and getattr(inspect.unwrap(v), "__module__", "") == "fusedce.nn.functional"])):
        for name in names:
            value = getattr(module, name)
            if inspect.isfunction(value):
                out[f"{prefix}.{name}"] = value
    return out


PUBLIC_FUNCTIONS = _public_functions()


def make_inputs() -> dict:
    """fp32 leaves (``hidden``, ``weight``, ``bias``, ``teacher_hidden``, ``teacher_weight``), constants
    (``target`` with two ignored rows, ``teacher_ids`` / ``teacher_log_probs``)."""
    target = torch.randint(0, V, (BT,))
    target[2] = target[7] = -100
    ids = torch.stack([torch.randperm(V)[:K] for _ in range(BT)])
    return dict(hidden=torch.randn(BT, H, requires_grad=True),
                weight=(torch.randn(V, H) * 0.5).requires_grad_(),
                bias=(torch.randn(V) * 0.1).requires_grad_(),
                teacher_hidden=torch.randn(BT, H), teacher_weight=torch.randn(V, H) * 0.5,
                target=target, teacher_ids=ids,
                teacher_log_probs=torch.log_softmax(torch.randn(BT, K), -1) - 0.1)


def _logits(x):
    return x["hidden"] @ x["weight"].t() + x["bias"]


def _tuple(out):
    return tuple(out) if isinstance(out, tuple) else (out,)


F = fusedce
D = fusedce.distributed
CALLS = {
    "fusedce.cross_entropy": ("logits", lambda x, b: _tuple(F.cross_entropy(
        x["logits"], x["target"], label_smoothing=0.1, return_stats=True, backend=b)[:3])),
    "fusedce.linear_cross_entropy": ("linear", lambda x, b: _tuple(F.linear_cross_entropy(
        x["hidden"], x["weight"], x["target"], x["bias"], label_smoothing=0.1, reduction="none", backend=b))),
    "fusedce.token_log_probs": ("logits", lambda x, b: _tuple(F.token_log_probs(
        x["logits"], x["target"], return_entropy=True, backend=b))),
    "fusedce.linear_token_log_probs": ("linear", lambda x, b: _tuple(F.linear_token_log_probs(
        x["hidden"], x["weight"], x["target"], x["bias"], method="tiled", return_entropy=True, backend=b))),
    "fusedce.distillation_loss": ("logits", lambda x, b: _tuple(F.distillation_loss(
        x["logits"], x["teacher_logits"], x["target"], beta=0.5, backend=b))),
    "fusedce.linear_distillation_loss": ("linear", lambda x, b: _tuple(F.linear_distillation_loss(
        x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], x["target"], student_bias=x["bias"],
        beta=0.5, backend=b))),
    "fusedce.topk_distillation_loss": ("logits", lambda x, b: _tuple(F.topk_distillation_loss(
        x["logits"], x["teacher_ids"], x["teacher_log_probs"], x["target"], backend=b))),
    "fusedce.linear_topk_distillation_loss": ("linear", lambda x, b: _tuple(F.linear_topk_distillation_loss(
        x["hidden"], x["weight"], x["teacher_ids"], x["teacher_log_probs"], x["target"], student_bias=x["bias"],
        backend=b))),
    "fusedce.distributed.vocab_parallel_cross_entropy": ("logits", lambda x, b: _tuple(
        D.vocab_parallel_cross_entropy(x["logits"], x["target"], label_smoothing=0.1, backend=b))),
    "fusedce.distributed.vocab_parallel_linear_cross_entropy": ("linear", lambda x, b: _tuple(
        D.vocab_parallel_linear_cross_entropy(x["hidden"], x["weight"], x["target"], x["bias"], backend=b))),
    "fusedce.distributed.vocab_parallel_token_log_probs": ("logits", lambda x, b: _tuple(
        D.vocab_parallel_token_log_probs(x["logits"], x["target"], return_entropy=True, backend=b))),
    "fusedce.distributed.vocab_parallel_linear_token_log_probs": ("linear", lambda x, b: _tuple(
        D.vocab_parallel_linear_token_log_probs(x["hidden"], x["weight"], x["target"], x["bias"],
                                                return_entropy=True, backend=b))),
    "fusedce.distributed.vocab_parallel_topk_distillation_loss": ("logits", lambda x, b: _tuple(
        D.vocab_parallel_topk_distillation_loss(x["logits"], x["teacher_ids"], x["teacher_log_probs"], x["target"],
                                                tail=True, backend=b))),
    "fusedce.distributed.vocab_parallel_linear_topk_distillation_loss": ("linear", lambda x, b: _tuple(
        D.vocab_parallel_linear_topk_distillation_loss(x["hidden"], x["weight"], x["teacher_ids"],
                                                       x["teacher_log_probs"], x["target"], bias_shard=x["bias"],
                                                       tail=True, backend=b))),
    "fusedce.nn.functional.linear_cross_entropy": ("linear", lambda x, b: _tuple(
        fusedce.nn.functional.linear_cross_entropy(x["hidden"], x["weight"], x["target"], linear_bias=x["bias"],
                                                   reduction="sum"))),
}
# the ops whose call needs a process group (world size 1 is enough: the whole vocabulary on one rank)
NEEDS_GROUP = {name for name in CALLS if name.startswith("fusedce.distributed.")}


def with_logits(x: dict) -> dict:
    """``x`` plus the logits ops' inputs, made from it outside any autocast (fp32): ``logits`` (a
    differentiable function of the leaves) and the constant ``teacher_logits``."""
    y = dict(x)
    y["logits"] = _logits(x)
    y["teacher_logits"] = (x["teacher_hidden"] @ x["teacher_weight"].t()).detach()
    return y
