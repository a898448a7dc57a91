"""The public signatures' loss options, derived from ``schema.LossOptions`` (the one description)."""
from __future__ import annotations

import inspect
import textwrap
from dataclasses import fields

from fusedce.core.options.schema import LossOptions

_KW = inspect.Parameter.KEYWORD_ONLY


def loss_option_parameters() -> list:
    """One keyword-only ``inspect.Parameter`` per ``LossOptions`` field (name, default, annotation)."""
    return [inspect.Parameter(f.name, _KW, default=f.default, annotation=f.type) for f in fields(LossOptions)]


def loss_options_doc(indent: str = "    ") -> str:
    """The "Loss options" docstring section: each field and its doc, wrapped at 100 columns."""
    lines = [f"{indent}Loss options (every cross-entropy op, module and vocab-parallel entry point; keyword-only"
             f" unless the signature above takes them by position; ``fusedce.core.options.LossOptions``):"]
    for f in fields(LossOptions):
        head = f"{indent}    {f.name} (default {f.default!r}): "
        body = textwrap.fill(f.metadata["doc"], 100, initial_indent=head,
                             subsequent_indent=indent + " " * 8)
        lines.append(body)
    return "\n".join(lines)


def with_loss_options(obj):
    """Replace the ``**options`` parameter of a function (or of a class's ``__init__``), in its
    ``__signature__``, by the loss options it does not name itself (placed after its other
    parameters, keyword-only) and append ``loss_options_doc`` to its (the class's) docstring. ``obj`` is
    returned itself (no wrapper: nothing runs per call)."""
    fn = obj.__init__ if isinstance(obj, type) else obj  # type: ignore[misc]
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not params or params[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        raise TypeError(f"{fn.__qualname__} must end with **options to take the loss options")
    explicit = {p.name for p in params}
    added = [p for p in loss_option_parameters() if p.name not in explicit]
    fn.__signature__ = sig.replace(parameters=params[:-1] + added)
    obj.__doc__ = inspect.cleandoc(obj.__doc__ or "") + "\n\n" + loss_options_doc(indent="")
    return obj
