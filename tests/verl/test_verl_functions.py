"""The verl plugin's functions under verl 0.9.1's call contracts, without verl (the main venv): verl's
``FusedLinearForPPO`` / ``linear_cross_entropy`` signatures called as verl's HF forwards call them, against
float64 of the same values; the model's head transform (softcap, logit scale) read off the running forward
against the model's own logits; Σπ²; batch invariance; the rollout's top-p; the options; and the import's
refusal where verl is missing. The same functions inside verl itself: tests/verl/test_verl_engine.py
(``make test-verl``)."""
import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

from inputs import make_target
from reference64_log_probs import reference_log_probs, transformed_logits
import truncated_reference64 as trunc64

H, V = 16, 97
ATOL = 2e-5          # fp32 math on the exact bf16 values (the float64 reference uses the same values)
GRAD_RTOL = 1.6e-2   # the gradient rounded once to bf16 (tests/rl/test_log_probs.py's table)


def _inputs(shape=(2, 6), dtype=torch.bfloat16, scale=3.0):
    hidden = (torch.randn(*shape, H) * scale).to(dtype).requires_grad_()
    weight = torch.randn(V, H).to(dtype).requires_grad_()
    labels = make_target(shape, V, ignore_every=0)
    return hidden, weight, labels


def _ref(hidden, weight, labels, temperature, softcap=None, scale=1.0):
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    lp, ent = reference_log_probs(h64 @ w64.T, labels, temperature, softcap, logit_scale=scale)
    return lp, ent, h64, w64


def _err(actual, expected):
    return float((actual.detach().double() - expected.detach()).abs().max())


def _grad_check(actual, expected):
    bound = 1e-6 + GRAD_RTOL * float(expected.abs().max())
    assert _err(actual, expected) <= bound


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_linear_for_ppo_vs_float64(plugin, temperature):
    """verl's torch-backend module contract: (hidden (B, T, H), weight (V, H), input_ids (B, T), temperature)
    -> fp32 (log_probs, entropy) (B, T) within fp32 rounding of float64 of the bf16 values, where the bf16
    logits verl's torch backend forms are off by bf16 rounding; gradients of both outputs at once."""
    hidden, weight, labels = _inputs()
    log_probs, entropy = plugin.functions.FusedLinearForPPO()(hidden, weight, labels, temperature)
    assert log_probs.dtype == entropy.dtype == torch.float32 and log_probs.shape == labels.shape
    lp, ent, h64, w64 = _ref(hidden, weight, labels, temperature)
    assert _err(log_probs, lp) <= ATOL and _err(entropy, ent) <= ATOL
    # verl's torch backend: (hidden @ weight.T) in bf16, then fp32
    stock = torch.log_softmax((hidden.detach() @ weight.detach().T).float() / temperature, -1)
    stock_lp = stock.gather(-1, labels[..., None])[..., 0]
    assert _err(stock_lp, lp) > 10 * ATOL   # the rounding the plugin removes (on these O(10) logits)
    adv, beta = torch.randn(labels.shape), torch.rand(labels.shape)
    (-(adv * log_probs).sum() - (beta * entropy).sum()).backward()
    (-(adv.double() * lp).sum() - (beta.double() * ent).sum()).backward()
    _grad_check(hidden.grad, h64.grad)
    _grad_check(weight.grad, w64.grad)


def test_linear_cross_entropy_contract(plugin):
    """verl's Triton-backend contract: (hidden, weight, labels, temperature, "none", group=None) -> fp32
    flattened (labels.numel(),) outputs; other reductions, non-number temperatures and mismatched labels
    are clear errors."""
    hidden, weight, labels = _inputs((1, 9))
    log_probs, entropy = plugin.functions.linear_cross_entropy(hidden, weight, labels, 1.3, "none")
    assert log_probs.shape == entropy.shape == (9,)
    lp, ent, _, _ = _ref(hidden, weight, labels, 1.3)
    assert _err(log_probs, lp.reshape(-1)) <= ATOL and _err(entropy, ent.reshape(-1)) <= ATOL
    with pytest.raises(ValueError, match="reduction must be 'none'"):
        plugin.functions.linear_cross_entropy(hidden, weight, labels, 1.0, "mean")
    with pytest.raises(TypeError, match="temperature must be a Python number"):
        plugin.functions.linear_cross_entropy(hidden, weight, labels, torch.tensor(1.0), "none")
    with pytest.raises(ValueError, match="one label per hidden row"):
        plugin.functions.linear_cross_entropy(hidden, weight, labels[:, :4], 1.0, "none")
    with pytest.raises(ValueError, match=r"weight \(V, H\)"):
        plugin.functions.linear_cross_entropy(hidden, weight.T, labels, 1.0, "none")


