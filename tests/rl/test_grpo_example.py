"""examples/grpo_smollm2.py's step on a tiny random Llama: stock and fused give the same policy loss and
the same gradient for every parameter (the example's claim), for both linear methods; the helpers'
reward and advantages behave as documented."""
import importlib.util
from argparse import Namespace
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location("grpo_smollm2",
                                              Path(__file__).parents[2] / "examples" / "grpo_smollm2.py")
grpo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grpo)


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=211, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).train()


@pytest.mark.parametrize("method", ["chunked", "tiled"])
def test_stock_and_fused_step_agree(method):
    model = _tiny_model()
    sequences = torch.randint(0, 211, (6, 12))
    attention = torch.ones_like(sequences)
    target = torch.nn.functional.pad(sequences, (0, 1), value=-100)[:, 1:].clone()
    target[:, :5] = -100                                   # the prompt
    target[2, 9:] = -100                                   # an early EOS
    adv = grpo.advantages(torch.rand(6), group=3)
    args = Namespace(temperature=0.8, beta=0.01, method=method)
    stock_loss, stock_grads, _, _ = grpo.step(model, sequences, attention, target, adv, args, fused=False)
    fused_loss, fused_grads, _, _ = grpo.step(model, sequences, attention, target, adv, args, fused=True)
    torch.testing.assert_close(fused_loss, stock_loss, rtol=1e-5, atol=1e-6)
    assert stock_grads.keys() == fused_grads.keys() and len(stock_grads) > 0
    for name in stock_grads:
        torch.testing.assert_close(fused_grads[name], stock_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_reward_and_advantages():
    assert grpo.reward("And God said", "and God said let there be light") == pytest.approx(3 / 7)
    assert grpo.reward("", "light") == 0.0
    adv = grpo.advantages(torch.tensor([1.0, 0.0, 0.5, 0.2, 0.2, 0.2]), group=3)
    assert adv[:3].sum().abs() < 1e-5 and adv[0] > adv[2] > adv[1]
    assert torch.equal(adv[3:], torch.zeros(3))            # equal rewards: no advantage
