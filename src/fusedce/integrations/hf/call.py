"""The fused loss computed inside the LM head module's own call."""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from torch import nn

from fusedce.integrations.hf.adapters import Pieces, dispatch_children, kind, lora_adapters

# Values the placeholder "logits" hold (one column each) once the transform is verified. The verifying
# call's placeholder is instead ONE row of all V columns, ``probe_row(V)``, shaped ``(1, ..., 1, V)`` (the
# family's post-head code broadcasts it; V elements, so the (B, T, V) logits are still never made), so that
# ``hf_fit.choose_transform`` sees any transform or column slice the family applies, and that it is the
# same at every position (the output must keep the leading 1s). -24 sits where a 30-softcap (Gemma 2) is
# visibly non-linear; both are exact in bf16.
PROBE_VALUES = (1.0, -24.0)


def probe_row(n_columns: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``(n_columns,)``: ``PROBE_VALUES`` first, then values spread over [-24, 24] (distinct in fp32)."""
    row = torch.linspace(-24.0, 24.0, n_columns, dtype=torch.float32, device=device)
    head = torch.tensor(PROBE_VALUES[:n_columns], dtype=torch.float32, device=device)
    return torch.cat([head, row[head.numel():]]).to(dtype)


class _Join(torch.autograd.Function):
    """``join(value, anchor)`` = ``value`` (a copy); the gradient goes to ``value``, a zero gradient to
    ``anchor``. Makes ``anchor``'s graph part of the backward without changing any value."""

    @staticmethod
    def forward(ctx, value, anchor, as_view):
        ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)
        return value.view_as(value) if as_view else value.clone()

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.anchor
        return grad, torch.zeros(shape, dtype=dtype, device=device), None


def join(value: torch.Tensor, anchor: torch.Tensor, as_view: bool = False) -> torch.Tensor:
    """``value`` with ``anchor`` as a zero-gradient dependency (see the module docstring): a copy, or with
    ``as_view`` a view of ``value`` (for a stride-0 expanded probe, which a copy would materialize)."""
    return _Join.apply(value, anchor, as_view)


def _no_extra_arguments(args, kwargs, where: str) -> None:
    if args or kwargs:
        raise TypeError(f"{where} was called with extra arguments {list(kwargs) or len(args)} (peft mixed-"
                        "adapter batches?): patch_causal_lm supports head(hidden_states) only")


