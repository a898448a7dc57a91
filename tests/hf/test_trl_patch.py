"""``fusedce.patch_trl``: TRL's fused-LM-head trainers through fusedce, against TRL alone.

- ``SFTTrainer`` (patched after the trainer is built) and ``GRPOTrainer`` (patched before; a toy reward,
  2 generations per prompt), 3 steps each on the tiny Llama of ``hf_models``: the same per-step losses and
  gradients as TRL alone (fp32 noise: the two heads sum the same terms in different orders), and the
  peak of live bytes allocated by ops during each training step (forward + backward), which differs
  only by the head: TRL's kernel holds a (tokens x 32768) fp32 tile whatever the vocabulary, fusedce
  one chunk of (tokens x V).
- The model-level outputs (every one TRL defines) with temperature, softcap, logit scale, ``shift_labels``
  and ``num_items_in_batch``, against TRL's own kernel and a float64 reference.
- A peft LoRA ``lm_head`` (which TRL's kernel ignores: it reads the base weight) applied exactly,
  against the unfused logits; a DoRA head refused; a TRL that is not the one fusedce was written against
  refused; ``unpatch_trl`` restores TRL's code.

Data as in ``test_hf_trl``: pre-tokenised random sequences and a word-level tokenizer (no download). SGD,
lr 0.5, constant schedule: a gradient difference shows in the next step's loss.
"""
from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import fusedce  # noqa: E402
from fusedce.integrations.trl import patch as trl_patch  # noqa: E402
from hf_models import VOCAB, batch, build  # noqa: E402
from trl_data import _dataset, _tokenizer  # noqa: E402

STEPS = 3
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.fixture(autouse=True)
def unpatched():
    fusedce.unpatch_trl()
    yield
    fusedce.unpatch_trl()


class LiveBytes(TorchDispatchMode):
    """Peak of the bytes held by tensors that ops allocate while active (freed when their storage dies)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _free(self, n):
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                storage = t.untyped_storage()
                if not getattr(storage, "_fusedce_counted", False):
                    storage._fusedce_counted = True
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, storage.nbytes())
        return out


class Recorder:
    """Wraps ``trainer.training_step``: per step the loss, every parameter's gradient right after the
    backward, and the step's peak live bytes (``LiveBytes``)."""

    def __init__(self, trainer):
        self.grads, self.peaks, self.losses = [], [], []
        step = trainer.training_step

        def training_step(model, inputs, *args, **kwargs):
            before = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
            with LiveBytes() as live:
                loss = step(model, inputs, *args, **kwargs)
            self.peaks.append(live.peak)
            self.losses.append(float(loss))
            self.grads.append({n: p.grad - (0 if before[n] is None else before[n])
                               for n, p in model.named_parameters() if p.grad is not None})
            return loss
        trainer.training_step = training_step


def _compare(stock: Recorder, fused: Recorder):
    assert len(stock.losses) == len(fused.losses) == STEPS
    assert stock.losses[0] != stock.losses[-1]   # it trains
    assert fused.losses == pytest.approx(stock.losses, rel=1e-5, abs=1e-6)
    for g_stock, g_fused in zip(stock.grads, fused.grads):
        assert g_stock.keys() == g_fused.keys() and g_stock
        for name, g in g_stock.items():
            scale = float(g.abs().max()) + 1e-12
            torch.testing.assert_close(g_fused[name], g, rtol=1e-4, atol=1e-5 * scale, msg=name)
    # the head's part of the step: fusedce's chunk of (tokens x V) against TRL's (tokens x 32768) tile
    print(f"step peak live bytes: TRL {stock.peaks}, TRL + fusedce {fused.peaks}")
    assert max(fused.peaks) < max(stock.peaks)


def _sft(model, tmp_path, patch_after: bool):
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=STEPS,
                         learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", save_strategy="no",
                         report_to=[], use_cpu=True, logging_steps=1, seed=0, disable_tqdm=True,
                         dataloader_num_workers=0, max_length=None, bf16=False)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=_dataset(), processing_class=_tokenizer())
    recorder = Recorder(trainer)
    if patch_after:
        fusedce.patch_trl()
    trainer.train()
    return recorder


