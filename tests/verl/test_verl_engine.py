"""The plugin inside verl 0.9.1 itself (``make test-verl``: its own venv; skipped where verl is not
installed). verl's actor engine (``FSDPEngineWithLMHead.forward_step``, its PPO loss; what cannot run on CPU
and why: ``verl_engine.py``) computing log-probs, entropy, Σπ² and one policy update on a tiny HF Llama and a
tiny Gemma 2 (softcap 2.0), plugin vs verl's torch backend vs float64; batch invariance through the function
verl's forward calls; the Megatron engine's call over a 2-rank tensor-parallel group; the fingerprint
refusal."""
import copy

import pytest
import torch

from verl_present import verl_importable

if not verl_importable():
    pytest.skip("verl does not import here (make test-verl runs these in its own venv)", allow_module_level=True)

import hf_models  # noqa: E402
from tolerances import HF_RTOL  # noqa: E402
from reference64_log_probs import reference_log_probs, transformed_logits  # noqa: E402
import verl_engine  # noqa: E402

ATOL = 2e-5   # fp32 math on the exact bf16 values the float64 reference also uses
CLASSES = (hf_models.transformers.LlamaForCausalLM, hf_models.transformers.Gemma2ForCausalLM)
FORWARDS = {cls: cls.__dict__["forward"] for cls in CLASSES}   # transformers' own (verl patches the class)


@pytest.fixture
def plugin(monkeypatch):
    """The plugin activated (imported, as verl's external_lib does), the engine on the CPU; verl's own
    functions and the model classes' forwards restored afterwards."""
    import fusedce.integrations.verl as plugin
    verl_engine.cpu_device(monkeypatch)
    plugin.patch_verl()
    yield plugin
    plugin.unpatch_verl()
    for cls, forward in FORWARDS.items():
        cls.forward = forward


def _model(family, dtype):
    model = hf_models.build(family, tied=False).to(dtype)
    with torch.no_grad():   # O(10) logits: bf16 rounding and the softcap of 2.0 both matter
        model.lm_head.weight.mul_(40.0)
    return model


def _fused(model, backend="torch"):
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend=backend)
    return model


def _capture_hidden(model):
    """The backbone's last hidden state of the next forward (what verl passes to the fused function)."""
    seen = []
    model.model.register_forward_hook(lambda m, a, out: seen.append(out[0].detach()))
    return seen


def _reference(model, hidden, batch, temperature):
    """float64 log-probs, entropy and Σπ² (packed, (N,)) of the same hidden values and head weight, with
    the model's softcap (``final_logit_softcapping``, None for Llama)."""
    x64 = hidden.double().reshape(-1, hidden.shape[-1]) @ model.lm_head.weight.detach().double().T
    labels = torch.roll(batch["input_ids"].values(), -1)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    lp, ent = reference_log_probs(x64, labels, temperature, softcap)
    q = transformed_logits(x64, temperature, softcap)
    return lp, ent, torch.softmax(q, -1).pow(2).sum(-1)


def _run(model, batch, loss=None):
    out = verl_engine.engine(model).forward_step(batch, loss, forward_only=loss is None)
    return out


def _close(actual, expected, name):
    """fp32 against fp32 computed in another order: the logits are O(40) here (the head scaled up), so their
    few-ulp differences (~1e-5 absolute) reach every gradient; each element is judged against 2e-5 of the
    tensor's largest magnitude (hf_models' per-element rtol alone fails entries near zero)."""
    scale = float(expected.detach().abs().max())
    torch.testing.assert_close(actual, expected, rtol=HF_RTOL, atol=2e-5 * scale + 1e-12, msg=name)


