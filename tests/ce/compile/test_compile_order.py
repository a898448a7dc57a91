"""The order of first calls must not matter: compiled first then eager, or eager first then compiled
(case C15 of ``docs/cases.md``: ``compile_first``).

``lm_head/loop.py`` once probed ``torch.addmm(out_dtype=...)`` and cached the
answer for the whole process. Probed inside a Dynamo trace (compile first), fake tensors accepted the
op, the compiled backward then failed in Inductor (``tuned_addmm() takes 3 positional arguments but 4
were given``) and every later EAGER call failed too (``aten::addmm.dtype_out`` has no CPU kernel). The
rule now: no process-wide cache is filled while tracing, and a compiled graph never contains an op
Inductor cannot lower, whatever ran first.

Each order runs in a FRESH interpreter (``subprocess``), since the bug lived in process-wide state: one
process per (order, backend) runs fp32, bf16 and fp16 through both the compiled and the eager call,
in that order of phases, each with forward + backward, and checks the loss and the gradients of hidden
and weight against the float64 reference of ``F.cross_entropy(F.linear(h, w).float(), t)``.
backend="torch": both orders, reductions mean (gradients computed in the forward) and none (the chunk
loop runs again in the backward); backend="triton": compile first, mean.

Tolerance: the project's linear rule (``reference64_linear.py``). fp32 loss: the rigorous element-wise
fp32 bound (cross-entropy table plus the ``(H + 2) u A_r`` error of the fp32 logits). bf16 / fp16 loss and
every gradient: at most LINEAR_FACTOR (4) times the largest error stock PyTorch makes at the same dtype
(``F.linear`` in that dtype -> ``.float()`` -> ``F.cross_entropy``) against float64, plus a floor of 64
fp32 units of the magnitudes the matmul sums run over. Compiled and eager both compute the logits in the
inputs' dtype with fp32 accumulation and round each gradient once to the leaf's dtype, like stock; the
compiled weight gradient accumulates through the fp32 upcast path (exact products of bf16 / fp16
values, fp32 sums), which changes only the summation order. A failure of the old kind is not a
tolerance matter: the subprocess raises, or an O(1) error shows.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2] / "support"   # reference64_linear

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    sys.path[:0] = [{tests!r}, {tests_root!r}]
    import fusedce
    from reference64_linear import (assert_linear_grad_close, assert_linear_loss_close, make_linear,
                                    reference_linear_cross_entropy, stock_linear_cross_entropy)

    ORDER, BACKEND, REDUCTIONS = {order!r}, {backend!r}, {reductions!r}
    DTYPES = (torch.float32, torch.bfloat16, torch.float16)
    # the issue's shapes: h 12 x 8, W 37 x 8; two ignored tokens (the compaction is skipped when compiled)
    N, H, V = 12, 8, 37

    def inputs(dtype, seed):
        torch.manual_seed(seed)
        h, w, _ = make_linear((N,), H, V, dtype)
        t = torch.randint(0, V, (N,))
        t[3] = t[7] = -100
        return h, w, t

    def loss_fn(reduction):
        def fn(h, w, t):
            return fusedce.linear_cross_entropy(h, w, t, reduction=reduction, backend=BACKEND)
        return fn

    compiled = {{r: torch.compile(loss_fn(r), fullgraph=True) for r in REDUCTIONS}}
    eager = {{r: loss_fn(r) for r in REDUCTIONS}}
    phases = [("compiled", compiled), ("eager", eager)]
    if ORDER == "eager_first":
        phases.reverse()
    for phase, fns in phases:
        for reduction in REDUCTIONS:
            for i, dtype in enumerate(DTYPES):
                h, w, t = inputs(dtype, seed=i)
                up = torch.randn(N) if reduction == "none" else None
                loss = fns[reduction](h, w, t)
                grads = torch.autograd.grad(loss, (h, w), torch.ones_like(loss) if up is None else up)
                ref = reference_linear_cross_entropy(h, w, t, reduction=reduction, upstream=up)
                stock_loss, _, stock_grads = stock_linear_cross_entropy(h, w, t, reduction=reduction,
                                                                        upstream=up)
                where = f"{{ORDER}} / {{phase}} / {{BACKEND}} / {{reduction}} / {{dtype}}"
                try:
                    assert_linear_loss_close(loss.detach(), ref, dtype, stock_loss)
                    assert_linear_grad_close("grad_hidden", grads[0], ref, stock_grads, dtype)
                    assert_linear_grad_close("grad_weight", grads[1], ref, stock_grads, dtype)
                except AssertionError as exc:
                    raise AssertionError(f"{{where}}: {{exc}}") from None
                print("ok", where, flush=True)
    print("ALL OK")
""")


def _run(order: str, backend: str, reductions: tuple) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FUSEDCE_BACKEND"}
    env["TRITON_INTERPRET"] = "1"
    code = SCRIPT.format(tests=str(TESTS), tests_root=str(TESTS.parent), order=order, backend=backend,
                         reductions=reductions)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, (
        f"fresh process, order {order}, backend {backend}: rc {proc.returncode}\n"
        f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")


@pytest.mark.parametrize("order", ["compile_first", "eager_first"])
def test_first_call_order_torch(order):
    """backend="torch", every dtype, mean (gradients computed in forward) and none (the backward
    recomputes the chunks: the addmm runs in the autograd backward)."""
    _run(order, "torch", ("mean", "none"))


def test_compile_first_triton():
    """backend="triton" (kernels under the interpreter, the same chunk loop around the custom ops), in
    the order that used to poison the process; one case only, each fresh process costs ~10 s."""
    _run("compile_first", "triton", ("mean",))