def test_sft_trainer_same_losses_and_gradients_patched_after_the_trainer_is_built(tmp_path):
    stock = build("llama")
    fused = copy.deepcopy(stock)
    _compare(_sft(stock, tmp_path, False), _sft(fused, tmp_path, True))


def _reward(completions, **kwargs):
    """A toy reward: how many of the completion's tokens have an even id (the tokenizer's ``t<id>``)."""
    return [float(sum(int(tok[1:]) % 2 == 0 for tok in c.split() if tok[1:].isdigit())) for c in completions]


def _grpo(model, tmp_path):
    prompts = [" ".join(f"t{i}" for i in row) for row in _dataset(4)["input_ids"]]
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=6, max_steps=STEPS, learning_rate=0.5, optim="sgd",
                          lr_scheduler_type="constant", save_strategy="no", report_to=[], use_cpu=True,
                          logging_steps=1, seed=0, disable_tqdm=True, dataloader_num_workers=0, temperature=0.9,
                          beta=0.0, bf16=False)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=_reward, args=args,
                              train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                              processing_class=_tokenizer())
    recorder = Recorder(trainer)
    trainer.train()
    return recorder


def test_grpo_trainer_same_losses_and_gradients_patched_before_the_trainer_is_built(tmp_path):
    stock = build("llama")
    fused = copy.deepcopy(stock)
    record_stock = _grpo(stock, tmp_path)
    fusedce.patch_trl()
    _compare(record_stock, _grpo(fused, tmp_path))


def _fused_outputs(model, inputs, weights):
    model.zero_grad()
    out = model(**inputs, fused_lm_head=True)
    (out.loss + (weights[0] * out.entropy).sum() + (weights[1] * out.log_probs).sum()).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", ["t0.7", "t1.3_cap5_scale2", "shift_labels+num_items"])
def test_every_output_matches_trl_and_float64(case):
    model = build("llama", tied=False)
    if "cap5" in case:   # TRL reads these from the config whatever the family
        model.config.final_logit_softcapping, model.config.logit_scale = 5.0, 2.0
    temperature = 1.3 if "t1.3" in case else 0.7
    stock, fused = model, copy.deepcopy(model)
    for m in (stock, fused):
        trl.trainer.utils.add_fused_lm_head(m, temperature=temperature, outputs=OUTPUTS)
    ids, mask, labels = batch(torch.Generator().manual_seed(3))
    labels[0, 6] = labels[2, 8] = -100
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if case.startswith("shift_labels"):   # pre-shifted labels (context parallelism, padding-free batches)
        inputs = dict(input_ids=ids, attention_mask=mask, shift_labels=torch.roll(labels, -1, dims=1),
                      num_items_in_batch=torch.tensor(17))
    generator = torch.Generator().manual_seed(4)
    weights = (torch.randn(ids.shape, generator=generator)[:, :-1], torch.randn(ids.shape, generator=generator)[:, :-1])
    if case.startswith("shift_labels"):
        weights = tuple(torch.cat([w, w[:, :1]], dim=1) for w in weights)
    expected, g_expected = _fused_outputs(stock, inputs, weights)
    fusedce.patch_trl()
    actual, g_actual = _fused_outputs(fused, inputs, weights)
    assert fusedce.unpatch_trl() is None and trl_patch.is_patched() is False
    for name in OUTPUTS + ("loss", "label_mask"):
        a, e = getattr(actual, name), getattr(expected, name)
        assert a.dtype == e.dtype and a.shape == e.shape, name
        if a.dtype == torch.bool:
            assert torch.equal(a, e), name
        else:
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=name)
    for name, g in g_expected.items():
        torch.testing.assert_close(g_actual[name], g, rtol=1e-4, atol=1e-6 * float(g.abs().max()), msg=name)
    # float64, from the model's own hidden states and head: q = softcap tanh(s x / softcap) / T
    with torch.no_grad():
        hidden = fused.model(input_ids=ids, attention_mask=mask).last_hidden_state.double()
        x = hidden @ fused.lm_head.weight.double().T * getattr(fused.config, "logit_scale", 1.0)
        cap = getattr(fused.config, "final_logit_softcapping", None)
        q = (x if cap is None else cap * torch.tanh(x / cap)) / temperature
        target = inputs["shift_labels"] if "shift_labels" in inputs else labels[:, 1:]
        q = q if "shift_labels" in inputs else q[:, :-1]
        valid = target != -100
        logp = q.log_softmax(-1)
        ref = {"log_probs": logp.gather(-1, target.clamp(min=0)[..., None])[..., 0],
               "entropy": -(logp.exp() * logp).sum(-1),
               "log_sum_sq_probs": torch.logsumexp(2 * q, -1) - 2 * torch.logsumexp(q, -1),
               "mean_logits": q.mean(-1), "is_top1": q.argmax(-1) == target}
    for name, value in ref.items():
        value = value & valid if value.dtype == torch.bool else torch.where(valid, value, 0.0)
        got = getattr(actual, name)
        if got.dtype == torch.bool:
            assert torch.equal(got, value), name
        else:
            torch.testing.assert_close(got.double(), value, rtol=0, atol=5e-6, msg=name)


