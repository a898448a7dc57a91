"""The truncated (top-k / top-p) entropy keeps fp32 precision when the logits are large: ``sum_S p_c (lse_S -
q_c)`` (non-negative terms) instead of ``lse_S - sum_S p_c q_c``, whose two O(|q|) terms cancel to an O(1)
entropy (the bench's top-p row on real hidden states, logits ~28: 2.6e-5 nats off, 14 fp32 ulps of 28)."""
import pytest
import torch

import fusedce
import truncated_reference64 as trunc64

U32 = 2.0 ** -24


@pytest.mark.parametrize("offset", [0.0, 30.0, -200.0])
@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (5, 1.0), (8, 0.7)])
def test_truncated_entropy_of_large_logits(offset, top_k, top_p):
    x = torch.randn(6, 64) * 1.5 + offset
    target = x.argmax(-1)
    out = fusedce.token_log_probs(x, target, return_entropy=True, top_k=top_k, top_p=top_p)
    lp, ent = trunc64.reference(x.double(), target, [top_k] * 6, [top_p] * 6)
    # each term of the sum carries a few fp32 ulps of itself: 64 u of the entropy (at least of 1)
    bound = 64 * U32 * ent.detach().abs().clamp(min=1.0)
    assert ((out.entropy.double() - ent.detach()).abs() <= bound).all(), (out.entropy, ent)
    assert ((out.log_probs.double() - lp.detach()).abs() <= 64 * U32 * (1 + lp.detach().abs())).all()
