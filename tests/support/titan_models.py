"""Shared pieces of the torchtitan tests: a tiny decoder tail (a linear layer standing for the decoder, the
LM head) and a batch with ignored labels; the stock loss (torchtitan's ChunkedLossWrapper +
CrossEntropyLoss) and fusedce's, run the way torchtitan's trainer runs them (``set_lm_head``, then
``loss.backward()`` through the returned loss)."""
from __future__ import annotations

import torch
import torch.nn as nn

from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss

from fusedce.integrations.torchtitan import FusedLinearCrossEntropy

B, L, H, V = 2, 16, 12, 41     # V odd: uneven vocabulary shards over 2 ranks


class Tail(nn.Module):
    """``proj`` stands for the decoder (its gradient is the hidden-state gradient's only way back)."""

    def __init__(self, vocab: int = V):
        super().__init__()
        self.proj = nn.Linear(H, H, bias=False)
        self.lm_head = nn.Linear(H, vocab, bias=False)

    def forward(self, x):
        return self.proj(x)   # the trainer's _skip_lm_head: normed hidden states


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, H, generator=g)
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[0, :3] = IGNORE_INDEX
    labels[1, -2:] = IGNORE_INDEX
    return x, labels


def stock_loss(vocab: int | None = None):
    return ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab)).build()


def fused_loss():
    return FusedLinearCrossEntropy.Config().build()


def run(loss_fn, model, x, labels, gvt, backward: bool = True):
    """One trainer step's loss: set the head, forward the hidden states, the loss, ``loss.backward()``."""
    loss_fn.set_lm_head(model.lm_head)
    pred = model(x)
    loss, metrics = loss_fn(pred, labels, gvt)
    if backward:
        loss.backward()
    return loss, metrics