def _verl_like_forward(self, input_ids, temperature=1.0, use_triton=False, fused=None, **kwargs):
    """What verl 0.9.1's ``dense_common.forward_with_torch_backend`` / ``..._triton_backend`` do: the
    backbone's last hidden state, labels rolled by one, the head's raw weight to the fused function."""
    hidden = self.model(input_ids=input_ids).last_hidden_state
    rolled = torch.roll(input_ids, shifts=-1, dims=-1)
    if use_triton:
        log_probs, entropy = fused.linear_cross_entropy(hidden, self.lm_head.weight, rolled, temperature, "none")
    else:
        log_probs, entropy = fused.FusedLinearForPPO()(hidden, self.lm_head.weight, rolled, temperature)
    return SimpleNamespace(log_probs=log_probs, entropy=entropy)


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite", "llama"])
@pytest.mark.parametrize("use_triton", [False, True], ids=["torch_backend", "triton_backend"])
def test_head_transform_of_the_running_model(plugin, family, use_triton):
    """Inside the wrapped forward, the fused call applies the model's softcap / logit scale: the log-probs
    and entropy equal float64 of the model's OWN logits (what verl's kernels, given the raw head weight,
    get wrong for Gemma 2 / Cohere / Granite)."""
    hf_models = pytest.importorskip("hf_models")
    model = hf_models.build(family)
    ids = torch.randint(1, hf_models.VOCAB, (2, hf_models.SEQ))
    forward = plugin.head.wrap_forward(_verl_like_forward)
    out = forward(model, ids, temperature=0.8, use_triton=use_triton, fused=plugin.functions)
    logits64 = model(input_ids=ids).logits.detach().double()   # softcap / scale applied by the model
    lp, ent = reference_log_probs(logits64, torch.roll(ids, -1, -1), 0.8)
    assert _err(out.log_probs.reshape(lp.shape), lp) <= ATOL
    assert _err(out.entropy.reshape(ent.shape), ent) <= ATOL
    assert plugin.head.current() is None   # the frame is gone after the forward


def test_sum_pi_squared_vs_float64(plugin):
    """With the engine's ``fusedce_sum_pi_squared=True`` the forward's output carries Σ_c p_c² of the
    model's distribution (softcap and temperature included) equal to float64; without it, nothing."""
    hf_models = pytest.importorskip("hf_models")
    model = hf_models.build("gemma2")
    ids = torch.randint(1, hf_models.VOCAB, (2, hf_models.SEQ))
    forward = plugin.head.wrap_forward(_verl_like_forward)
    out = forward(model, ids, temperature=0.6, fused=plugin.functions, fusedce_sum_pi_squared=True)
    q = transformed_logits(model(input_ids=ids).logits.detach().double(), 0.6)
    expected = torch.softmax(q, -1).pow(2).sum(-1)
    assert out.sum_pi_squared.shape == ids.shape
    assert _err(out.sum_pi_squared, expected) <= 1e-6
    plain = forward(model, ids, temperature=0.6, fused=plugin.functions)
    assert not hasattr(plain, "sum_pi_squared")


