"""Tiny random Hugging Face causal LMs and the parity checks the HF tests share (CPU, fp32, no downloads).

Each family is built from a config in code: hidden 32, 2 layers, 4 heads, vocabulary 211 (a prime, so
no power-of-two alignment hides an indexing bug), sequences of 12 tokens. ``batch`` has right padding
(attention_mask 0, labels -100) on one row and a masked prompt (labels -100) on every row, as in SFT.

Tolerance: both paths compute in fp32; they differ only in summation order (a chunked matmul and an
online log-sum-exp against one matmul and torch's log_softmax), then backpropagate through two layers.
That is a few ulps per value, amplified by the depth; ``HF_RTOL = 2e-5`` (~170 fp32 ulps) of each value
plus ``HF_ATOL_SCALE = 1e-6`` (both in ``tolerances.py``) of the largest magnitude (entries near zero) cover it with a
margin; measured worst case over the families here: about 1e-7 relative to the largest gradient.

Imported by module name (``tests/support/`` is on pytest's ``pythonpath``) by every test that needs a model:
tests/hf/*, tests/ce/options/test_token_weights.py, tests/linear/test_tiled_deterministic.py.
"""
from __future__ import annotations

import pytest
import torch
from tolerances import HF_ATOL_SCALE, HF_RTOL

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, SEQ, BATCH, PROMPT = 211, 32, 12, 3, 4
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
GEMMA = dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=8)

# name -> (model class, config class, config kwargs). Softcaps of 2.0 and scales of 0.25 / 1/4 are far
# from the defaults on purpose: on a tiny random model the logits are O(1), where a softcap of 30 (the
# Gemma 2 default) would be the identity to within tolerance and test nothing.
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": 8}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 8}),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", {"head_dim": 8}),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {**GEMMA, "final_logit_softcapping": 2.0}),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", {**GEMMA, "final_logit_softcapping": 2.0}),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {}),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",
             dict(n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0)),
    # beyond the named families: a logit scale (multiply, divide), MoE aux loss, the generic path
    "cohere": ("CohereForCausalLM", "CohereConfig", {"logit_scale": 0.25}),
    "granite": ("GraniteForCausalLM", "GraniteConfig", {"logits_scaling": 4.0}),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                     router_aux_loss_coef=0.5)),
    "gpt_neox (generic)": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {}),
}
NAMED = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "gpt2"]


def build(family: str, tied=None) -> torch.nn.Module:
    model_cls, config_cls, extra = FAMILIES[family]
    kwargs = dict(extra) if family == "gpt2" else {**COMMON, **extra}
    if family == "gpt2":
        kwargs["vocab_size"] = VOCAB
    if tied is not None:
        kwargs["tie_word_embeddings"] = tied
    config = getattr(transformers, config_cls)(**kwargs)
    model = getattr(transformers, model_cls)(config)
    if tied is not None:  # the flag must really have (un)tied the head, else the case tests nothing
        same = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert same == tied, f"{family}: tie_word_embeddings={tied}, head tied: {same}"
    return model.eval()  # dropout off; gradients still flow


def batch(generator=None):
    """input_ids, attention_mask and labels (BATCH, SEQ): row 1 right-padded by 5, every prompt masked."""
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, SEQ - 5:] = 0
    ids[1, SEQ - 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :PROMPT] = -100
    return ids, mask, labels


def assert_close(actual, expected, name):
    scale = float(expected.detach().abs().max())
    torch.testing.assert_close(actual, expected, rtol=HF_RTOL, atol=HF_ATOL_SCALE * scale + 1e-12, msg=name)


def loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_parity(stock_model, fused_model, **inputs):
    ref, ref_grads = loss_and_grads(stock_model, **inputs)
    out, grads = loss_and_grads(fused_model, **inputs)
    assert out.loss.dtype == torch.float32
    assert_close(out.loss, ref.loss, "loss")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], name)
    return out, ref
