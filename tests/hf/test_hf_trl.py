"""patch_causal_lm with TRL's SFTTrainer: a few steps on the tiny Llama of ``hf_models``, patched vs not.

What TRL does with the patch: SFTTrainer (TRL >= 1.x) installs its own fused LM head on the model
(``trl.trainer.utils.add_fused_lm_head``) and computes the training loss through
``model(..., fused_lm_head=True)``; the patched forward passes such calls through unchanged. So the
trainer tests check that a patched model trains under SFTTrainer exactly as an unpatched one (patched
before the trainer or after it wrapped the model), with gradient accumulation and with padding-free
batches; the batch test then feeds TRL's own collated batches (padding-free: one row, ``position_ids``
restarting per sequence; ``num_items_in_batch``) to the patched model directly and compares loss and
gradients with the stock model's.

Data: pre-tokenised sequences of 6..12 random tokens (a pre-tokenised dataset needs no tokenizer
download); a tiny word-level tokenizer stands in as ``processing_class`` (pad id 0). SGD, lr 0.5,
constant schedule: each step's update is the gradient times 0.5, so any gradient difference shows in
the next step's loss.
"""
from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from fusedce.integrations.hf.patch import patch_causal_lm  # noqa: E402
from hf_models import assert_parity, build  # noqa: E402
from trl_data import _dataset, _tokenizer  # noqa: E402

STEPS = 3


def _train(model, tmp_path, patch_after=False, **config):
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=STEPS,
                         learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", save_strategy="no",
                         report_to=[], use_cpu=True, logging_steps=1, seed=0, disable_tqdm=True,
                         dataloader_num_workers=0, max_length=None, **config)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=_dataset(), processing_class=_tokenizer())
    if patch_after:
        patch_causal_lm(trainer.model)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("config", [dict(), dict(gradient_accumulation_steps=2),
                                    dict(padding_free=True, gradient_accumulation_steps=2)],
                         ids=["plain", "grad-accum", "padding-free+grad-accum"])
def test_sft_trainer_loss_curves_patched_equal_unpatched(tmp_path, config):
    stock = build("llama")
    fused = patch_causal_lm(copy.deepcopy(stock))
    late = copy.deepcopy(stock)
    curves = [_train(stock, tmp_path, **config), _train(fused, tmp_path, **config),
              _train(late, tmp_path, patch_after=True, **config)]
    assert len(curves[0]) == STEPS and curves[0][0] != curves[0][-1]
    assert curves[1] == pytest.approx(curves[0], rel=1e-5) and curves[2] == pytest.approx(curves[0], rel=1e-5)


@pytest.mark.parametrize("padding_free", [False, True])
def test_trl_collated_batches_through_the_patch_match_stock(padding_free):
    """TRL's collator output (padded, or padding-free with position_ids), with num_items_in_batch."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=padding_free)
    examples = [{"input_ids": row} for row in _dataset(3)["input_ids"]]
    inputs = collator(examples)
    assert ("position_ids" in inputs) == padding_free
    inputs.pop("cu_seq_lens_q", None), inputs.pop("cu_seq_lens_k", None)
    inputs.pop("max_length_q", None), inputs.pop("max_length_k", None)
    stock = build("llama")
    fused = patch_causal_lm(copy.deepcopy(stock))
    assert_parity(stock, fused, **inputs, num_items_in_batch=torch.tensor(25))