def _err(actual, expected):
    """max |actual - expected|; equal infinities (a label outside its kept top-k / top-p set: -inf) count 0."""
    a, e = actual.detach().double(), expected.detach().double()
    return float(torch.where((a == e) & a.isinf(), 0.0, (a - e).abs()).max())


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_actor_log_probs_entropy_and_sum_pi_squared(plugin, family, backend):
    """verl's engine with use_fused_kernels on a bf16 model: through the plugin, log-probs, entropy and Σπ²
    (``calculate_sum_pi_squared``, which verl refuses with fused kernels) within fp32 rounding of float64 of
    the same hidden values, softcap included; verl's own torch backend on the same model is off by its bf16
    logits (Llama) or by the softcap it ignores (Gemma 2)."""
    temperature = 0.8
    model = _fused(_model(family, torch.bfloat16), backend)
    seen = _capture_hidden(model)
    batch = verl_engine.micro_batch([3, 4], [5, 6], hf_models.VOCAB, sum_pi_squared=True, temperature=temperature)
    _, out = _run(model, batch)
    lp, ent, sq = _reference(model, seen[-1], batch, temperature)
    got = out["model_output"]
    assert _err(got["log_probs"].values(), lp) <= ATOL
    assert _err(got["entropy"].values(), ent) <= ATOL
    assert _err(got["sum_pi_squared"].values(), sq) <= 1e-6

    plugin.unpatch_verl()   # verl's own torch backend, same model and batch (no Σπ²: verl raises for it)
    _fused(model, "torch")
    batch = verl_engine.micro_batch([3, 4], [5, 6], hf_models.VOCAB, temperature=temperature)
    _, theirs = _run(model, batch)
    verl_err = _err(theirs["model_output"]["log_probs"].values(), lp)
    print(f"{family}: log-prob error vs float64: plugin {_err(got['log_probs'].values(), lp):.2e}, "
          f"verl torch backend {verl_err:.2e}")
    assert verl_err > 10 * ATOL
    with pytest.raises(NotImplementedError, match="calculate_sum_pi_squared"):
        _run(model, verl_engine.micro_batch([3], [4], hf_models.VOCAB, sum_pi_squared=True))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_one_policy_update(plugin, family):
    """One PPO step (verl's ppo_loss, backward, SGD) through the plugin's fused kernels equals the step of
    verl's non-fused path (full logits, verl's own log-probs and entropy from them) on an fp32 model: loss,
    every parameter's gradient, the updated parameters. verl's fused torch backend misses the softcap on
    Gemma 2, so its loss differs there."""
    base = _model(family, torch.float32)
    fused, plain = copy.deepcopy(base), copy.deepcopy(base)
    results = {}
    for name, model, is_fused in (("plugin", fused, True), ("verl_logits", plain, False)):
        model.train()
        if is_fused:
            _fused(model)
        else:   # verl's apply_monkey_patch replaced the class's forward: transformers' own for this run
            type(model).forward = FORWARDS[type(model)]
        batch = verl_engine.micro_batch([3, 4], [5, 6], hf_models.VOCAB, fused=is_fused)
        loss, _ = _run(model, batch, verl_engine.ppo_loss())
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        results[name] = (loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()})
    (loss_a, grads_a, params_a), (loss_b, grads_b, params_b) = results["plugin"], results["verl_logits"]
    _close(loss_a, loss_b, "loss")
    assert grads_a.keys() == grads_b.keys() and "lm_head.weight" in grads_a
    for n in grads_a:
        _close(grads_a[n], grads_b[n], n)
        _close(params_a[n], params_b[n], n)

    plugin.unpatch_verl()
    theirs = _fused(copy.deepcopy(base))
    loss_c, _ = _run(theirs, verl_engine.micro_batch([3, 4], [5, 6], hf_models.VOCAB), verl_engine.ppo_loss())
    if family == "gemma2":
        assert abs(float(loss_c) - float(loss_b)) > 1e-3   # verl's fused kernel ignores the softcap
    else:
        _close(loss_c.detach(), loss_b, "verl's torch backend loss")


