"""Two per-call costs of the Triton interpreter taken out (tests only; results unchanged).

Under ``TRITON_INTERPRET=1`` every launch, and every call of a ``@triton.jit`` helper from inside a kernel,
re-patches ``triton.language``: ``_patch_builtin`` lists the module's members with ``inspect.getmembers``
(a ``dir``, a ``getattr`` of every member and a sort) to find the builtins to wrap, and ``_get_np_dtype``
builds its dtype table on every call. Profiled on a small Triton ``linear_cross_entropy`` forward +
backward, those two were ~45% of its CPU time. :func:`install` keeps each module's builtin NAMES from the
first listing (the members themselves are still read and checked on every call, so what gets wrapped is
unchanged) and memoizes the dtype table's answers. ``tests/test_interpreter_speed.py`` checks both against
the interpreter's own functions.
"""
from __future__ import annotations

import inspect


def install() -> None:
    """Replace ``triton.runtime.interpreter._patch_builtin`` and ``_get_np_dtype`` (no effect without
    Triton; a second call finds the wrappers and does nothing)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch, to_np = getattr(interpreter, "_patch_builtin", None), getattr(interpreter, "_get_np_dtype", None)
    if patch is None or to_np is None or getattr(patch, "names_kept", False) \
            or not hasattr(interpreter, "_LangPatchScope"):   # the interpreter these wrappers were written for
        return
    names: dict[int, tuple] = {}

    def patch_builtin(pkg, builder, scope):
        kept = names.get(id(pkg))
        if kept is None or kept[0] is not pkg:
            kept = names[id(pkg)] = (pkg, tuple(n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)))
        if kept[1] and not tl.core.is_builtin(getattr(pkg, kept[1][0])):
            return   # wrapped already (a jitted helper called inside a launch, which wrapped them all): no-op
        for name in kept[1]:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    answers: dict = {}

    def get_np_dtype(tt_dtype):
        try:
            return answers[tt_dtype]
        except KeyError:
            answers[tt_dtype] = to_np(tt_dtype)
            return answers[tt_dtype]
        except TypeError:   # unhashable: not cached
            return to_np(tt_dtype)

    patch_builtin.names_kept = True
    patch_builtin.original = patch
    get_np_dtype.original = to_np
    interpreter._patch_builtin = patch_builtin
    interpreter._get_np_dtype = get_np_dtype
