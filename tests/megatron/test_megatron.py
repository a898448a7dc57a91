"""``fusedce.patch_megatron`` on a tiny megatron-core ``GPTModel`` with tensor parallelism over 2 gloo
processes (``dist_harness.py``; ``megatron_models.py`` the model and its CPU stand-ins).

Each check builds the model once and runs it stock and patched on the same weights and batch: the
patched ``[b, s]`` fp32 per-token loss and every parameter's gradient equal the stock model's (tied and
untied head), the output layer's GEMM never runs while patched (a spy on its ``_forward_impl``), the loss
options and the log-prob entry equal the float64 reference on the stock model's gathered logits, calls
without labels are unchanged, and what the patch does not support raises. fp32 throughout; tolerances
are torch's fp32 defaults (the two paths differ by the order of fp32 sums only). One backend (torch): the
vocab-parallel op's backends are compared in tests/distributed/.

3 ranks are not tested: megatron-core needs V and the attention heads divisible by the TP size, so its
vocabulary shards are always even (the uneven case of the op itself is in tests/distributed/).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="megatron-core is installed by `make install` (the megatron extra)")

import fusedce  # noqa: E402
import fusedce.integrations.megatron.version  # noqa: E402
from dist_harness import assert_passed, results  # noqa: E402
from megatron_models import HIDDEN, VOCAB, batch, tiny_gpt  # noqa: E402
from reference64 import reference_loss  # noqa: E402
from reference64_log_probs import reference_log_probs  # noqa: E402

WORLD = 2
CHECKS = {}
RELEASE = fusedce.integrations.megatron.version.check_megatron()   # the installed release's route


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _grads(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _run(model, inputs, upstream, **kwargs):
    """Forward with labels, backward of ``sum(loss * upstream)``; (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    ids, pos, mask, labels = inputs
    loss = model(ids, pos, mask, labels=labels, **kwargs)
    (loss * upstream).sum().backward()
    return loss.detach(), _grads(model)


def _gemm_spy(model) -> list:
    """Counts the output layer's matmuls (``ColumnParallelLinear._forward_impl``) into the returned list."""
    layer, calls = model.output_layer, []
    stock = layer._forward_impl

    def spy(*args, **kwargs):
        calls.append(1)
        return stock(*args, **kwargs)

    layer._forward_impl = spy
    return calls


class _Gather(torch.autograd.Function):
    """``[..., V/TP]`` shards -> ``[..., V]`` on every rank; backward keeps this rank's slice of the
    gradient (every rank computes the same loss from the gathered logits: Megatron's gather, which asks
    for a CUDA buffer)."""

    @staticmethod
    def forward(ctx, shard):
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, shard.contiguous())
        ctx.width = shard.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        start = dist.get_rank() * ctx.width
        return grad[..., start:start + ctx.width]


def _gathered_logits(model, inputs) -> torch.Tensor:
    """The stock model's full ``[b, s, V]`` logits, differentiable."""
    ids, pos, mask, _ = inputs
    return _Gather.apply(model(ids, pos, mask))


def _assert_same(loss, grads, ref_loss, ref_grads):
    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape and loss.is_contiguous()
    torch.testing.assert_close(loss, ref_loss.to(loss.dtype))
    assert grads.keys() == ref_grads.keys() and grads, sorted(set(grads) ^ set(ref_grads))
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], msg=lambda m, n=name: f"grad of {n}: {m}")


def _stock_vs_patched(rank, world, tied, sp):
    model = tiny_gpt(world, tied=tied, sequence_parallel=sp)
    assert model.output_layer.sequence_parallel == sp
    inputs = batch()
    upstream = torch.rand(inputs[3].shape) + 0.5
    calls = _gemm_spy(model)
    ref_loss, ref_grads = _run(model, inputs, upstream)
    assert calls, "the spy saw no output-layer GEMM in the stock model: it cannot see one in the patched"
    fusedce.patch_megatron(model)
    calls.clear()
    loss, grads = _run(model, inputs, upstream)
    assert not calls, f"the patched model ran the output layer's GEMM {len(calls)} time(s)"
    _assert_same(loss, grads, ref_loss, ref_grads)
    fusedce.unpatch_megatron(model)
    assert not {"forward", "_postprocess", "compute_language_model_loss"} & set(vars(model))
    assert "forward" not in vars(model.output_layer)


