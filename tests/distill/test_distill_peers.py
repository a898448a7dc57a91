"""``fusedce.distillation_loss`` next to its peers on the same inputs.

- TRL: ``trl.experimental.gkd.gkd_trainer.GKDTrainer.generalized_jsd_loss`` itself (installed), loss and the
  student's gradient: equal with labels (``reduction="batchmean"`` divides by the non-ignored count, as
  our mean); without labels TRL divides by the first dimension (the sequences), ours by the tokens, so
  ``num_items_in_batch=B`` matches it.
- Liger-Kernel (not installed here): its formulas re-derived in float64 from the source read at its
  2026-08 head (``chunked_loss/jsd_loss.py``, ``chunked_loss/fused_linear_distillation.py``,
  ``ops/jsd.py``): ``w_soft * JSD / n + w_hard * CE / n`` with TRL's ``beta``, the CE on the raw
  (un-tempered) logits; and the mixture of releases 0.5.3-0.5.5 (``m = beta s + (1 - beta) t``, no
  special case at 0 and 1), which agrees with ours only at beta = 0.5 and with the endpoints swapped.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import fusedce
from reference64_distill import distill_rows64

B, S, V = 3, 9, 64


def _trl():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gkd.gkd_trainer import GKDTrainer
    return GKDTrainer.generalized_jsd_loss


def _inputs():
    zs, zt = torch.randn(B, S, V) * 2.0, torch.randn(B, S, V) * 3.0
    labels = torch.randint(0, V, (B, S))
    labels[:, :3] = -100   # prompt tokens
    return zs, zt, labels


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.1])
def test_trl_generalized_jsd_loss(beta, temperature):
    zs, zt, labels = _inputs()
    a, b = zs.clone().requires_grad_(), zs.clone().requires_grad_()
    ours = fusedce.distillation_loss(a, zt, labels, beta=beta, temperature=temperature)
    trl = _trl()(b, zt, labels, beta=beta, temperature=temperature)
    ours.backward()
    trl.backward()
    ours, trl = float(ours.detach()), float(trl.detach())
    assert math.isclose(ours, trl, rel_tol=1e-5, abs_tol=1e-6), (ours, trl)
    assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7)
    # no labels: TRL's batchmean divides by B (sequences); num_items_in_batch=B reproduces it
    ours_b = fusedce.distillation_loss(zs, zt, beta=beta, temperature=temperature, num_items_in_batch=B)
    trl_b = _trl()(zs, zt, None, beta=beta, temperature=temperature)
    assert math.isclose(float(ours_b), float(trl_b), rel_tol=1e-5, abs_tol=1e-6)
    per_token = fusedce.distillation_loss(zs, zt, beta=beta, temperature=temperature)
    assert math.isclose(float(per_token) * S, float(trl_b), rel_tol=1e-5, abs_tol=1e-6)


def _kl(p_log, q_log):
    """sum p (log p - log q) per row, 0 log 0 = 0 (float64)."""
    p = p_log.exp()
    return torch.where(p > 0, p * (p_log - q_log), 0.0).sum(-1)


def liger_chunked(zs, zt, labels, *, beta, temperature, w_hard, w_soft, old_mixture=False, mask_jsd=True):
    """Liger's ``LigerFusedLinearJSDLoss`` on given logits, re-derived from its formulas (float64):
    ``(w_hard * sum CE + w_soft * sum JSD) / n``, n = non-ignored tokens (at least 1); the CE on the raw
    logits; ``old_mixture``: the 0.5.3-0.5.5 mixture; ``mask_jsd=False``: releases before 0.6.5, which
    summed the JSD of ignored tokens too."""
    zs, zt = zs.double().reshape(-1, zs.shape[-1]), zt.double().reshape(-1, zt.shape[-1])
    labels = labels.reshape(-1)
    valid = labels != -100
    ce = -torch.log_softmax(zs, -1).gather(1, torch.where(valid, labels, 0)[:, None])[:, 0]
    ls, lt = torch.log_softmax(zs / temperature, -1), torch.log_softmax(zt / temperature, -1)
    if old_mixture:   # m = beta s + (1 - beta) t at every beta
        lm = torch.logaddexp(ls + math.log(beta) if beta > 0 else torch.full_like(ls, -math.inf),
                             lt + math.log1p(-beta) if beta < 1 else torch.full_like(lt, -math.inf))
        jsd = beta * _kl(lt, lm) + (1 - beta) * _kl(ls, lm)
    elif beta == 0:
        jsd = _kl(lt, ls)
    elif beta == 1:
        jsd = _kl(ls, lt)
    else:
        lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
        jsd = beta * _kl(lt, lm) + (1 - beta) * _kl(ls, lm)
    n = max(int(valid.sum()), 1)
    jsd_sum = (jsd * valid).sum() if mask_jsd else jsd.sum()
    return (w_hard * (ce * valid).sum() + w_soft * jsd_sum) / n


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.1])
def test_liger_convention(beta):
    zs, zt, labels = _inputs()
    kw = dict(temperature=2.0)
    # current Liger = w_soft * ours with hard_label_weight = w_hard / w_soft (defaults 0.5 / 0.5)
    for w_hard, w_soft in ((0.5, 0.5), (0.2, 0.8)):
        liger = float(liger_chunked(zs, zt, labels, beta=beta, w_hard=w_hard, w_soft=w_soft, **kw))
        ours = float(fusedce.distillation_loss(zs, zt, labels, beta=beta, hard_label_weight=w_hard / w_soft, **kw))
        assert math.isclose(w_soft * ours, liger, rel_tol=1e-5), (w_soft * ours, liger)
    # the 0.5.3-0.5.5 mixture: our (1 - beta) at the endpoints, ours at 0.5, neither in between
    old = float(liger_chunked(zs, zt, labels, beta=beta, w_hard=0.0, w_soft=1.0, old_mixture=True, **kw))
    same = fusedce.distillation_loss(zs, zt, labels, beta=beta, **kw)
    mirrored = fusedce.distillation_loss(zs, zt, labels, beta=1.0 - beta, **kw)
    if beta in (0.0, 1.0):
        assert math.isclose(old, float(mirrored), rel_tol=1e-5) and not math.isclose(old, float(same), rel_tol=1e-3)
    elif beta == 0.5:
        assert math.isclose(old, float(same), rel_tol=1e-5)
    else:
        assert not math.isclose(old, float(same), rel_tol=1e-3) and not math.isclose(old, float(mirrored),
                                                                                     rel_tol=1e-3)


def test_liger_unmasked_jsd_before_0_6_5():
    """Before 0.6.5 the ignored (prompt) tokens' JSD entered the sum: larger than ours here."""
    zs, zt, labels = _inputs()
    unmasked = float(liger_chunked(zs, zt, labels, beta=0.5, temperature=1.0, w_hard=0.0, w_soft=1.0,
                                   mask_jsd=False))
    ours = float(fusedce.distillation_loss(zs, zt, labels, beta=0.5))
    rows = distill_rows64(zs, zt, None, beta=0.5)
    n = int((labels != -100).sum())
    assert math.isclose(unmasked, float(rows.sum()) / n, rel_tol=1e-9)
    assert unmasked > ours * 1.1
