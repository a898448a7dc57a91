"""A row of logits that are all -inf has no distribution: its log-prob is NaN and so must its entropy be
(float64 torch gives NaN for both), never a healthy-looking 0 that an entropy bonus would reward (issue 47
item 6). A row with some -inf logits (a masked vocabulary) keeps finite values: those classes add 0.
Both backends (triton under the interpreter), the logits op (class-index and (..., K) targets, with
``return_stats``), the linear op (a -inf bias: both methods) and the vocab-parallel ops (one gloo rank),
against float64 torch."""
import pytest
import torch

import fusedce

V, H = 37, 8   # odd V: a masked tail in the kernels' vocabulary blocks
NAN_ROW, MASKED_ROW = (0, 1), (1, 2)   # (b, t): all -inf; the first 20 classes -inf


def _logits(dtype):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, V, generator=g) * 2
    z[NAN_ROW] = float("-inf")
    z[MASKED_ROW][:20] = float("-inf")
    return z.to(dtype)


def _target():
    t = torch.randint(0, V, (2, 3), generator=torch.Generator().manual_seed(1))
    t[MASKED_ROW] = 25   # a class that is not masked
    return t


def _reference(z, target):
    """float64 torch: the target's log-prob and the entropy ``sum_c entr(p_c)`` (0 log 0 = 0, NaN kept)."""
    lp = z.double().log_softmax(-1)
    return lp.gather(-1, target[..., None])[..., 0], torch.special.entr(lp.exp()).sum(-1)


def _check(log_probs, entropy, z, target, nan_row=True):
    ref_lp, ref_ent = _reference(z, target)
    if nan_row:   # the reference's own claim
        assert torch.isnan(ref_ent[NAN_ROW]) and torch.isnan(ref_lp[NAN_ROW])
    torch.testing.assert_close(log_probs.double(), ref_lp, atol=2e-5, rtol=0, equal_nan=True)
    torch.testing.assert_close(entropy.double(), ref_ent, atol=2e-5, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stats", [False, True], ids=["plain", "stats"])
def test_token_log_probs(backend, dtype, stats):
    z, t = _logits(dtype), _target()
    out = fusedce.token_log_probs(z, t, return_entropy=True, return_stats=stats, backend=backend)
    _check(out.log_probs, out.entropy, z, t)


def test_token_log_probs_k_targets(backend):
    z, t = _logits(torch.float32), _target()
    tk = torch.stack([t, torch.full_like(t, 30)], dim=-1)   # (B, T, K=2)
    out = fusedce.token_log_probs(z, tk, return_entropy=True, backend=backend)
    for k in range(2):
        _check(out.log_probs[..., k], out.entropy, z, tk[..., k])


@pytest.mark.parametrize("method", ["chunked", "tiled"])
def test_linear_token_log_probs_neg_inf_bias(backend, method):
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(2, 3, H, generator=g), torch.randn(V, H, generator=g)
    bias = torch.zeros(V)
    bias[:20] = float("-inf")   # every row: the first 20 classes masked
    t = _target()
    out = fusedce.linear_token_log_probs(hidden, weight, t, bias, return_entropy=True, method=method,
                                         backend=backend)
    _check(out.log_probs, out.entropy, hidden @ weight.T + bias, t, nan_row=False)
    everything = torch.full((V,), float("-inf"))   # every class masked: no distribution on any row
    out = fusedce.linear_token_log_probs(hidden, weight, t, everything, return_entropy=True, method=method,
                                         backend=backend)
    assert torch.isnan(out.log_probs).all() and torch.isnan(out.entropy).all(), (out.log_probs, out.entropy)


def test_vocab_parallel_log_probs(backend, group):
    """The vocab-parallel ops' entropy (from exchanged row statistics) on one rank: NaN on the same rows."""
    import fusedce.distributed as fd
    z, t = _logits(torch.float32), _target()
    out = fd.vocab_parallel_token_log_probs(z, t, return_entropy=True, backend=backend)
    _check(out.log_probs, out.entropy, z, t)
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(2, 3, H, generator=g), torch.randn(V, H, generator=g)
    out = fd.vocab_parallel_linear_token_log_probs(hidden, weight, t, torch.full((V,), float("-inf")),
                                                   return_entropy=True, backend=backend)
    assert torch.isnan(out.log_probs).all() and torch.isnan(out.entropy).all(), (out.log_probs, out.entropy)
