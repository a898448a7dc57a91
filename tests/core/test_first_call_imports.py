"""Issue 27 item 7: the first eager call of a public op on CPU tensors imports no compiler.

torch runs a custom op's body behind ``torch._disable_dynamo``, whose first call imports ``torch._dynamo``
(and ``torch._inductor``, ``sympy``, ``triton``, ``torch.onnx``): seconds and ~160 MiB before anything was
asked to compile. ``core/opaque.py`` calls the body directly in plain eager mode. Run in a fresh process
(the test session itself has imported everything): one process for every call, each checked in turn."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "triton", "torch.onnx")

CALLS = {
    "cross_entropy": "fusedce.cross_entropy(x, y).backward()",
    "cross_entropy_none": "fusedce.cross_entropy(x, y, reduction='none', ignore_index=3).sum().backward()",
    "linear_chunked": "fusedce.linear_cross_entropy(h, w, y, method='chunked').backward()",
    "linear_tiled": "fusedce.linear_cross_entropy(h, w, y, method='tiled').backward()",
    "linear_token_log_probs": "fusedce.linear_token_log_probs(h, w, y).sum().backward()",
    "token_log_probs": "fusedce.token_log_probs(x, y).sum().backward()",
}


@pytest.fixture(scope="module")
def imported() -> dict:
    """{call: the compiler modules it imported}, every call run once in ONE fresh process, in turn: a module
    a call imports is new when that call returns, whichever call ran before it."""
    code = textwrap.dedent("""
        import json, sys, torch, fusedce
        x = torch.randn(8, 16, requires_grad=True); y = torch.randint(0, 16, (8,))
        h = torch.randn(8, 4, requires_grad=True); w = torch.randn(16, 4, requires_grad=True)
        new = {}
    """)
    for name in sorted(CALLS):
        code += textwrap.dedent(f"""
            before = set(sys.modules)
            {CALLS[name]}
            new[{name!r}] = sorted(m for m in {HEAVY!r} if m in sys.modules and m not in before)
        """)
    code += "print(json.dumps(new))\n"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CALLS))
def test_first_eager_call_imports_no_compiler(imported, name):
    assert imported[name] == [], f"{name} imported: {imported[name]}"
