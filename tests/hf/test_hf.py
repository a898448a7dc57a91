"""fusedce.patch_causal_lm on tiny random Hugging Face models (CPU, fp32, no downloads).

The models, the batch and the tolerance (with its reasoning) are in ``tests/support/hf_models.py``, which the
other HF tests share.
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedce.integrations.hf.patch import LOSS_OPTIONS, patch_causal_lm, unpatch_causal_lm  # noqa: E402
from hf_models import FAMILIES, HIDDEN, SEQ, VOCAB, assert_close, assert_parity, batch, build  # noqa: E402,E501
from tolerances import HF_ATOL_SCALE, HF_RTOL  # noqa: E402


@pytest.mark.parametrize("family,tied", [(f, None) for f in FAMILIES] + [("llama", True), ("qwen3", True),
                                                                          ("gemma", False), ("gpt2", False)])
def test_loss_and_every_gradient_match_stock(family, tied):
    stock = build(family, tied)
    fused = patch_causal_lm(copy.deepcopy(stock))
    ids, mask, labels = batch()
    out, ref = assert_parity(stock, fused, input_ids=ids, attention_mask=mask, labels=labels)
    assert type(out) is type(ref) and out.logits is None
    if family == "mixtral":  # the aux loss is part of the loss, as in the family's forward
        assert out.aux_loss is not None and float(out.aux_loss.detach()) > 0


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_hf_loss_kwargs_match_stock(family):
    """num_items_in_batch (the Trainer's kwarg), shift_labels, logits_to_keep, return_dict=False."""
    stock = build(family)
    fused = patch_causal_lm(copy.deepcopy(stock))
    ids, mask, labels = batch()
    assert_parity(stock, fused, input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=40)
    shifted = torch.randint(0, VOCAB, labels.shape).masked_fill(torch.rand(labels.shape) < 0.3, -100)
    assert_parity(stock, fused, input_ids=ids, labels=labels, shift_labels=shifted)
    assert_parity(stock, fused, input_ids=ids, labels=labels[:, -5:], logits_to_keep=5)
    as_tuple = fused(ids, labels=labels, return_dict=False)  # positional input_ids, tuple output
    stock_tuple = stock(ids, labels=labels, return_dict=False)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(stock_tuple)
    assert as_tuple[1] is None  # the logits' place (not kept in training), never the cache
    assert [type(x) for x in as_tuple[2:]] == [type(x) for x in stock_tuple[2:]]
    assert_close(as_tuple[0], stock_tuple[0], "tuple loss")
    with pytest.raises(ValueError, match="kept 15 positions"):
        fused(input_ids=ids, labels=labels, logits_to_keep=5)


def test_keep_logits_returns_the_stock_logits():
    stock = build("gemma2")
    fused = patch_causal_lm(copy.deepcopy(stock), keep_logits=True)
    ids, mask, labels = batch()
    out, ref = assert_parity(stock, fused, input_ids=ids, attention_mask=mask, labels=labels)
    assert_close(out.logits, ref.logits, "logits")


def test_bf16_autocast_error_no_worse_than_stock():
    """Under CPU bf16 autocast both paths compute the logits in bf16 (the patch casts hidden and head,
    as F.linear does under autocast); judged against the fp32 loss, the fused error may not exceed
    twice the stock bf16 error plus one bf16 ulp of the loss (2^-8 relative)."""
    stock = build("llama")
    fused = patch_causal_lm(copy.deepcopy(stock))
    ids, mask, labels = batch()
    with torch.no_grad():
        exact = stock(input_ids=ids, attention_mask=mask, labels=labels).loss
        with torch.autocast("cpu", dtype=torch.bfloat16):
            stock_bf16 = stock(input_ids=ids, attention_mask=mask, labels=labels).loss
            fused_bf16 = fused(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert fused_bf16.dtype == torch.float32
    bound = 2 * abs(float(stock_bf16 - exact)) + 2.0 ** -8 * float(exact)
    assert abs(float(fused_bf16 - exact)) <= bound


def test_loss_options_reach_linear_cross_entropy():
    """label_smoothing and z-loss against F.cross_entropy on the model's own logits (+ lse^2 term)."""
    model = patch_causal_lm(build("llama"), label_smoothing=0.1, lse_square_scale=1e-2, chunk_size=7)
    ids, mask, labels = batch()
    logits = unpatch_causal_lm(copy.deepcopy(model))(input_ids=ids, attention_mask=mask).logits
    target = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
    rows = logits.reshape(-1, VOCAB)[target != -100]
    expected = torch.nn.functional.cross_entropy(rows, target[target != -100], label_smoothing=0.1)
    expected = expected + 1e-2 * (torch.logsumexp(rows, -1) ** 2).mean()
    assert_close(model(input_ids=ids, attention_mask=mask, labels=labels).loss, expected, "loss")


@pytest.mark.parametrize("family", ["llama", "cohere"])
def test_use_token_scaling_forward_keyword(family):
    """DFT: ``use_token_scaling`` as a forward keyword (as Liger-patched models take it; TRL's
    ``loss_type="dft"``), or as a patch option: the loss is mean_t(p_t * nll_t) with p_t detached, on
    the model's own logits (Cohere's logit_scale included); gradients flow through nll only."""
    model = patch_causal_lm(build(family))
    ids, mask, labels = batch()
    plain = copy.deepcopy(model)
    unpatch_causal_lm(plain)
    logits = plain(input_ids=ids, attention_mask=mask).logits
    target = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
    keep = target != -100
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB)[keep], target[keep], reduction="none")
    expected = (nll * torch.exp(-nll).detach()).mean()
    got = model(input_ids=ids, attention_mask=mask, labels=labels, use_token_scaling=True).loss
    assert_close(got, expected, "dft loss (forward keyword)")
    plain_loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert abs(float(plain_loss) - float(nll.mean())) <= 1e-5 * float(nll.mean()), "the keyword is per call"
    patched = patch_causal_lm(build(family), use_token_scaling=True)
    patched.load_state_dict(model.state_dict())
    assert_close(patched(input_ids=ids, attention_mask=mask, labels=labels).loss, expected, "dft (option)")
    with pytest.raises(TypeError, match="use_token_scaling"):
        model(input_ids=ids, attention_mask=mask, labels=labels, use_token_scaling="no")


