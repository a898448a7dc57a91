"""``fusedce.integrations.torchtitan`` on one process: the fused loss equals torchtitan 0.3.0's own
``ChunkedLossWrapper`` + ``CrossEntropyLoss`` (loss, metrics, gradients of the decoder and of the head, fp32,
with ignored labels and ``global_valid_tokens``), in training and validation (no grad); its RL
``compute_logprobs`` equals torchtitan's on full logits; what it cannot serve raises. torchtitan's Trainer
itself needs a CUDA/NCCL job, so the loss objects are compared as the trainer drives them
(``titan_models.run``). Tolerances: torch's fp32 defaults (the two differ by the order of fp32 sums)."""
from __future__ import annotations

import copy
from importlib import metadata

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is installed by `make install`")

from torchtitan.components.loss import ChunkedLossWrapper, MSELoss  # noqa: E402
from torchtitan.components.loss import compute_logprobs as stock_logprobs  # noqa: E402

from fusedce.integrations import torchtitan as tt  # noqa: E402
from titan_models import Tail, V, batch, fused_loss, run, stock_loss  # noqa: E402


def _pair():
    torch.manual_seed(0)
    model = Tail()
    return model, copy.deepcopy(model)


def test_loss_and_gradients_equal_torchtitan_chunked_loss():
    stock_model, fused_model = _pair()
    x, labels = batch()
    gvt = (labels != -100).sum() + 5   # the global count (other ranks' tokens too), not the local one
    stock, stock_metrics = run(stock_loss(), stock_model, x, labels, gvt)
    fused, fused_metrics = run(fused_loss(), fused_model, x, labels, gvt)
    assert fused.dtype == torch.float32 and fused_metrics == stock_metrics == {}
    torch.testing.assert_close(fused, stock)
    for (name, p), q in zip(stock_model.named_parameters(), fused_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_without_global_valid_tokens_is_the_token_sum():
    stock_model, fused_model = _pair()
    x, labels = batch(1)
    stock, _ = run(stock_loss(), stock_model, x, labels, None)
    fused, _ = run(fused_loss(), fused_model, x, labels, None)
    torch.testing.assert_close(fused, stock)
    torch.testing.assert_close(fused_model.lm_head.weight.grad, stock_model.lm_head.weight.grad)


def test_validation_without_grad_equals_stock():
    stock_model, fused_model = _pair()
    x, labels = batch(2)
    with torch.no_grad():
        stock, _ = run(stock_loss(), stock_model, x, labels, torch.tensor(20), backward=False)
        fused, _ = run(fused_loss(), fused_model, x, labels, torch.tensor(20), backward=False)
    torch.testing.assert_close(fused, stock)
    assert fused_model.lm_head.weight.grad is None


def test_is_a_chunked_loss_wrapper_so_the_trainer_hands_it_the_head():
    """The trainer's test (trainer.py: ``isinstance(self.loss_fn, ChunkedLossWrapper)``), and nothing in
    torchtitan is changed by the import."""
    assert isinstance(fused_loss(), ChunkedLossWrapper)
    assert ChunkedLossWrapper.__call__.__module__ == "torchtitan.components.loss"


def test_the_head_forward_is_not_called(monkeypatch):
    model, _ = _pair()
    calls = []
    model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    run(fused_loss(), model, *batch(), None)
    assert calls == []


def test_compute_logprobs_equals_torchtitan_on_full_logits():
    stock_model, fused_model = _pair()
    x, labels = batch(3)
    h_s, h_f = x.clone().requires_grad_(), x.clone().requires_grad_()
    lp_s, ent_s = stock_logprobs(stock_model.lm_head(h_s) / 0.7, labels, return_entropy=True)
    lp_f, ent_f = tt.compute_logprobs(h_f, fused_model.lm_head, labels, return_entropy=True, temperature=0.7)
    torch.testing.assert_close(lp_f, lp_s)
    torch.testing.assert_close(ent_f, ent_s)
    assert not ent_f.requires_grad
    g = torch.randn_like(lp_s)
    (lp_s * g).sum().backward()
    (lp_f * g).sum().backward()
    torch.testing.assert_close(h_f.grad, h_s.grad)
    torch.testing.assert_close(fused_model.lm_head.weight.grad, stock_model.lm_head.weight.grad)
    with torch.no_grad():   # without entropy: the log-probs alone
        torch.testing.assert_close(tt.compute_logprobs(x, fused_model.lm_head, labels),
                                   stock_logprobs(stock_model.lm_head(x), labels))


def test_refusals():
    with pytest.raises(ValueError, match="loss_fn must be CrossEntropyLoss.Config"):
        tt.FusedLinearCrossEntropy.Config(loss_fn=MSELoss.Config()).build()
    with pytest.raises(RuntimeError, match="set_lm_head"):
        fused_loss()(*batch())

    class Capped(torch.nn.Linear):
        def forward(self, x):
            return torch.tanh(super().forward(x))

    with pytest.raises(TypeError, match="plain linear layer.*Capped"):
        loss = fused_loss()
        loss.set_lm_head(Capped(4, V))
        loss(torch.randn(1, 8, 4), torch.zeros(1, 8, dtype=torch.long))
    # fresh-user findings: a chunk_size of the wrong type failed only at the first call; float labels were named
    # by the fused op's flattened target
    for chunk in ("4", 0, 2.5, True):
        with pytest.raises(ValueError, match=rf"chunk_size must be an int >= 1 or None, got {chunk!r}"):
            tt.FusedLinearCrossEntropy.Config(chunk_size=chunk).build()
    with pytest.raises(ValueError, match=r"unknown backend 'bogus'; valid names are"):   # at build, not the first step
        tt.FusedLinearCrossEntropy.Config(backend="bogus").build()
    loss = fused_loss()
    loss.set_lm_head(torch.nn.Linear(4, V, bias=False))
    with pytest.raises(TypeError, match=r"labels must be integer token ids .*torch\.float32 of shape \(1, 8\)"):
        loss(torch.randn(1, 8, 4), torch.zeros(1, 8))
    with pytest.raises(TypeError, match=r"pred and labels swapped\?"):
        loss(torch.zeros(1, 8, dtype=torch.long), torch.randn(1, 8, 4))


def test_spmd_type_checking_is_refused():
    from spmd_types.checker import typecheck
    model, _ = _pair()
    with typecheck(local=False), pytest.raises(NotImplementedError, match="debug.spmd_typechecking"):
        run(fused_loss(), model, *batch(), None)
    assert model.lm_head.weight.grad is None


def test_other_torchtitan_versions_are_refused(monkeypatch):
    from fusedce.integrations.torchtitan import version
    assert metadata.version("torchtitan") == tt.SUPPORTED_VERSION
    version.check_version()
    monkeypatch.setattr(version.metadata, "version", lambda name: "0.2.2")
    with pytest.raises(ImportError, match=r"torchtitan==0\.3\.0 only.*found torchtitan 0\.2\.2"):
        version.check_version()


def test_all_labels_ignored_equals_stock():
    stock_model, fused_model = _pair()
    x, labels = batch(4)
    labels[:] = -100
    stock, _ = run(stock_loss(), stock_model, x, labels, torch.tensor(7))
    fused, _ = run(fused_loss(), fused_model, x, labels, torch.tensor(7))
    torch.testing.assert_close(fused, stock)
    for p, q in zip(stock_model.parameters(), fused_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
