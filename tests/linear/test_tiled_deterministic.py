"""Determinism (issue 18, kind 4): with ``deterministic=True`` or under
``torch.use_deterministic_algorithms(True)``, ``method="tiled"`` on Triton runs the atomic-free backward
(``kernels/tiled_backward_owned.py``); every other path has no float atomics at all.

Under the Triton interpreter the programs run one after another, so atomics are sequential too and two
runs agree bitwise whatever kernel ran: run-to-run equality alone could not fail here. So these tests
check (1) WHICH kernels are launched (a spy on ``tiled.run_launches``) for every way of asking, through
every public entry point that has the keyword (function, RL op, module, HF patch, torch.compile), (2) that
the atomic-free kernels' loss and gradients match the float64 reference with every option (class weights,
smoothing, softcap, z-loss, ignored rows, bias), (3) bitwise equality of two runs, and (4) statically that
no other kernel or torch op of the library accumulates with atomics. On a GPU the PTX check of
``fusedce inspect`` (``test_inspect.py``) shows the owned kernels hold no atomic instruction.

Shapes: 37 tokens x V = 300 x H = 40 with 16 x 64 x 16 tiles: 3 token tiles (the last partial) and 5
vocabulary tiles (the last partial), so the grad_weight kernel sums over several token tiles and the
grad_hidden kernel over several vocabulary tiles, in the order the docstring states.
"""
import pathlib
import re

import pytest
import torch

import fusedce
from fusedce.backends.triton import tiled as triton_tiled
from fusedce.distributed import vocab_parallel_linear_cross_entropy
from fusedce.backends.triton import tuning
from inputs import make_target, make_weight
from reference64_linear import check_linear, make_linear

ROWS, HIDDEN, V = 37, 40, 300
OWNED = ["tiled_grad_hidden_kernel", "tiled_grad_weight_kernel"]
ATOMIC = ["tiled_backward_kernel"]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tuning, "tiled_config", lambda *a, **k: {
        "BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_H": 16, "num_warps": 4, "num_stages": 2})


@pytest.fixture
def launched(monkeypatch):
    """The names of the tiled backward kernels launched, in order."""
    names = []
    run = triton_tiled.run_launches

    def spy(launches):
        names.extend(getattr(kernel, "fn", kernel).__name__ for kernel, *_ in launches)
        run(launches)

    monkeypatch.setattr(triton_tiled, "run_launches", spy)
    return names