def test_trainer_gradient_accumulation_matches_stock(tmp_path):
    """Trainer, 2 micro-batches of 2 sequences, one SGD step (SGD: the update is lr * gradient, so a
    wrong num_items_in_batch scaling shows; Adam's first step would hide it). Micro-batches hold
    different numbers of label tokens, so per-micro-batch means would give a different step."""
    from transformers import Trainer, TrainingArguments

    generator = torch.Generator().manual_seed(0)
    rows = []
    for i in range(4):
        ids = torch.randint(1, VOCAB, (SEQ,), generator=generator)
        labels = ids.clone()
        labels[: 2 + 2 * i] = -100  # 10, 8, 6, 4 label tokens
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})

    def train(model):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=1, learning_rate=0.5, optim="sgd",
                                 lr_scheduler_type="constant", save_strategy="no", report_to=[], use_cpu=True,
                                 logging_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)
        Trainer(model=model, args=args, train_dataset=rows).train()
        return dict(model.named_parameters())

    stock = build("llama")
    start = {n: p.detach().clone() for n, p in stock.named_parameters()}
    fused = patch_causal_lm(copy.deepcopy(stock))
    after_stock, after_fused = train(stock), train(fused)
    moved = max(float((after_stock[n].detach() - start[n]).abs().max()) for n in start)
    assert moved > 1e-3, "the step did not change the parameters: the test would prove nothing"
    for name, value in after_fused.items():  # the updates agree, up to rounding p + update in fp32
        rounding = 2.0 ** -23 * float(start[name].abs().max())
        delta, expected = value.detach() - start[name], after_stock[name].detach() - start[name]
        torch.testing.assert_close(delta, expected, rtol=HF_RTOL, msg=name,
                                   atol=HF_ATOL_SCALE * float(expected.abs().max()) + 2 * rounding)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3"])