def test_batch_invariance_through_the_plugin(plugin, backend):
    """``configure(batch_invariant=True)``: each token's log-prob and entropy are bitwise the same whether
    computed alone or in a larger batch, under verl's module contract."""
    plugin.options.configure(batch_invariant=True, backend=backend)
    hidden, weight, labels = _inputs((3, 5))
    fused = plugin.functions.FusedLinearForPPO()
    with torch.no_grad():
        full_lp, full_ent = fused(hidden, weight, labels, 0.9)
        for row in range(3):
            lp, ent = fused(hidden[row:row + 1, 1:4], weight, labels[row:row + 1, 1:4], 0.9)
            assert torch.equal(lp[0], full_lp[row, 1:4]) and torch.equal(ent[0], full_ent[row, 1:4])


def test_rollout_top_p_and_top_k(plugin):
    """``configure(top_k=..., top_p=...)`` (the rollout's sampler): log-probs and entropy of the truncated,
    renormalized distribution, against the float64 sort-free reference; verl's "-1" means no top-k."""
    plugin.options.configure(top_k=-1, top_p=0.8)
    assert plugin.options.OPTIONS["top_k"] is None
    hidden, weight, labels = _inputs((1, 7), dtype=torch.float32, scale=0.5)
    x64 = (hidden.detach().double() @ weight.detach().double().T).reshape(7, V)
    labels[0, :4] = x64[:4].topk(2, dim=-1).indices[:, 1]   # kept (second largest) on 4 rows, random on 3
    log_probs, entropy = plugin.functions.FusedLinearForPPO()(hidden, weight, labels, 0.9)
    lp, ent = trunc64.reference(x64, labels.reshape(7), [0] * 7, [0.8] * 7, temperature=0.9)
    finite = torch.isfinite(lp)
    assert finite[:4].all()
    assert torch.equal(torch.isfinite(log_probs.reshape(7)), finite)
    assert _err(log_probs.reshape(7)[finite], lp[finite]) <= ATOL and _err(entropy.reshape(7), ent) <= ATOL
    plugin.options.configure(top_p=None, top_k=5)
    log_probs, entropy = plugin.functions.FusedLinearForPPO()(hidden, weight, labels, 0.9)
    lp, ent = trunc64.reference(x64, labels.reshape(7), [5] * 7, [1.0] * 7, temperature=0.9)
    assert _err(entropy.reshape(7), ent) <= ATOL


def test_sum_pi_squared_with_truncation_is_refused(plugin):
    plugin.options.configure(top_p=0.9)
    hidden, weight, labels = _inputs((1, 4))
    forward = plugin.head.wrap_forward(lambda self, **kw: SimpleNamespace(
        log_probs=plugin.functions.FusedLinearForPPO()(hidden, weight, labels)[0]))
    with pytest.raises(ValueError, match="calculate_sum_pi_squared with top_k / top_p"):
        forward(None, fusedce_sum_pi_squared=True)


def test_options_from_the_environment(plugin, monkeypatch):
    """``$FUSEDCE_VERL`` is the one place the options come from (``configure`` overrides); every bad
    value is a ValueError naming the option."""
    monkeypatch.setenv("FUSEDCE_VERL", "batch_invariant=0, logits_dtype=input,method=chunked,top_p=0.95,top_k=-1")
    plugin.options.load_env()
    assert plugin.options.OPTIONS == {**plugin.options.DEFAULTS, "batch_invariant": False, "logits_dtype": "input",
                                      "method": "chunked", "top_p": 0.95, "top_k": None}
    for text, match in [("top_p=1.5", "top_p must be"), ("method=fast", "method must be"),
                        ("batch_invariant=maybe", "batch_invariant must be"), ("colour=red", "unknown option 'colour'"),
                        ("top_p", "not name=value"), ("chunk_size=0", "chunk_size must be")]:
        monkeypatch.setenv("FUSEDCE_VERL", text)
        with pytest.raises(ValueError, match=match) as info:
            plugin.options.load_env()
        assert "$FUSEDCE_VERL" in str(info.value), info.value   # where the value came from
    with pytest.raises(ValueError, match=r"chunk_size must be an int >= 1 \(or None\), got 0"):
        plugin.options.configure(chunk_size=0)   # its own words only (it named top_k's "off" values)
    with pytest.raises(ValueError, match="logits_dtype must be"):
        plugin.options.configure(logits_dtype="bf16")


