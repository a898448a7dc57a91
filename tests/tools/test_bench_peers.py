"""The bench's peers (``fusedce.tools.bench.peers``: torch's ``F.linear_cross_entropy``, TRL's
``ChunkedLogProbFunction``) and the goals against them (``fusedce.tools.bench.goals``), at tiny shapes."""
import pytest
import torch

from fusedce.tools.bench import goals, inputs, parity, peers
from versions import TORCH, needs_torch_lce

TINY_RANDOM = {"kind": "random", "hidden": 16, "vocab": 300, "tokens": 96, "ignore_fraction": 0.5,
               "weight_std": 0.02, "seed": 0}


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


@pytest.mark.skipif(TORCH != (2, 13), reason=f"pins torch 2.13's private chunking rule of F.linear_cross_entropy "
                                             f"(LinearCrossEntropyOptions._adjust); this is torch {torch.__version__}")
@pytest.mark.parametrize("dtype, policy, factor", [(torch.float32, "compact", 2), (torch.bfloat16, "accurate", 1)])
def test_torch_lce_resolution_on_cpu(dtype, policy, factor):
    # torch 2.13's "auto" on CPU: bf16 -> ("accurate", "aspect_ratio"), fp32 unlisted -> ("compact",
    # "aspect_ratio:2"); rows = next_pow2(ceil(BT / ceil(V / H))) // factor (its documented rule)
    data = inputs.build({**TINY_RANDOM, "tokens": 4096, "hidden": 576, "vocab": 49152}, ("hidden", "weight"),
                        dtype, "cpu")
    got = peers.torch_lce_resolved(data)
    rows = _next_pow2(-(-4096 // -(-49152 // 576))) // factor
    assert got == {"acc_policy": policy, "chunking_method": "aspect_ratio" + (f":{factor}" if factor > 1 else ""),
                   "batch_chunk_size": rows, "acc_dtype": "float32"}


def test_trl_tile_is_trls_own():
    utils = pytest.importorskip("trl.trainer.utils")
    assert peers.TRL_VOCAB_TILE == utils._CHUNKED_LOGPROB_CHUNK_SIZE


@pytest.mark.parametrize("forward", [pytest.param(peers.torch_linear_cross_entropy, marks=needs_torch_lce),
                                     peers.trl_mean_nll])
def test_peers_compute_the_mean_nll(forward):
    pytest.importorskip("trl.kernels")
    data = inputs.build(TINY_RANDOM, ("hidden", "weight"), torch.float32, "cpu")
    loss = forward(data)
    loss.backward()
    ref = parity.linear_cross_entropy(data.hidden, data.weight, data.target, loss.detach(),
                                      {"hidden": data.hidden.grad, "weight": data.weight.grad})
    assert ref["loss_abs_err"] < 1e-5 and ref["grad_rel_err"] < 1e-5


def test_trl_log_probs_against_fusedce_and_float64():
    pytest.importorskip("trl.kernels")
    data = inputs.build(TINY_RANDOM, ("hidden", "weight"), torch.float32, "cpu")
    check = peers.trl_log_probs_check(data)
    assert check["scored_rows"] == 48 and check["fp64_rows"] == 48
    assert check["log_probs_vs_fusedce_max_abs"] < 1e-5
    assert 0 < check["trl_log_probs_vs_fp64_max_abs"] < 1e-5 and check["fusedce_log_probs_vs_fp64_max_abs"] < 1e-5


def _row(ms, mib, status="ok"):
    return {"status": status, "time_ms": ms, "peak_bytes": mib * 2**20}


def test_goals_met_missed_and_unknown():
    peer = {"torch-lce": _row(300, 100), "trl": _row(200, 900)}
    met = goals.versus_peers(_row(100, 90), _row(150, 50), peer, {"stock": _row(120, 2000)})
    assert all(g["met"] for g in met.values()) and "torch-lce 100.00 MiB" in met["chunked_leaner"]["detail"]
    missed = goals.versus_peers(_row(250, 101), _row(150, 95), peer, {"stock": _row(120, 2000)})
    assert missed["chunked_faster"]["met"] is False          # slower than trl (200 ms)
    assert missed["chunked_leaner"]["met"] is False          # 101 MiB > torch-lce's 100
    assert missed["tiled_least"]["met"] is True
    assert goals.versus_peers(_row(100, 90), _row(150, 100), peer, {})["tiled_least"]["met"] is False
    unknown = goals.versus_peers(_row(100, 90), None, {"trl": _row(0, 0, "unavailable")}, {})
    assert all(g["met"] is None for g in unknown.values())


def test_real_goals_group_by_shape_and_dtype():
    def row(path, label, dtype, ms, mib, peer=False):
        return {"op": "linear_cross_entropy", "mode": "timed", "shape": "real", "dtype": dtype, "path": path,
                "label": label, "peer": peer, **_row(ms, mib)}
    rows = [row("linear-torch", "torch", "float32", 50, 2000), row("c", "chunked", "float32", 30, 100),
            row("t", "tiled", "float32", 60, 60), row("p", "peer", "float32", 90, 99, peer=True),
            row("c", "chunked", "bfloat16", 30, 100)]     # no peer in bf16: no entry
    out = goals.real_goals(rows, "c", "t")
    assert [(e["shape"], e["dtype"]) for e in out] == [("real", "float32")]
    assert out[0]["goals"]["chunked_leaner"]["met"] is False and out[0]["goals"]["tiled_least"]["met"] is True
