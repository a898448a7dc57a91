"""patch_causal_lm under peft: LoRA on the LM head is applied exactly, or refused (case C17).

Models: the tiny random Llama of ``hf_models`` (hidden 32, 2 layers, vocabulary 211), tied and untied head.
Adapters: ``r=4``, ``init_lora_weights=False`` (a zero-initialised B would make the update zero and the
test prove nothing), on ``lm_head`` alone or with the attention projections, dropout 0 and 0.1 (the
model in train mode; the same seed before each forward, so the stock and the patched forward must draw
the same mask), merged, and ``modules_to_save``. The input embeddings are made trainable so the gradient
of the hidden states (through the frozen decoder) is compared too; with a tied head that also makes the
LoRA base weight trainable. Every trainable parameter's gradient is compared (``hf_models.assert_parity``).
"""
from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

from fusedce.integrations.hf.patch import patch_causal_lm  # noqa: E402
from hf_models import assert_parity, batch, build  # noqa: E402


def lora_model(tied: bool, targets, dropout=0.0, **extra):
    model = build("llama", tied=tied)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=dropout,
                             init_lora_weights=False, **extra)
    model = peft.get_peft_model(model, config)
    model.get_input_embeddings().weight.requires_grad_(True)   # the hidden states' gradient counts too
    return model


def parity_seeded(stock, fused, train: bool):
    """assert_parity with the same RNG state before each forward (dropout masks)."""
    ids, mask, labels = batch()
    stock.train(train)
    fused.train(train)
    forward_stock, forward_fused = stock.forward, fused.forward

    def seeded(forward):
        def call(**kwargs):
            torch.manual_seed(1234)
            return forward(**kwargs)
        return call
    stock.forward, fused.forward = seeded(forward_stock), seeded(forward_fused)
    try:
        out, ref = assert_parity(stock, fused, input_ids=ids, attention_mask=mask, labels=labels)
    finally:
        stock.forward, fused.forward = forward_stock, forward_fused
    return out, ref


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("targets", [("lm_head",), ("lm_head", "q_proj", "v_proj")])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_head_loss_and_gradients_match_stock(tied, targets, dropout):
    stock = lora_model(tied, targets, dropout)
    fused = patch_causal_lm(copy.deepcopy(stock))
    out, _ = parity_seeded(stock, fused, train=dropout > 0)
    trained = {n for n, p in fused.named_parameters() if p.grad is not None}
    assert any("lm_head.lora_A" in n for n in trained) and any("lm_head.lora_B" in n for n in trained)
    assert out.logits is None


def test_lora_head_patched_before_get_peft_model():
    """The patch looks the head up at each call, so peft may wrap it after patching (as TRL does)."""
    stock = lora_model(False, ("lm_head", "q_proj"))
    plain = build("llama", tied=False)
    plain.load_state_dict(stock.get_base_model().state_dict(), strict=False)
    fused = peft.get_peft_model(patch_causal_lm(plain), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], init_lora_weights=False))
    fused.load_state_dict(stock.state_dict())
    fused.get_input_embeddings().weight.requires_grad_(True)
    parity_seeded(stock, fused, train=False)


@pytest.mark.parametrize("tied", [False, True])
def test_merged_lora_and_disabled_adapter_match_stock(tied):
    stock = lora_model(tied, ("lm_head", "q_proj"))
    stock.merge_adapter()
    fused = patch_causal_lm(copy.deepcopy(stock))
    parity_seeded(stock, fused, train=False)
    for model in (stock, fused):
        model.unmerge_adapter()
    with stock.disable_adapter(), fused.disable_adapter():
        parity_seeded(stock, fused, train=False)


@pytest.mark.parametrize("tied", [False, True])
def test_modules_to_save_head_matches_stock(tied):
    stock = lora_model(tied, ("q_proj", "v_proj"), modules_to_save=["lm_head"])
    fused = patch_causal_lm(copy.deepcopy(stock))
    parity_seeded(stock, fused, train=False)
    assert any("modules_to_save" in n and p.grad is not None for n, p in fused.named_parameters())


@pytest.mark.parametrize("method", ["chunked", "tiled"])
def test_lora_head_on_the_triton_backend(method):
    """C17 on the Triton kernels (interpreter): the LoRA head's update takes part in the fused loss."""
    stock = lora_model(True, ("lm_head",), 0.0)
    fused = patch_causal_lm(copy.deepcopy(stock), backend="triton", method=method)
    out, _ = parity_seeded(stock, fused, train=False)
    assert out.logits is None


def test_head_hooks_fire_once_per_forward():
    """C18: the fused loss runs inside the head's own call; its hooks fire once, as in the stock one."""
    model = patch_causal_lm(lora_model(False, ("lm_head",)))
    head = model.get_output_embeddings()
    fired = []
    head.register_forward_pre_hook(lambda *a: fired.append("pre"))
    head.register_forward_hook(lambda *a: fired.append("post"))
    head.base_layer.register_forward_pre_hook(lambda *a: fired.append("base"))
    ids, mask, labels = batch()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert fired == ["pre", "base", "post"]


def test_unsupported_adapters_and_heads_are_refused():
    with pytest.raises(ValueError, match=r"lm_head.*variant"):
        patch_causal_lm(peft.get_peft_model(build("llama", tied=False), peft.LoraConfig(
            r=4, target_modules=["lm_head"], use_dora=True, init_lora_weights=False)))
    late = peft.get_peft_model(patch_causal_lm(build("llama", tied=False)), peft.LoraConfig(
        r=4, target_modules=["lm_head"], use_dora=True, init_lora_weights=False))
    ids, mask, labels = batch()
    with pytest.raises(ValueError, match=r"lm_head.*variant"):   # wrapped after patching: first call
        late(input_ids=ids, attention_mask=mask, labels=labels)
    ia3 = peft.get_peft_model(build("llama", tied=False), peft.IA3Config(
        target_modules=["lm_head", "down_proj"], feedforward_modules=["down_proj"]))
    with pytest.raises(ValueError, match=r"lm_head \(peft\.tuners\.ia3"):
        patch_causal_lm(ia3)
    custom = build("llama", tied=False)
    custom.lm_head = _ScaledLinear(custom.lm_head.in_features, custom.lm_head.out_features, bias=False)
    with pytest.raises(ValueError, match=r"lm_head .*_ScaledLinear.*neither an nn.Linear"):
        patch_causal_lm(custom)


class _ScaledLinear(torch.nn.Linear):
    """A head whose forward is not nn.Linear's: the patch cannot know what it computes."""

    def forward(self, x):
        return super().forward(x) * 2