def test_generate_and_unpatch_restore_stock_behavior(family):
    stock = build(family)
    model = patch_causal_lm(copy.deepcopy(stock))
    prompt = torch.randint(1, VOCAB, (2, 5))
    greedy = dict(max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    assert torch.equal(model.generate(prompt, **greedy), stock.generate(prompt, **greedy))
    ids, mask, labels = batch()
    assert_close(model(input_ids=ids).logits, stock(input_ids=ids).logits, "logits without labels")
    assert "forward" in model.__dict__
    assert unpatch_causal_lm(model) is model and "forward" not in model.__dict__
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and out.loss.grad_fn.name() != "LinearHeadFunctionBackward"
    assert unpatch_causal_lm(model) is model  # unpatching an unpatched model is a no-op


def test_patch_is_idempotent_and_replaces_options():
    model = build("llama")
    assert patch_causal_lm(model) is model
    forward = model.forward.__func__
    patch_causal_lm(model, label_smoothing=0.5)
    assert model.forward.__func__ is forward  # not wrapped twice
    clone = copy.deepcopy(model)  # a copy is patched too, and its forward runs the copy
    assert clone.forward.__self__ is clone and clone._fusedce_patch is not model._fusedce_patch
    ids, _, labels = batch()
    with torch.no_grad():
        smoothed = float(model(input_ids=ids, labels=labels).loss)
        stock = float(unpatch_causal_lm(model)(input_ids=ids, labels=labels).loss)
    assert smoothed != pytest.approx(stock, rel=1e-3)  # the second call's options are in force
    assert "forward" not in model.__dict__


def test_option_and_model_errors():
    model = build("llama")
    with pytest.raises(TypeError, match="unknown loss option.*smoothing"):
        patch_causal_lm(model, smoothing=0.1)
    for bad in (dict(label_smoothing=2.0), dict(reduction="avg"), dict(chunk_size=0), dict(backend="cuda"),
                dict(method="fast"), dict(method="tiled", chunk_size=8)):
        with pytest.raises(ValueError):
            patch_causal_lm(model, **bad)
    with pytest.raises(ValueError, match="contradicts"):
        patch_causal_lm(build("gemma2"), softcap=30.0)
    assert "forward" not in model.__dict__  # a failed patch leaves the model alone
    assert "num_items_in_batch" not in LOSS_OPTIONS and "label_smoothing" in LOSS_OPTIONS
    with pytest.raises(TypeError, match="get_output_embeddings"):
        patch_causal_lm(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"instance, got the class LlamaForCausalLM: pass LlamaForCausalLM\(config\)"):
        patch_causal_lm(transformers.LlamaForCausalLM)
    with pytest.raises(TypeError, match="not a module"):
        patch_causal_lm(transformers.LlamaModel(model.config))  # a base model: no LM head
    with pytest.raises(TypeError, match="no base model"):
        patch_causal_lm(_HeadOnly())


class _HeadOnly(torch.nn.Module):
    """An LM head without a decoder: what the generic path cannot patch."""

    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB)

    def get_output_embeddings(self):
        return self.lm_head


class _Doubled(transformers.LlamaForCausalLM):
    """A family that does something to its logits that its config does not say."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_undeclared_logit_transform_is_refused():
    model = patch_causal_lm(_Doubled(build("llama").config))
    ids, _, labels = batch()
    with pytest.raises(ValueError, match="does not match what its config declares"):
        model(input_ids=ids, labels=labels)


def test_tiled_method_through_the_patch():
    """``method="tiled"`` reaches linear_cross_entropy: the same loss and gradients as the stock model."""
    model = build("llama")
    ids, _, labels = batch()
    stock = model(input_ids=ids, labels=labels).loss
    (stock_grad,) = torch.autograd.grad(stock, model.lm_head.weight)
    patch_causal_lm(model, method="tiled")
    fused = model(input_ids=ids, labels=labels).loss
    (fused_grad,) = torch.autograd.grad(fused, model.lm_head.weight)
    torch.testing.assert_close(fused, stock, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_grad, stock_grad, rtol=1e-4, atol=1e-6)


def test_fullgraph_compile_before_the_first_labelled_call_says_how():
    """The first labelled call checks the family's transform outside the graph (a graph break): compiled
    with ``fullgraph=True`` before it, the error says to make one labelled call first; after one, the same
    compile traces the checked forward as one graph and trains the stock loss."""
    stock = build("granite")
    model = patch_causal_lm(copy.deepcopy(stock))
    ids, mask, labels = batch()
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception, match="make one labelled forward call of the patched model before"):
            torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids, attention_mask=mask, labels=labels)
        model(input_ids=ids, attention_mask=mask, labels=labels)   # the check, eagerly
        fused = torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids, attention_mask=mask,
                                                                     labels=labels).loss
    finally:
        torch._dynamo.reset()
    assert_close(fused, stock(input_ids=ids, attention_mask=mask, labels=labels).loss, "loss")


def test_float_labels_are_named_as_the_caller_gave_them():
    """Fresh-user finding: float ``labels`` reached ``linear_cross_entropy`` and its message named its flattened
    ``target``; now a TypeError naming ``labels``, their dtype and the caller's shape, before anything runs."""
    model = patch_causal_lm(build("llama"))
    ids, _mask, labels = batch()
    for bad in (labels.float(), labels.bool()):
        with pytest.raises(TypeError, match=rf"labels must be integer token ids .*{bad.dtype} of shape "
                                            rf"\({ids.shape[0]}, {ids.shape[1]}\).*labels\.long\(\)"):
            model(input_ids=ids, labels=bad)
