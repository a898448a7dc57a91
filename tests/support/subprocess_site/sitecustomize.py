"""Every Python the tests start (``tests/conftest.py`` puts this folder on ``PYTHONPATH``): under
``TRITON_INTERPRET=1``, ``interpreter_speed.install()`` as in the test process (results unchanged), so the
fresh processes the tests run (``gpu_check.sh --dry-run``, the bench's isolated rows, first-call checks) do
not pay the interpreter's per-call re-listing of ``triton.language``."""
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        import interpreter_speed
    finally:
        del sys.path[0]
    interpreter_speed.install()