class HeadCall:
    """Context manager: while active, calling ``head`` computes ``compute(hidden, weight, bias) -> loss`` inside the
    call and returns a placeholder (a probe row with ``verify``), or the real logits with ``keep_logits``."""

    def __init__(self, head: nn.Module, where: str, compute: Callable, keep_logits: bool, verify: bool):
        self.head, self.where, self.compute, self.keep_logits = head, where, compute, keep_logits
        self.verify, self.calls, self.loss, self._n_rows = verify, 0, None, None
        self.head_rows, self.rows, self.head_shape, self._pieces = None, None, None, None
        self._originals, self._stack = {}, None

    def __enter__(self) -> "HeadCall":
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self._replaced(self.head, self._head_forward))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def final_loss(self, logits) -> torch.Tensor:
        """The loss, with the family's ``logits`` (the head's output after its transform) as a
        zero-gradient dependency, so the backward passes through the head's output first."""
        if isinstance(logits, torch.Tensor) and logits.requires_grad:
            return join(self.loss, logits)
        return self.loss

    def recompute(self, compute: Callable, model_name: str, transform: str) -> None:
        """The verifying call's loss computed again, after the family's forward, by ``compute(hidden, weight, bias)``
        on the pieces the head's call recorded: for a ``transform`` (its description) read off the forward, which
        the losses computed inside the call did not use."""
        hidden, weight, bias, shape = self._pieces
        if not _readable(weight, shape):
            raise ValueError(f"{model_name}.forward applies {transform} to its LM head's output, which its config "
                             "does not declare under a name patch_causal_lm knows, and the head's weight was "
                             "released after the head's call (sharded: ZeRO-3, FSDP2), so the first call's loss "
                             "cannot be recomputed: make the first labelled call with the head unsharded")
        self.loss = compute(hidden, weight, bias)

    @contextlib.contextmanager
    def _replaced(self, module: nn.Module, forward: Callable):
        """``module(...)`` runs ``forward`` inside ``Module.__call__`` (hooks fire). Under an accelerate
        hook (``_hf_hook``) its ``_old_forward`` is replaced instead, so the hook's own work still runs."""
        accelerate = hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__
        attr = "_old_forward" if accelerate else "forward"
        previous = module.__dict__.get(attr)
        self._originals[module] = previous if previous is not None else type(module).forward.__get__(module)
        module.__dict__[attr] = forward
        try:
            yield
        finally:
            if previous is None:
                module.__dict__.pop(attr, None)
            else:
                module.__dict__[attr] = previous
            self._originals.pop(module, None)

    def _head_forward(self, hidden, *args, **kwargs):
        _no_extra_arguments(args, kwargs, self.where)
        self.calls += 1
        pieces = Pieces()
        out = self._enter(self.head, hidden, pieces, self.where, lambda: self._finish(pieces))
        if self.keep_logits:
            if self.verify and out.numel() > 0:
                flat = out.detach().reshape(-1, out.shape[-1])
                n = flat.shape[0]
                self.rows = torch.tensor(sorted({0, n // 2, n - 1}), device=out.device)
                self.head_rows, self.head_shape = flat[self.rows], out.shape
            return out
        if self.verify:   # every column, so that a column slice or any per-column transform shows
            row = probe_row(self._n_rows, hidden.dtype, hidden.device)
            self.head_rows, self.rows = row[None], torch.zeros(1, dtype=torch.long, device=hidden.device)
            self.head_shape = torch.Size((*(1,) * (hidden.dim() - 1), self._n_rows))
            return join(row.view(self.head_shape), out, as_view=True)
        probe = torch.tensor(PROBE_VALUES, dtype=hidden.dtype, device=hidden.device)
        return join(probe.expand(*hidden.shape[:-1], len(PROBE_VALUES)).contiguous(), out)

    def _finish(self, pieces: Pieces) -> torch.Tensor:
        hidden, weight, bias = pieces.joined()
        self._n_rows = weight.shape[0]
        if self.verify:
            self._pieces = (hidden, weight, bias, tuple(weight.shape))
        self.loss = self.compute(hidden, weight, bias)
        if not self.keep_logits:
            return self.loss
        return join(torch.nn.functional.linear(hidden, weight, bias), self.loss)

    def _enter(self, module: nn.Module, x, pieces: Pieces, where: str, finish: Callable):
        """Inside ``module``'s call with its input ``x`` as received: record its pieces, make the calls it
        would make (nested), and return what ``finish`` returns."""
        what = kind(module, where)
        if what == "linear":
            pieces.add(x, module.weight, module.bias, where)
            return finish()
        if what == "dispatch":
            return self._dispatch(module, x, pieces, where, finish)
        calls = [(module.base_layer, x, lambda xb, then: self._enter(module.base_layer, xb, pieces,
                                                                     f"{where}.base_layer", then))]
        for i, (lora_a, lora_b, dropout, scaling) in enumerate(lora_adapters(module)):
            x = module._cast_input_dtype(x, lora_a.weight.dtype)   # as peft's forward (cumulative)
            low_rank = lora_a(dropout(x))                            # the stock forward's calls, same order

            def record(xb, then, lora_b=lora_b, scaling=scaling, name=f"{where}.lora_B[{i}]"):
                bias = None if lora_b.bias is None else lora_b.bias * scaling
                pieces.add(xb * scaling, lora_b.weight, bias, name)
                return then()
            calls.append((lora_b, low_rank, record))
        return self._nest(calls, finish, where)

    def _nest(self, calls, finish: Callable, where: str):
        """Call ``calls[0]``'s module; inside it run its ``enter(x, then)``, whose ``then`` does the rest."""
        if not calls:
            return finish()
        module, inputs, enter = calls[0]

        def forward(x, *args, **kwargs):
            _no_extra_arguments(args, kwargs, where)
            return enter(x, lambda: self._nest(calls[1:], finish, where))
        with self._replaced(module, forward):
            return module(inputs)

    def _dispatch(self, module: nn.Module, x, pieces: Pieces, where: str, finish: Callable):
        """Run the wrapper's own forward with every child it may call captured; exactly one is called."""
        chosen = []

        def capture(name: str, child: nn.Module):
            def forward(xc, *args, **kwargs):
                _no_extra_arguments(args, kwargs, f"{where}.{name}")
                chosen.append(name)
                return self._enter(child, xc, pieces, f"{where}.{name}", finish)
            return forward
        original = self._originals[module]
        with contextlib.ExitStack() as stack:
            for name, child in dispatch_children(module):
                stack.enter_context(self._replaced(child, capture(name, child)))
            out = original(x)
        if len(chosen) != 1:
            raise TypeError(f"{where} called {len(chosen)} of its wrapped modules (expected exactly one)")
        return out


def _readable(weight: torch.Tensor, shape: tuple) -> bool:
    """Whether ``weight`` still holds the ``shape`` values the head's call read (not freed, resized or
    moved to the meta device by a hook since)."""
    local = getattr(weight, "_local_tensor", weight)   # a DTensor's shard
    if tuple(weight.shape) != shape or local.device.type == "meta":
        return False
    needed = (local.storage_offset() + local.numel()) * local.element_size()
    return local.untyped_storage().nbytes() >= needed


def module_name(model: nn.Module, module: nn.Module, default: Optional[str] = None) -> str:
    """The dotted name of ``module`` inside ``model`` (for messages)."""
    for name, found in model.named_modules():
        if found is module:
            return name or type(model).__name__
    return default or type(module).__name__