def test_options_that_cannot_go_together_are_refused_when_read(plugin, monkeypatch):
    """Fresh-user finding: docs/verl.md's example ``batch_invariant=1,top_p=0.95`` was accepted and every
    fused call then raised. Now the combination is a ValueError naming where it came from, nothing set."""
    for text in ("batch_invariant=1,top_p=0.95", "top_k=5,method=tiled"):
        monkeypatch.setenv("FUSEDCE_VERL", text)
        with pytest.raises(ValueError, match=r"\$FUSEDCE_VERL: top_k / top_p"):
            plugin.options.load_env()
    assert plugin.options.OPTIONS == plugin.options.DEFAULTS
    plugin.options.configure(top_p=0.9)
    with pytest.raises(ValueError, match="configure: top_k / top_p cannot go with batch_invariant"):
        plugin.options.configure(batch_invariant=True)
    assert plugin.options.OPTIONS["batch_invariant"] is False


@pytest.mark.parametrize("labels, match", [
    (torch.full((4,), 3.7), "int64 or int32 token ids, got torch.float32 .class indices stored as floats"),
    (torch.ones(4, dtype=torch.bool), "got torch.bool"), (torch.ones(4, dtype=torch.int16), "got torch.int16")])
def test_labels_that_are_not_token_ids_are_refused(plugin, labels, match):
    """Fresh-user finding: float, bool and int16 labels were cast with ``.long()`` (3.7 scored as class 3)."""
    hidden, weight, _ = _inputs((1, 4))
    with pytest.raises(TypeError, match=match):
        plugin.functions.FusedLinearForPPO()(hidden, weight, labels.reshape(1, 4))
    with pytest.raises(TypeError, match="process group must be a torch.distributed.ProcessGroup or None, got str"):
        plugin.functions.linear_cross_entropy(hidden.reshape(4, -1), weight, torch.zeros(4, dtype=torch.long), 1.0,
                                              "none", "tp")


def test_import_without_verl_is_refused():
    """Importing the plugin where verl does not import (absent, or installed without its dependencies):
    ImportError naming verl 0.9.1 (nothing patched)."""
    from verl_present import verl_importable
    if verl_importable():
        pytest.skip("verl imports here (make test-verl runs the plugin against it)")
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k.startswith("fusedce.integrations.verl")}
    had_verl = "verl" in sys.modules
    try:
        with pytest.raises(ImportError, match=r"needs verl 0\.9\.1") as caught:
            importlib.import_module("fusedce.integrations.verl")
        from importlib import metadata
        try:   # installed without its dependencies (make install's --no-deps copy): said so, not "pip install"
            installed = metadata.version("verl")
            assert f"verl {installed} is installed but does not import" in str(caught.value), str(caught.value)
        except metadata.PackageNotFoundError:
            assert "pip install verl==0.9.1" in str(caught.value), str(caught.value)
    finally:
        for k in [k for k in sys.modules if k.startswith("fusedce.integrations.verl")]:
            del sys.modules[k]
        if not had_verl:
            sys.modules.pop("verl", None)
        sys.modules.update(saved)


@pytest.mark.parametrize("options, want_sq, match", [
    ({"method": "tiled"}, False, "method='tiled'.*method='chunked'"),
    ({"batch_invariant": True, "logits_dtype": "input"}, False, "batch_invariant=1"),
    ({"batch_invariant": True}, True, "batch_invariant=1")])
def test_tensor_parallel_route_refuses_what_the_vocab_parallel_op_lacks(plugin, options, want_sq, match):
    """verl's Megatron call (a tensor-parallel group): options the vocabulary-parallel route cannot honour are a
    ValueError naming them and what to set instead, raised before any collective."""
    from fusedce.integrations.hf.head import LogitTransform
    plugin.options.configure(**options)
    hidden, weight, labels = _inputs((1, 4))
    with pytest.raises(ValueError, match=f"{match}"):
        plugin.tensor_parallel.log_probs(hidden.reshape(4, H), weight, labels.reshape(4), 1.0, LogitTransform(),
                                         None, plugin.options.OPTIONS, want_sq)
