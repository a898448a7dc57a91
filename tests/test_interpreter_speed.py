"""``interpreter_speed.install`` (tests/conftest.py): the interpreter wraps the same builtins and maps
dtypes the same as with its own functions."""
import pytest

tl = pytest.importorskip("triton.language")
from triton.runtime import interpreter  # noqa: E402

import interpreter_speed  # noqa: E402

if not hasattr(interpreter, "_LangPatchScope"):
    pytest.skip("an older Triton interpreter: interpreter_speed installs nothing there", allow_module_level=True)


def _wrapped_names(patch, modules):
    scope = interpreter._LangPatchScope()
    for module in modules:
        patch(module, interpreter.interpreter_builder, scope)
    changed = [(id(obj), name) for obj, name, _ in scope._changes]
    scope.restore()
    return changed


def test_installed_and_wraps_the_same_builtins():
    interpreter_speed.install()
    patch = interpreter._patch_builtin
    assert getattr(patch, "names_kept", False), "tests/conftest.py installs it"
    modules = (tl, tl.tensor, tl.math, tl.core.tensor_descriptor_base)
    expected = _wrapped_names(patch.original, modules)
    assert expected, "the interpreter wraps builtins of triton.language"
    assert _wrapped_names(patch, modules) == expected
    assert _wrapped_names(patch, modules) == expected   # the kept names, a second time
    # inside a launch (the modules wrapped already) both wrap nothing more
    scope = interpreter._LangPatchScope()
    for module in modules:
        patch.original(module, interpreter.interpreter_builder, scope)
    try:
        assert _wrapped_names(patch, modules) == _wrapped_names(patch.original, modules) == []
    finally:
        scope.restore()
    assert _wrapped_names(patch, modules) == expected   # restored: wrapped again as the first time


def test_same_numpy_dtypes():
    to_np = interpreter._get_np_dtype
    dtypes = [tl.int1, tl.int8, tl.int16, tl.int32, tl.int64, tl.uint8, tl.uint32, tl.uint64, tl.float16,
              tl.bfloat16, tl.float32, tl.float64, tl.pointer_type(tl.float32)]
    for _ in range(2):
        assert [to_np(d) for d in dtypes] == [to_np.original(d) for d in dtypes]