@pytest.fixture
def torch_deterministic():
    """``torch.use_deterministic_algorithms(True)`` for the test, restored after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _inputs(dtype=torch.float32):
    hidden, weight, bias = make_linear((ROWS,), HIDDEN, V, dtype, bias=True, logit_scale=4.0)
    target = make_target((ROWS,), V, ignore_every=4)
    target[16:32] = -100     # a whole token tile ignored: the kernels skip it
    return hidden, weight, bias, target


def _fwd_bwd(**kw):
    hidden, weight, bias, target = _inputs()
    fusedce.linear_cross_entropy(hidden, weight, target, bias, method="tiled", backend="triton", **kw).backward()


@pytest.mark.parametrize("keyword,torch_mode,expected", [
    (None, False, ATOMIC),     # default, torch not in deterministic mode: the faster atomic kernel
    (False, False, ATOMIC),
    (True, False, OWNED),      # asked explicitly
    (None, True, OWNED),       # torch.use_deterministic_algorithms(True)
    (False, True, ATOMIC),     # an explicit False wins over torch's flag
])
def test_the_flag_selects_the_kernels(launched, keyword, torch_mode, expected):
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(torch_mode)
    try:
        _fwd_bwd(deterministic=keyword)
    finally:
        torch.use_deterministic_algorithms(before)
    assert launched == expected


def test_only_the_gradients_asked_for(launched):
    """A frozen head (only grad_hidden) launches only the grad_hidden kernel: 4 V H FLOPs, as atomics."""
    hidden, weight, bias, target = _inputs()
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    fusedce.linear_cross_entropy(hidden, weight, target, bias, method="tiled", backend="triton",
                                 deterministic=True).backward()
    assert launched == OWNED[:1]
    launched.clear()
    hidden, weight, bias, target = _inputs()
    hidden.requires_grad_(False)
    fusedce.linear_cross_entropy(hidden, weight, target, bias, method="tiled", backend="triton",
                                 deterministic=True).backward()
    assert launched == OWNED[1:]


CASES = {   # every option of the tiled kernels' gradient, and ignored rows in all
    "plain": dict(),
    "weights+smoothing": dict(ce_weight=True, label_smoothing=0.1),
    "softcap+zloss": dict(softcap=5.0, lse_square_scale=1e-2),
    "everything": dict(ce_weight=True, label_smoothing=0.2, softcap=8.0, lse_square_scale=1e-2,
                       logit_scale=0.7, reduction="sum"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_owned_kernels_match_float64(launched, name):
    opts = dict(CASES[name])
    if opts.pop("ce_weight", False):
        opts["ce_weight"] = make_weight(V)
    hidden, weight, bias, target = _inputs()
    check_linear(hidden, weight, target, bias, backend="triton", method="tiled", deterministic=True, **opts)
    assert launched == OWNED


def test_owned_kernels_bf16_match_float64(launched):
    hidden, weight, bias, target = _inputs(torch.bfloat16)
    check_linear(hidden, weight, target, bias, backend="triton", method="tiled", deterministic=True,
                 label_smoothing=0.1, lse_square_scale=1e-2, reduction="none", upstream=torch.randn(ROWS))
    assert launched == OWNED


def test_two_runs_are_bitwise_equal(torch_deterministic, launched):
    outs = []
    for _ in range(2):
        hidden, weight, bias, target = (t.detach().clone() for t in _inputs_fixed())
        for t in (hidden, weight, bias):
            t.requires_grad_()
        loss = fusedce.linear_cross_entropy(hidden, weight, target, bias, method="tiled", backend="triton",
                                            label_smoothing=0.1, lse_square_scale=1e-3)
        loss.backward()
        outs.append((loss.detach(), hidden.grad, weight.grad, bias.grad))
    assert launched == OWNED * 2
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _inputs_fixed():
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(ROWS, HIDDEN, generator=g)
    weight = torch.randn(V, HIDDEN, generator=g) * 0.5
    bias = torch.randn(V, generator=g)
    target = torch.randint(0, V, (ROWS,), generator=g)
    target[::5] = -100
    return hidden, weight, bias, target


def test_rl_log_probs_and_module(torch_deterministic, launched):
    """``linear_token_log_probs`` (its tiled backward had the same atomics) and the module follow the flag."""
    hidden, weight, bias, target = _inputs()
    out = fusedce.linear_token_log_probs(hidden, weight, target, bias, temperature=0.7, return_entropy=True,
                                         method="tiled", backend="triton")
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert launched == OWNED
    launched.clear()
    hidden, weight, bias, target = _inputs()
    module = fusedce.LinearCrossEntropyLoss(method="tiled", backend="triton", deterministic=False)
    assert "deterministic=False" in repr(module)
    module(hidden, weight, target, bias).backward()
    assert launched == ATOMIC      # the module's explicit False
    launched.clear()
    module.deterministic = None    # now follows torch's flag
    module(hidden.detach().requires_grad_(), weight, target, bias).backward()
    assert launched == OWNED


def test_rl_log_probs_owned_match_atomic_results(launched):
    """The RL op's entropy gradient through the owned kernels equals the atomic kernel's (under the
    interpreter both sum in the same order: any difference would be a wrong term)."""
    results = []
    for det in (False, True):
        hidden, weight, bias, target = (t.detach().clone() for t in _inputs_fixed())
        for t in (hidden, weight, bias):
            t.requires_grad_()
        out = fusedce.linear_token_log_probs(hidden, weight, target, bias, temperature=1.3, softcap=5.0,
                                             return_entropy=True, method="tiled", backend="triton",
                                             deterministic=det)
        adv = torch.linspace(-1, 1, ROWS)
        (-(adv * out.log_probs).sum() - 0.1 * out.entropy.sum()).backward()
        results.append((hidden.grad, weight.grad, bias.grad))
    assert launched == ATOMIC + OWNED
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_compiled_follows_the_flag(torch_deterministic, launched):
    """Under torch.compile the flag reaches the custom op as an argument (torch's flag is read while
    tracing; torch.compile guards on it)."""
    hidden, weight, bias, target = _inputs()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(h, w, b):
        return fusedce.linear_cross_entropy(h, w, target, b, method="tiled", backend="triton")

    step(hidden, weight, bias).backward()
    assert launched == OWNED


def test_hf_patch_takes_the_keyword(launched):
    pytest.importorskip("transformers")
    from hf_models import batch, build

    model = build("llama")
    ids, _, labels = batch()
    stock = model(input_ids=ids, labels=labels).loss
    (stock_grad,) = torch.autograd.grad(stock, model.lm_head.weight)
    fusedce.patch_causal_lm(model, method="tiled", backend="triton", deterministic=True)
    fused = model(input_ids=ids, labels=labels).loss
    (fused_grad,) = torch.autograd.grad(fused, model.lm_head.weight)
    assert launched == OWNED         # the hidden states require grad (the layers below do)
    torch.testing.assert_close(fused, stock, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_grad, stock_grad, rtol=1e-4, atol=1e-6)
    with pytest.raises(TypeError, match="deterministic"):
        fusedce.patch_causal_lm(model, deterministic="yes")


def test_keyword_errors():
    hidden, weight, bias, target = _inputs()
    for bad in ("yes", 1, torch.tensor(True)):
        with pytest.raises(TypeError, match="deterministic"):
            fusedce.linear_cross_entropy(hidden, weight, target, deterministic=bad)
        with pytest.raises(TypeError, match="deterministic"):
            fusedce.linear_token_log_probs(hidden, weight, target, deterministic=bad)
        with pytest.raises(TypeError, match="deterministic"):
            fusedce.LinearCrossEntropyLoss(deterministic=bad)
        with pytest.raises(TypeError, match="deterministic"):   # checked before the group is read
            vocab_parallel_linear_cross_entropy(hidden, weight, target, deterministic=bad)


# ---------------------------------------------------------------- the paths that are deterministic anyway

SRC = pathlib.Path(fusedce.__file__).parent
# torch ops whose CUDA kernels accumulate with atomics (torch.use_deterministic_algorithms lists them)
TORCH_ATOMIC_OPS = re.compile(r"index_add|scatter_add|scatter_reduce|index_put_?\([^)]*accumulate=True|"
                              r"put_\([^)]*accumulate=True|bincount|histc|embedding_bag")


# The float-atomic places there are, each with its atomic-free variant under ``deterministic=True``:
# the tiled linear cross-entropy backward (kernels/tiled_backward_owned.py replaces it) and the tiled
# distillation gradient (distill_tiled_grad_hidden / _weight replace it).
ATOMIC_KERNELS = ["distill_tiled_grad.py", "tiled_backward.py"]
# torch ops with atomic CUDA kernels, where they are allowed (paths under src/fusedce), and why:
ALLOWED_TORCH_ATOMICS = {
    # the K-class tiled log-probs' weight-gradient scatter; deterministic=True sums each class's entries
    # by a sorted segment_reduce first (one index_add_ per class, no race)
    "rl/kclass_head_tiled.py": "index_add",
    # the hard label's one-hot, one index per row: no two additions meet in one element
    "backends/pytorch/distill.py": "scatter_add", "backends/pytorch/distill_tiled.py": "scatter_add",
    "rl/log_probs.py": "index_add",   # the word in a docstring (the deterministic keyword's description)
    # the top-k / top-p log-prob gradient's one-hot, one target index per row: no two additions meet
    "rl/truncated_rows.py": "scatter_add",
    "distributed/sampled_rows.py": "scatter_add",   # the same one-hot on a vocabulary slice: one index per row
}


def test_no_other_kernel_or_op_accumulates_with_atomics():
    """The README's statement ("Determinism"), checked on the sources: the atomic tiled backward and the atomic tiled
    distillation gradient are the only kernels with atomics (Triton ``tl.atomic_*``, CuTe ``atomic``), and
    torch ops with atomic CUDA kernels appear only at the places listed in ``ALLOWED_TORCH_ATOMICS``."""
    kernels = sorted((SRC / "backends").glob("*/kernels/*.py"))
    assert len(kernels) > 10, kernels
    with_atomics = sorted(p.name for p in kernels if re.search(r"atomic", p.read_text().split('"""', 2)[-1]))
    assert with_atomics == ATOMIC_KERNELS, with_atomics
    sources = [p for p in SRC.rglob("*.py") if "kernels" not in p.parts]
    offenders = [f"{p.relative_to(SRC)}: {m.group(0)}" for p in sources
                 for m in TORCH_ATOMIC_OPS.finditer(p.read_text())
                 if ALLOWED_TORCH_ATOMICS.get(p.relative_to(SRC).as_posix()) != m.group(0)]
    assert not offenders, offenders
