"""The one entrance of every public op: ``@public_op(kind, ...)`` gives a public function its signature
(the loss options written into it when it takes ``**options``), its keyword hints, its autocast behaviour
and its DTensor handling, in this order from the inside out:

    forward-AD refusal -> dtensor (core/dtensor.py) -> autocast (core/autocast.py, by ``kind``) -> keyword
    hints -> the op

The forward-AD refusal (``core/transforms.py``): a tensor argument carrying a forward-mode tangent
(``torch.func.jvp`` / ``jacfwd``, ``torch.autograd.forward_ad``) raises ``NotImplementedError`` naming the op,
because the fused kernels have no forward-mode formula and a custom op would otherwise hand back a silent
zero (or None) tangent; reverse mode (``torch.func.grad`` / ``vmap`` / ``jacrev``) is untouched.

``kind`` says what autocast does (what the stock composition the op replaces does under autocast):

- ``"logits"``: an op on logits (its first parameter), stock ``F.cross_entropy`` / ``log_softmax``:
  runs with autocast disabled for the logits' device type (fp32 math; the logits are not cast);
- ``"linear"``: an op on hidden states and LM heads, stock ``F.linear`` then the loss in fp32: each
  ``(hidden, weight, bias)`` group of parameters (``linear=``, by name; default the op's parameters 1,
  2 and 4) is cast as autocast casts ``F.linear``'s inputs, then the op runs with autocast disabled;
- ``"integration"``: a patch or set-up function (``patch_causal_lm``, ``patch_trl``, ...): no tensor
  arguments, so neither autocast nor DTensor handling applies; it still goes through here (its keyword
  hints, the registry).

Every op decorated here is recorded in ``ENTRANCE`` (``__qualname__`` of the module -> kind), and carries
``__fusedce_entrance__ = kind``; ``tests/core/test_entrance.py`` walks ``fusedce.__all__``,
``fusedce.distributed.__all__`` and ``fusedce.nn.functional`` and checks that every public function has
it, and the autocast and DTensor tests run over that same list. The argument checks of each family are
one checked call at the top of the op (``ce/checks.py``, ``rl/checks.py``, ``distill/checks.py``).
"""
from __future__ import annotations

import inspect
from typing import Optional, Sequence

from fusedce.core.autocast import fp32_op, linear_op
from fusedce.core.dtensor import dtensor_op
from fusedce.core.options.signatures import keyword_hints, with_loss_options
from fusedce.core.transforms import no_forward_ad

KINDS = ("logits", "linear", "integration")
ENTRANCE: dict = {}   # "module.name" -> kind, every op that went through public_op


def public_name(fn) -> str:
    """The name a user calls ``fn`` by: ``fusedce.<name>``, ``fusedce.distributed.<name>`` or
    ``fusedce.nn.functional.<name>``."""
    for prefix in ("fusedce.distributed", "fusedce.nn.functional"):
        if fn.__module__.startswith(prefix):
            return f"{prefix}.{fn.__name__}"
    return f"fusedce.{fn.__name__}"


def public_op(kind: str, *, linear: Optional[Sequence[Sequence[str]]] = None, hints: Optional[dict] = None):
    """Decorator: the one entrance of a public op (module docstring). ``linear``: the ``(hidden, weight,
    bias)`` parameter-name groups of a ``"linear"`` op (default: parameters 1, 2 and 4); ``hints``:
    ``{parameter: message}`` for :func:`keyword_hints`."""
    if kind not in KINDS:
        raise ValueError(f"public_op: kind must be one of {KINDS}, got {kind!r}")
    if linear is not None and kind != "linear":
        raise ValueError("public_op: linear= applies to kind='linear' only")

    def decorate(fn):
        params = list(inspect.signature(fn).parameters.values())
        if params and params[-1].kind is inspect.Parameter.VAR_KEYWORD and params[-1].name == "options":
            fn = with_loss_options(fn)
        op = keyword_hints(**hints)(fn) if hints else fn
        if kind == "logits":
            op = fp32_op(op)
        elif kind == "linear":
            op = linear_op(op, None if linear is None else tuple(tuple(g) for g in linear))
        if kind != "integration":
            op = no_forward_ad(dtensor_op(op), public_name(fn))
        op.__fusedce_entrance__ = kind
        ENTRANCE[f"{fn.__module__}.{fn.__qualname__}"] = kind
        return op

    return decorate