CHECKS.update({f"{'tied' if tied else 'untied'}_head{'_sequence_parallel' if sp else ''}":
               functools.partial(_stock_vs_patched, tied=tied, sp=sp)
               for tied in (True, False) for sp in (False, True)})


def _mtp_metrics() -> dict:
    """What megatron-core logged for the MTP heads since the last call (the loss; from 0.19 the acceptance
    counts), cleared."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    logged = {k: v.clone() for k, v in MTPLossLoggingHelper.tracker.items() if isinstance(v, torch.Tensor)}
    MTPLossLoggingHelper.tracker.clear()
    return logged


def _multi_token_prediction(rank, world, tied, sp, mup=False):
    # training mode: megatron-core logs each MTP loss (MTPLossLoggingHelper, a tensor on
    # torch.cuda.current_device(): "cpu" here; 0.19 adds the acceptance counts, an argmax over the head's
    # logits) and folds its gradient into the main head's (MTPLossAutoScaler)
    from fusedce.integrations.megatron import megatron_token_log_probs
    config = dict(use_mup=True, mup_base_hidden_size=HIDDEN // 2) if mup else {}   # mup_output_mult = 0.5
    model = tiny_gpt(world, tied=tied, mtp_num_layers=1, sequence_parallel=sp, **config).train()
    assert not mup or model.config.mup_output_mult == 0.5
    inputs = batch(4)
    upstream = torch.rand(inputs[3].shape) + 0.5
    loss_mask = (torch.rand(inputs[3].shape) > 0.25).float()
    calls = _gemm_spy(model)
    _mtp_metrics()
    ref_loss, ref_grads = _run(model, inputs, upstream, loss_mask=loss_mask)
    ref_logged = _mtp_metrics()
    assert len(calls) == 2, f"stock: {len(calls)} output-layer GEMMs, expected the main head's and one MTP head's"
    assert any(name.startswith("mtp.") for name in ref_grads) and ref_logged
    fusedce.patch_megatron(model)
    calls.clear()
    loss, grads = _run(model, inputs, upstream, loss_mask=loss_mask)
    assert not calls, f"the patched model ran the output layer's GEMM {len(calls)} time(s)"
    _assert_same(loss, grads, ref_loss, ref_grads)
    logged = _mtp_metrics()
    assert logged.keys() == ref_logged.keys()
    for key in logged:
        torch.testing.assert_close(logged[key], ref_logged[key], msg=lambda m, k=key: f"MTP {k}: {m}")
    with pytest.raises(ValueError, match="multi-token"):
        megatron_token_log_probs(model, *inputs)


CHECKS.update({f"multi_token_prediction_{'tied' if tied else 'untied'}{'_sequence_parallel' if sp else ''}":
               functools.partial(_multi_token_prediction, tied=tied, sp=sp)
               for tied, sp in ((False, False), (True, True))})
if RELEASE.scale_logits:   # MuP (0.17+): the logits times mup_output_mult, main and MTP heads
    CHECKS["multi_token_prediction_mup_sequence_parallel"] = functools.partial(
        _multi_token_prediction, tied=False, sp=True, mup=True)


if RELEASE.acceptance_counts:
    @check
    def mtp_acceptance_counts(rank, world):
        # 0.19's count of argmax hits per MTP head, from the fused loss's predictions vs the stock
        # vocabulary-parallel argmax over real logits; half the labels are the argmax (hits), ties none
        from megatron.core.transformer import multi_token_prediction as mtp
        from fusedce.integrations.megatron import acceptance, head
        acceptance.install()
        s, b, hidden_size, vocab = 6, 2, 8, 16
        hidden, full = torch.randn(s, b, hidden_size), torch.randn(vocab, hidden_size)
        shard = full.chunk(world)[rank]
        labels = (hidden @ full.T).argmax(-1).transpose(0, 1).clone()
        labels[:, ::2] = torch.randint(0, vocab, labels[:, ::2].shape)
        labels[0, 1] = -100
        loss_mask = (torch.rand(b, s) > 0.2).float()
        layer = tiny_gpt(world, tied=False).output_layer
        stock = mtp._compute_mtp_acceptance_counts(hidden @ shard.T, labels, loss_mask, layer, None,
                                                   dist.group.WORLD)
        deferred = head.DeferredLogits(hidden, shard, None, dist.group.WORLD)
        head.loss(deferred, labels, {}, None, predictions=True)
        ours = mtp._compute_mtp_acceptance_counts(deferred, labels, loss_mask, layer, None, dist.group.WORLD)
        assert stock[0] > 0 and stock[1] > stock[0]
        torch.testing.assert_close(ours, stock, rtol=0, atol=0)


@check
def route_and_own_output_processor(rank, world):
    # 0.18+: the main head through GPTModel.forward's output_processor hook (no _postprocess replaced);
    # before: the _postprocess wrapper. A caller's own output_processor runs as given (stock logits).
    from fusedce.integrations.megatron import patch
    model = tiny_gpt(world, tied=False, sequence_parallel=True)
    ids, pos, mask, labels = batch(5)
    stock = model(ids, pos, mask, labels=labels).detach()
    fusedce.patch_megatron(model)
    assert ("_postprocess" in vars(model)) != RELEASE.output_processor
    if not RELEASE.output_processor:
        return
    hooked, spied = [], patch._output_processor
    patch._output_processor = lambda **kw: hooked.append(1) or spied(**kw)
    try:
        torch.testing.assert_close(model(ids, pos, mask, labels=labels).detach(), stock)
    finally:
        patch._output_processor = spied
    assert hooked == [1]

    def own(**kw):
        logits, _ = kw["output_layer"](kw["hidden_states"], weight=kw["output_weight"],
                                       runtime_gather_output=kw["runtime_gather_output"])
        return kw["compute_language_model_loss"](kw["labels"], kw["scale_logits"](logits))

    calls = _gemm_spy(model)
    torch.testing.assert_close(model(ids, pos, mask, labels=labels, output_processor=own).detach(), stock)
    assert calls, "the caller's output_processor did not get the stock output layer"


@check
def loss_options_and_token_weights(rank, world):
    options = dict(label_smoothing=0.1, lse_square_scale=1e-2, softcap=3.0, logit_scale=1.5)
    model = tiny_gpt(world, tied=False)
    inputs = batch(1)
    weights = torch.rand(inputs[3].shape)
    upstream = torch.rand(inputs[3].shape) + 0.5
    model.zero_grad(set_to_none=True)
    ref, _ = reference_loss(_gathered_logits(model, inputs).double(), inputs[3], reduction="none",
                            token_weights=weights, **options)
    (ref * upstream).sum().backward()
    ref_grads = _grads(model)
    fusedce.patch_megatron(model, deterministic=True, **options)
    loss, grads = _run(model, inputs, upstream, token_weights=weights)
    _assert_same(loss, grads, ref.detach(), ref_grads)


@check
def without_labels_unchanged(rank, world):
    model = tiny_gpt(world, tied=True)
    ids, pos, mask, _ = batch(2)
    stock = model(ids, pos, mask)
    fusedce.patch_megatron(model)
    calls = _gemm_spy(model)
    patched = model(ids, pos, mask)
    assert calls and patched.shape == (ids.shape[0], ids.shape[1], VOCAB // world)
    torch.testing.assert_close(patched, stock, rtol=0, atol=0)


def _token_log_probs_and_entropy(rank, world, sp, classes=None):
    # classes: K target classes per token ([b, s, K], one of them ignored) instead of one
    from fusedce.integrations.megatron import megatron_token_log_probs
    model = tiny_gpt(world, tied=True, sequence_parallel=sp)
    inputs = batch(3)
    ids, pos, mask, target = inputs
    if classes is not None:
        target = torch.randint(0, VOCAB, (*target.shape, classes))
        target[0, 1, 0] = -100
        inputs = (ids, pos, mask, target)
    up_lp, up_ent = torch.rand(target.shape), torch.rand(target.shape[:2])
    model.zero_grad(set_to_none=True)
    ref_lp, ref_ent = reference_log_probs(_gathered_logits(model, inputs).double(), target, temperature=0.7)
    ((ref_lp * up_lp).sum() + (ref_ent * up_ent).sum()).backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    calls = _gemm_spy(model)
    out = megatron_token_log_probs(model, ids, pos, mask, target, temperature=0.7, return_entropy=True)
    assert not calls and isinstance(out, fusedce.TokenLogProbs)
    ((out.log_probs * up_lp).sum() + (out.entropy * up_ent).sum()).backward()
    _assert_same(out.log_probs.detach(), _grads(model), ref_lp.detach(), ref_grads)
    torch.testing.assert_close(out.entropy.detach(), ref_ent.detach().float())
    assert "_fusedce_megatron" not in vars(model), "the temporary patch was not undone"


CHECKS.update({f"token_log_probs_and_entropy{'_sequence_parallel_3_classes' if sp else ''}":
               functools.partial(_token_log_probs_and_entropy, sp=sp, classes=3 if sp else None)
               for sp in (False, True)})


@check
def errors(rank, world):
    from megatron.core import package_info
    model = tiny_gpt(world, tied=False)
    with pytest.raises(TypeError, match="reduction"):
        fusedce.patch_megatron(model, reduction="mean")
    with pytest.raises(ValueError, match="label_smoothing"):
        fusedce.patch_megatron(model, label_smoothing=1.5)
    with pytest.raises(ValueError, match="post_process"):
        fusedce.patch_megatron(tiny_gpt(world, tied=False, post_process=False))
    with pytest.raises(TypeError, match="GPTModel"):
        fusedce.patch_megatron(torch.nn.Linear(2, 2))
    layer, model.output_layer = model.output_layer, torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="ColumnParallelLinear.*get_gpt_layer_local_spec"):
        fusedce.patch_megatron(model)
    model.output_layer = layer
    version, package_info.__version__ = package_info.__version__, "0.15.0"
    try:
        with pytest.raises(RuntimeError, match="0.16.1, 0.17.0, 0.18.0, 0.19.2"):
            fusedce.patch_megatron(model)
    finally:
        package_info.__version__ = version
    from fusedce.integrations.megatron import version as mversion
    fingerprints = mversion.check_megatron().fingerprints
    for name in list(fingerprints):
        expected, fingerprints[name] = fingerprints[name], "0" * 16
        try:
            with pytest.raises(RuntimeError, match="differs"):
                fusedce.patch_megatron(model)
        finally:
            fingerprints[name] = expected
    gtp = vars(model.output_layer).get("gtp_remat_size")   # 0.19: the weight's second shard axis (1: none)
    model.output_layer.gtp_remat_size = 2
    with pytest.raises(NotImplementedError, match="gtp_remat_size"):
        fusedce.patch_megatron(model)
    if gtp is None:
        del model.output_layer.gtp_remat_size
    else:
        model.output_layer.gtp_remat_size = gtp
    with pytest.raises(TypeError, match="HybridModel.*output_processor"):
        fusedce.patch_megatron(type("HybridModel", (torch.nn.Module,), {})())
    assert "_fusedce_megatron" not in vars(model), "a refused patch left state behind"
    fusedce.patch_megatron(model)
    ids, pos, mask, labels = batch()
    with pytest.raises(ValueError, match="token_weights"):
        model(ids, pos, mask, labels=labels, token_weights=torch.ones(labels.shape[1], labels.shape[0]))
    with pytest.raises(ValueError, match="without labels"):
        model(ids, pos, mask, token_weights=torch.ones(labels.shape))


@pytest.mark.parametrize("name", list(CHECKS))
def test_patch_megatron(name, request, tmp_path_factory):
    outcome = results(__name__, CHECKS, WORLD, "torch", request, tmp_path_factory)[name]
    assert_passed(outcome, WORLD)


def test_unpatch_names_itself_for_a_model_that_is_not_a_gpt_model():
    """Fresh-user finding: ``unpatch_megatron`` on another module said "fusedce.patch_megatron expects"."""
    with pytest.raises(TypeError, match=r"^fusedce\.unpatch_megatron expects a megatron\.core GPTModel"):
        fusedce.unpatch_megatron(torch.nn.Linear(2, 2))


def test_token_log_probs_names_itself_for_a_model_that_is_not_a_gpt_model():
    """Fresh-user finding: ``megatron_token_log_probs`` on another module said "fusedce.patch_megatron expects"."""
    from fusedce.integrations.megatron import megatron_token_log_probs
    ids = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(TypeError, match=r"^fusedce\.integrations\.megatron\.megatron_token_log_probs expects a "):
        megatron_token_log_probs(torch.nn.Linear(2, 2), ids, None, None, ids)