def test_batch_invariance_through_verls_function(plugin):
    """``configure(batch_invariant=True)``: the function verl's forward gets from
    ``verl.utils.experimental.torch_functional`` gives each token the same bits alone or in a batch."""
    from verl.utils.experimental import torch_functional
    plugin.configure(batch_invariant=True)
    hidden = torch.randn(1, 12, hf_models.HIDDEN, dtype=torch.bfloat16) * 3
    weight = torch.randn(hf_models.VOCAB, hf_models.HIDDEN, dtype=torch.bfloat16)
    labels = torch.randint(0, hf_models.VOCAB, (1, 12))
    fused = torch_functional.FusedLinearForPPO()
    full_lp, full_ent = fused(hidden, weight, labels, 0.7)
    for start, stop in ((0, 1), (3, 8), (11, 12)):
        lp, ent = fused(hidden[:, start:stop], weight, labels[:, start:stop], 0.7)
        assert torch.equal(lp, full_lp[:, start:stop]) and torch.equal(ent, full_ent[:, start:stop])


def _megatron_rank(rank, world, path, hidden, weight, labels, out):
    import torch.distributed as dist
    import fusedce.integrations.verl  # noqa: F401  (activates the plugin in this process)
    from verl.models.mcore import model_forward_fused
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        shard = weight.chunk(world)[rank].clone().requires_grad_()
        h = hidden.clone().requires_grad_()
        # as _fused_GPTModel_forward calls it: hidden [s, 1, H], the rank's output-layer shard, labels [1, s]
        lp, ent = model_forward_fused.linear_cross_entropy(h, shard, labels, 0.9, "none", dist.group.WORLD)
        (lp.sum() + 0.5 * ent.sum()).backward()
        torch.save({"lp": lp.detach(), "ent": ent.detach(), "dh": h.grad, "dw": shard.grad}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_megatron_route_over_tensor_parallel_ranks(plugin, tmp_path):
    """verl's Megatron fused forward calls ``linear_cross_entropy`` (the plugin's, in its module) with the
    tensor-parallel group: on 2 ranks, log-probs and entropy equal float64 of the whole head, the weight
    shards' gradients are the slices of the whole gradient, and the ranks' hidden gradients add up to the
    whole one (the share verl's kernel returns; the sequence-parallel gather's backward adds them)."""
    import torch.multiprocessing as mp
    from verl.models.mcore import model_forward_fused
    assert model_forward_fused.linear_cross_entropy is plugin.patch.functions.linear_cross_entropy
    hidden = torch.randn(10, 1, hf_models.HIDDEN) * 2
    weight = torch.randn(hf_models.VOCAB + 1, hf_models.HIDDEN)   # 212 rows: 106 per rank
    labels = torch.randint(0, hf_models.VOCAB + 1, (1, 10))
    mp.start_processes(_megatron_rank, args=(2, tmp_path / "store", hidden, weight, labels, tmp_path / "out"),
                       nprocs=2, start_method="spawn")
    ranks = [torch.load(f"{tmp_path / 'out'}.{r}") for r in range(2)]
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp, ent = reference_log_probs(h64.reshape(10, -1) @ w64.T, labels.reshape(10), 0.9)
    (lp.sum() + 0.5 * ent.sum()).backward()
    for r in ranks:
        assert _err(r["lp"], lp) <= ATOL and _err(r["ent"], ent) <= ATOL
    assert _err(ranks[0]["dh"] + ranks[1]["dh"], h64.grad) <= 1e-4
    assert _err(torch.cat([ranks[0]["dw"], ranks[1]["dw"]]), w64.grad) <= 1e-4


OPTION_CASES = (   # (name, plugin options, dtype, Σπ² asked): the tensor-parallel route's options (issue 45)
    ("top_k_top_p", {"top_k": 5, "top_p": 0.9}, torch.float32, False),
    ("logits_input", {"logits_dtype": "input"}, torch.bfloat16, False),
    ("sum_pi_squared", {}, torch.float32, True))


def _fused_call(fn, h, weight, labels, group, options, want_sq):
    """``fn`` (verl's Megatron module's ``linear_cross_entropy``, or the plugin's on one process) with the plugin's
    ``options``; with ``want_sq`` inside a frame asking for Σπ² (as the engine hook opens one)."""
    from fusedce.integrations.hf.head import LogitTransform
    from fusedce.integrations.verl import configure, head, options as opts
    opts.OPTIONS.clear()
    opts.OPTIONS.update(opts.DEFAULTS)
    configure(**options)
    frame = head.Frame(LogitTransform(), want_sq)
    head._stack().append(frame)
    try:
        lp, ent = fn(h, weight, labels, 0.9, "none", group)
    finally:
        head._stack().pop()
    return lp, ent, frame.results.get("sum_pi_squared")


def _megatron_options_rank(rank, world, path, hidden, weight, labels, out):
    import torch.distributed as dist
    import fusedce.integrations.verl  # noqa: F401  (activates the plugin in this process)
    from verl.models.mcore import model_forward_fused
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        saved = {}
        for name, options, dtype, want_sq in OPTION_CASES:
            shard = weight.to(dtype).chunk(world)[rank].clone().requires_grad_()
            h = hidden.to(dtype).clone().requires_grad_()
            lp, ent, sq = _fused_call(model_forward_fused.linear_cross_entropy, h, shard, labels, dist.group.WORLD,
                                      options, want_sq)
            (lp.sum() + 0.5 * ent.sum()).backward()
            saved[name] = {"lp": lp.detach(), "ent": ent.detach(), "sq": sq, "dh": h.grad, "dw": shard.grad}
        torch.save(saved, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_megatron_route_options_over_tensor_parallel_ranks(plugin, tmp_path):
    """The Megatron call over 2 tensor-parallel ranks with the plugin's top_k / top_p, logits_dtype='input' and
    Σπ² (one spawn): log-probs, entropy, Σπ² and the gradients (the ranks' hidden shares added, the weight
    shards concatenated) equal the plugin's single-process call on the whole head (itself float64-checked in
    test_verl_functions), within fp32 rounding (bf16: the gradients' rounding)."""
    import torch.multiprocessing as mp
    from fusedce.integrations.verl import functions
    hidden = torch.randn(10, 1, hf_models.HIDDEN) * 2
    weight = torch.randn(hf_models.VOCAB + 1, hf_models.HIDDEN)   # 212 rows: 106 per rank
    labels = torch.randint(0, hf_models.VOCAB + 1, (1, 10))
    mp.start_processes(_megatron_options_rank, args=(2, tmp_path / "store", hidden, weight, labels,
                                                      tmp_path / "out"), nprocs=2, start_method="spawn")
    ranks = [torch.load(f"{tmp_path / 'out'}.{r}") for r in range(2)]
    for name, options, dtype, want_sq in OPTION_CASES:
        h, w = (t.to(dtype).clone().requires_grad_() for t in (hidden, weight))
        lp, ent, sq = _fused_call(functions.linear_cross_entropy, h, w, labels, None, options, want_sq)
        (lp.sum() + 0.5 * ent.sum()).backward()
        grad_tol = 1e-4 if dtype == torch.float32 else 2.0 ** -6 * float(h.grad.abs().max())
        for r in ranks:
            got = r[name]
            assert _err(got["lp"], lp) <= ATOL and _err(got["ent"], ent) <= ATOL, name
            if want_sq:   # exp(logsumexp(2q) - 2 logsumexp(q)): a few fp32 ulps of |q| (O(30) here)
                q = (hidden.double().reshape(10, -1) @ weight.double().T) / 0.9
                bound = 16 * 2.0 ** -24 * (1 + float(q.abs().max()))
                assert got["sq"].shape == sq.shape and _err(got["sq"], sq) <= bound, name
                expected = torch.softmax(q, -1).square().sum(-1)
                assert _err(got["sq"].reshape(-1), expected) <= bound, name
        assert _err(ranks[0][name]["dh"].float() + ranks[1][name]["dh"].float(), h.grad.float()) <= grad_tol, name
        assert _err(torch.cat([ranks[0][name]["dw"], ranks[1][name]["dw"]]).float(), w.grad.float()) <= \
            (1e-4 if dtype == torch.float32 else 2.0 ** -6 * float(w.grad.abs().max())), name
    assert bool(ranks[0]["top_k_top_p"]["lp"].isinf().any())   # the truncation took effect (-inf outside)


def test_megatron_forward_step_sum_pi_squared(plugin):
    """verl's Megatron ``forward_step`` raises for Σπ² with fused kernels; the plugin's wrapper runs it on a copy
    that does not ask, inside a frame asking the fused call for Σπ², and lays Σπ² out with the fused forward's
    own layout step (``postprocess_thd_engine``, the log-probs' arguments). The step body here is a stand-in
    with verl's refusal, fused call and layout call (a Megatron model does not build on CPU); the real step's
    source is fingerprinted (``version.py``). Σπ² equals float64; the caller's batch still asks for it."""
    import types
    from tensordict import TensorDict
    from verl.models.mcore import model_forward_fused as fused
    from verl.utils import tensordict_utils as tu
    from fusedce.integrations.verl import megatron_engine
    hidden = torch.randn(7, hf_models.HIDDEN) * 2
    weight = torch.randn(hf_models.VOCAB, hf_models.HIDDEN)
    labels = torch.randint(0, hf_models.VOCAB, (1, 7))

    def verl_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        batch = next(batch_iter)
        if tu.get_non_tensor_data(batch, key="calculate_sum_pi_squared", default=False):
            raise NotImplementedError("calculate_sum_pi_squared=True is not supported with use_fused_kernels=True")
        lp, ent = fused.linear_cross_entropy(hidden, weight, labels, 0.8, "none", None)
        laid = fused.postprocess_thd_engine(lp.unsqueeze(0), None, None, 1, post_process=False)
        return {"log_probs": laid, "entropy": ent}, "post"

    step = megatron_engine.wrap_forward_step(verl_step)
    engine = types.SimpleNamespace(engine_config=types.SimpleNamespace(use_fused_kernels=True))
    batch = TensorDict({"input_ids": labels}, batch_size=[1])
    tu.assign_non_tensor_data(batch, "calculate_sum_pi_squared", True)
    output, post = step(engine, iter([batch]), None, None, None)
    q = (hidden.double() @ weight.double().T) / 0.8
    assert post == "post" and output["sum_pi_squared"].shape == output["log_probs"].shape == (1, 7)
    assert _err(output["sum_pi_squared"].reshape(-1), torch.softmax(q, -1).square().sum(-1)) <= 1e-6
    assert tu.get_non_tensor_data(batch, key="calculate_sum_pi_squared", default=False)
    tu.assign_non_tensor_data(batch, "calculate_sum_pi_squared", False)   # not asked: verl's step as is
    output, _ = step(engine, iter([batch]), None, None, None)
    assert "sum_pi_squared" not in output
    import verl.workers.engine.megatron.transformer_impl as megatron
    assert getattr(megatron.MegatronEngineWithLMHead.forward_step, "_fusedce_verl", False)
    assert getattr(fused.postprocess_thd_engine, "_fusedce_verl", False)


def test_refuses_what_it_was_not_written_for(plugin, monkeypatch):
    """Another verl version, or a piece whose source differs from verl 0.9.1's: RuntimeError naming the
    supported version / the piece, and nothing replaced."""
    import verl
    from verl.models.transformers import dense_common
    from verl.utils.experimental import torch_functional
    plugin.unpatch_verl()
    original = torch_functional.FusedLinearForPPO
    monkeypatch.setattr(verl, "__version__", "0.9.2")
    with pytest.raises(RuntimeError, match=r"written against verl 0\.9\.1 and verl 0\.9\.2"):
        plugin.patch_verl()
    monkeypatch.setattr(verl, "__version__", "0.9.1")

    def forward_with_torch_backend(self, *args, **kwargs):   # a release that changed the HF forward
        raise AssertionError

    monkeypatch.setattr(dense_common, "forward_with_torch_backend", forward_with_torch_backend)
    with pytest.raises(RuntimeError, match="dense_common:forward_with_torch_backend in the installed verl 0.9.1 "
                                           "differs"):
        plugin.patch_verl()
    assert torch_functional.FusedLinearForPPO is original and not plugin.is_patched()
