"""``tests/support/interpreter_index.py``'s version gate: the interpreter fix goes in exactly for Triton < 3.7 with
numpy >= 2.4 (local / dev version suffixes included). The fix itself is exercised by every interpreted
kernel with a runtime loop bound on such versions (``make test-compat``'s Triton 3.6 + numpy 2.5.2)."""
import pytest

import interpreter_index


@pytest.mark.parametrize("triton, numpy, needed", [
    ("3.6.0", "2.5.2", True), ("3.6.0+git1a2b", "2.4.0", True), ("3.7.0", "2.5.2", False),
    ("3.9.0", "2.4.6", False), ("3.6.0", "2.3.5", False), ("3.10.1", "2.5.0", False), ("2.3.1", "2.4.0rc1", True)])
def test_needed_only_for_old_triton_with_new_numpy(triton, numpy, needed):
    assert interpreter_index.needed(triton, numpy) is needed