def test_is_top1_counts_hits():
    """Labels set to the model's own argmax: is_top1 True there (and TRL agrees)."""
    model = build("llama", tied=False)
    trl.trainer.utils.add_fused_lm_head(model, outputs=OUTPUTS)
    ids, mask, labels = batch(torch.Generator().manual_seed(5))
    with torch.no_grad():
        top = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    labels[:, 1:] = torch.where(labels[:, 1:] != -100, top[:, :-1], -100)
    labels[0, 7] = (top[0, 6] + 1) % VOCAB   # one miss
    expected = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).is_top1
    fusedce.patch_trl()
    actual = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).is_top1
    assert torch.equal(actual, expected) and actual.sum() == (labels[:, 1:] != -100).sum() - 1


def _lora(model, **config):
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"],
                                                      init_lora_weights=False, **config))


def test_lora_head_is_applied_exactly():
    model = _lora(build("llama", tied=False))
    base = model.get_base_model()
    trl.trainer.utils.add_fused_lm_head(base, temperature=0.8, outputs=("log_probs", "entropy"))
    fusedce.patch_trl()
    ids, mask, labels = batch(torch.Generator().manual_seed(6))
    out = base(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any("lora_B" in n for n in grads)
    model.zero_grad()
    logits = base(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / 0.8   # peft's own forward
    target = labels[:, 1:]
    valid = target != -100
    logp = logits.log_softmax(-1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    loss = -torch.where(valid, logp, 0.0).sum() / valid.sum()
    loss.backward()
    torch.testing.assert_close(out.loss, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.log_probs, torch.where(valid, logp, 0.0).detach(), rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6 * float(p.grad.abs().max()),
                                       msg=name)


def test_dora_head_is_refused():
    model = _lora(build("llama", tied=False), use_dora=True)
    base = model.get_base_model()
    trl.trainer.utils.add_fused_lm_head(base)
    fusedce.patch_trl()
    ids, mask, labels = batch(torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match="lm_head"):
        base(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)


def test_another_trl_is_refused(monkeypatch):
    model = build("llama")
    trl.trainer.utils.add_fused_lm_head(model)
    code = model.forward.__func__.__code__
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(RuntimeError, match="TRL 1.16.x and TRL 1.17.0"):
        fusedce.patch_trl()
    monkeypatch.undo()
    monkeypatch.setitem(trl_patch.FINGERPRINTS, "trl.trainer.utils.add_fused_lm_head", "0" * 16)
    with pytest.raises(RuntimeError, match="add_fused_lm_head in the installed TRL"):
        fusedce.patch_trl()
    assert not trl_patch.is_patched() and model.forward.__func__.__code__ is code


def test_unpatch_restores_trl_and_generation_is_untouched():
    model = build("llama")
    trl.trainer.utils.add_fused_lm_head(model)
    trl_code = model.forward.__func__.__code__
    ids, mask, _ = batch(torch.Generator().manual_seed(8))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    fusedce.patch_trl()
    fusedce.patch_trl()   # idempotent
    assert model.forward.__func__.__code__ is trl_patch.TRAMPOLINE
    with torch.no_grad():   # without fused_lm_head: the model's own forward, as in TRL
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, logits, rtol=0, atol=0)
    late = build("llama")
    trl.trainer.utils.add_fused_lm_head(late)
    assert late.forward.__func__.__code__ is trl_patch.TRAMPOLINE
    fusedce.unpatch_trl()
    assert model.forward.__func__.__code__ is trl_code and late.forward.__func__.__code__ is trl_code


def _parity(stock, fused, inputs, rtol=1e-5):
    """Every TRL output and every gradient of ``fused`` (patched) against ``stock`` (TRL alone)."""
    generator = torch.Generator().manual_seed(9)
    shape = inputs["labels"][:, 1:].shape
    weights = (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    expected, g_expected = _fused_outputs(stock, inputs, weights)
    fusedce.patch_trl()
    actual, g_actual = _fused_outputs(fused, inputs, weights)
    fusedce.unpatch_trl()
    assert (actual.aux_loss is None) == (expected.aux_loss is None)
    for name in OUTPUTS + ("loss",) + (() if expected.aux_loss is None else ("aux_loss",)):
        a, e = getattr(actual, name), getattr(expected, name)
        assert a.dtype == e.dtype, name
        if a.dtype == torch.bool:
            assert torch.equal(a, e), name
        else:
            torch.testing.assert_close(a, e, rtol=rtol, atol=rtol, msg=name)
    assert g_expected.keys() == g_actual.keys()
    for name, g in g_expected.items():
        torch.testing.assert_close(g_actual[name].float(), g.float(), rtol=10 * rtol,
                                   atol=10 * rtol * float(g.abs().max()), msg=name)
    return actual


def test_zero3_style_partitioned_head():
    """The head's weight empty outside its own forward (ZeRO-3's pattern, ``test_hf_zero3.Zero3Hooks``):
    fusedce computes inside the head's call (TRL alone would read the empty partition), the hooks fire
    once each, and the backward re-gathers before the loss's backward reads the weight."""
    from zero3_hooks import Zero3Hooks
    stock = build("llama", tied=False)
    fused = copy.deepcopy(stock)
    for m in (stock, fused):
        trl.trainer.utils.add_fused_lm_head(m, temperature=0.9, outputs=OUTPUTS)
    hooks = Zero3Hooks(fused.get_output_embeddings())
    ids, mask, labels = batch(torch.Generator().manual_seed(10))
    _parity(stock, fused, dict(input_ids=ids, attention_mask=mask, labels=labels))
    assert hooks.counts == {"pre": 1, "post": 1, "regather": 1}


def test_cast_lm_head_to_fp32_on_a_bf16_model():
    """GRPO's ``cast_lm_head_to_fp32``: fp32 hidden states and head on a bf16 model, autocast off."""
    stock = build("llama", tied=False).to(torch.bfloat16)
    fused = copy.deepcopy(stock)
    for m in (stock, fused):
        trl.trainer.utils.add_fused_lm_head(m, temperature=0.9, cast_lm_head_to_fp32=True, outputs=OUTPUTS)
    ids, mask, labels = batch(torch.Generator().manual_seed(12))
    _parity(stock, fused, dict(input_ids=ids, attention_mask=mask, labels=labels))


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite", "mixtral", "gpt2"])
def test_families_with_a_logit_transform_moe_or_another_backbone(family):
    """TRL reads softcap (Gemma 2), logit scale (Cohere: times 0.25, Granite: divided by 4) and the
    backbone (GPT-2's ``transformer``) from the model; Mixtral adds its load-balancing loss."""
    stock = build(family)
    fused = copy.deepcopy(stock)
    for m in (stock, fused):
        trl.trainer.utils.add_fused_lm_head(m, temperature=0.9, outputs=OUTPUTS)
    ids, mask, labels = batch(torch.Generator().manual_seed(13))
    actual = _parity(stock, fused, dict(input_ids=ids, attention_mask=mask, labels=labels))
    assert (actual.aux_loss is not None) == (family == "mixtral")
