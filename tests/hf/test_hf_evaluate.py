"""A patched model in evaluation (``transformers.Trainer.evaluate``: labels given, autograd off) and the
patch's label errors. Tiny random Llama of ``hf_models.py``; CPU, fp32; tolerances of ``hf_models.py``."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedce.integrations.hf.patch import patch_causal_lm  # noqa: E402
from hf_models import SEQ, VOCAB, assert_close, batch, build  # noqa: E402


def _rows(n=6):
    generator = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        ids = torch.randint(1, VOCAB, (SEQ,), generator=generator)
        labels = ids.clone()
        labels[: 2 + i % 3] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return rows


def _next_token_accuracy(prediction):
    """The share of label tokens whose logit argmax one position earlier is that token (needs logits)."""
    logits, labels = prediction.predictions, prediction.label_ids
    predicted, target = np.argmax(logits[:, :-1], axis=-1), labels[:, 1:]
    keep = target != -100
    return {"accuracy": float((predicted[keep] == target[keep]).mean())}


def _evaluate(model, tmp_path, compute_metrics):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=3, report_to=[],
                                          use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=_rows(), compute_metrics=compute_metrics)
    return trainer.evaluate()


@pytest.mark.parametrize("metrics", [None, _next_token_accuracy], ids=["loss only", "compute_metrics"])
def test_trainer_evaluate_matches_stock(tmp_path, metrics):
    """``Trainer.evaluate()`` on a patched model: the stock eval loss and, with a ``compute_metrics`` that
    needs the logits, the stock metric (the default ``keep_logits=None`` returns the logits when autograd
    is off; it used to return None there: "attempt to get argmax of an empty sequence")."""
    stock = build("llama")
    fused = patch_causal_lm(copy.deepcopy(stock))
    expected, got = _evaluate(stock, tmp_path, metrics), _evaluate(fused, tmp_path, metrics)
    assert_close(torch.tensor(got["eval_loss"]), torch.tensor(expected["eval_loss"]), "eval_loss")
    if metrics is not None:
        assert 0.0 <= expected["eval_accuracy"] <= 1.0
        assert got["eval_accuracy"] == expected["eval_accuracy"]


def test_keep_logits_modes():
    """None (default): logits without autograd, None in training; True: always; False: never. The loss is
    the fused one in every mode (the same value with and without logits)."""
    ids, mask, labels = batch()
    stock = build("llama")
    with torch.no_grad():
        reference = stock(input_ids=ids, attention_mask=mask, labels=labels)
    for keep, with_grad, without_grad in ((None, False, True), (True, True, True), (False, False, False)):
        model = patch_causal_lm(copy.deepcopy(stock), keep_logits=keep)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        assert (out.logits is not None) == with_grad and out.loss.grad_fn is not None
        assert_close(out.loss.detach(), reference.loss, f"loss (keep_logits={keep}, grad)")
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
        assert (out.logits is not None) == without_grad
        assert_close(out.loss, reference.loss, f"loss (keep_logits={keep}, no grad)")
        if without_grad:
            assert_close(out.logits, reference.logits, "logits")
    with pytest.raises(TypeError, match="keep_logits"):
        patch_causal_lm(build("llama"), keep_logits="eval")


@pytest.mark.parametrize("shifted", [False, True], ids=["labels", "shift_labels"])
def test_bad_label_names_the_users_element(shifted):
    """A label outside [0, V): the IndexError names the user's ``labels[b, t]`` (or ``shift_labels[b, t]``),
    not a position of the shifted, flattened target the loss sees."""
    model = patch_causal_lm(build("llama"))
    ids, mask, labels = batch()
    if shifted:
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        shift[2, 6] = VOCAB + 4
        call = dict(labels=labels, shift_labels=shift)
        match = rf"shift_labels\[2, 6\] = {VOCAB + 4} is out of range.*\[0, {VOCAB}\)"
    else:
        labels[1, 7] = VOCAB + 4
        call = dict(labels=labels)
        match = rf"^labels\[1, 7\] = {VOCAB + 4} is out of range.*\[0, {VOCAB}\)"
    with pytest.raises(IndexError, match=match):
        model(input_ids=ids, attention_mask=mask, **call)
