"""``patch_causal_lm`` as a new user meets it (issue 47 items 4 and 5): ``reduction="none"`` returns the
documented flat ``(B*T,)`` per-position loss (element ``b*T + t`` predicts ``labels[b, t + 1]``; 0 at
ignored labels and at each sequence's last position), checked against float64 cross-entropy of the stock
model's own logits; labels shifted already, ``(B, T - 1)``, get a message about the shift, not about
``logits_to_keep``."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedce.integrations.hf.patch import patch_causal_lm  # noqa: E402
from hf_models import SEQ, VOCAB, batch, build  # noqa: E402
from tolerances import HF_ATOL_SCALE, HF_RTOL  # noqa: E402


def test_reduction_none_is_the_flat_per_position_loss():
    stock = build("llama")
    fused = patch_causal_lm(copy.deepcopy(stock), reduction="none")
    ids, mask, labels = batch()
    loss = fused(input_ids=ids, attention_mask=mask, labels=labels).loss
    with torch.no_grad():
        logits = stock(input_ids=ids, attention_mask=mask).logits.double()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]   # position t predicts labels[t + 1]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), shifted.reshape(-1), reduction="none")
    assert loss.shape == (ids.numel(),) and loss.dtype == torch.float32
    assert (loss.view(-1, SEQ)[:, -1] == 0).all() and (loss[shifted.reshape(-1) == -100] == 0).all()
    scale = float(expected.abs().max())
    torch.testing.assert_close(loss.double(), expected, rtol=HF_RTOL, atol=HF_ATOL_SCALE * scale + 1e-12)


def test_pre_shifted_labels_point_at_the_shift():
    fused = patch_causal_lm(build("llama"))
    ids, mask, labels = batch()
    with pytest.raises(ValueError, match=r"labels \(\d+, \d+\) look shifted already.*unshifted labels") as info:
        fused(input_ids=ids, attention_mask=mask, labels=labels[:, 1:])
    assert "logits_to_keep" not in str(info.value)
    with pytest.raises(ValueError, match="logits_to_keep"):   # another length: still the logits_to_keep hint
        fused(input_ids=ids, labels=labels, logits_to_keep=5)
