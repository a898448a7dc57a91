"""patch_causal_lm with a partitioned LM head: ZeRO-3's hook pattern emulated, and DeepSpeed ZeRO-3 itself
(case C18).

The emulation (``Zero3Hooks``) does to each module with parameters of the head's subtree what ZeRO-3
does: outside the module's forward its weights hold ``torch.empty(0)``; a forward pre-hook puts the full
weights in ``.data``, a forward hook puts the empty tensors back and registers a hook on the output that
re-gathers them when the backward reaches it. The stock model runs under it (F.linear saves the weight
tensor, whose data is full again when its backward runs); the patch must too, with every hook firing
once per forward and the weight read only while gathered. Tolerances as in ``hf_models``.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedce.integrations.hf.patch import patch_causal_lm  # noqa: E402
from hf_models import assert_parity, batch, build  # noqa: E402
from zero3_hooks import Zero3Hooks  # noqa: E402


def _lora(model):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"],
                                                       init_lora_weights=False))
    model.get_input_embeddings().weight.requires_grad_(True)
    return model


@pytest.mark.parametrize("head", ["linear", "lora"])
@pytest.mark.parametrize("order", ["patch, then hooks", "hooks, then patch"])
def test_zero3_style_hooks_forward_and_backward_match_stock(head, order):
    plain = build("llama", tied=False)
    if head == "lora":
        plain = _lora(plain)
    stock, fused = copy.deepcopy(plain), copy.deepcopy(plain)
    Zero3Hooks(stock.get_output_embeddings())
    if order == "patch, then hooks":
        patch_causal_lm(fused)
        hooks = Zero3Hooks(fused.get_output_embeddings())
    else:
        hooks = Zero3Hooks(fused.get_output_embeddings())
        patch_causal_lm(fused)   # the head's weight is an empty partition here: no shape checks now
    modules = len(hooks.full)
    ids, mask, labels = batch()
    assert_parity(stock, fused, input_ids=ids, attention_mask=mask, labels=labels)
    assert hooks.counts == {"pre": modules, "post": modules, "regather": modules}
    assert_parity(plain, fused, input_ids=ids, attention_mask=mask, labels=labels)   # and unhooked
    assert hooks.counts["pre"] == 2 * modules


@pytest.mark.parametrize("method", ["chunked", "tiled"])
def test_zero3_style_hooks_on_the_triton_backend(method):
    """C18 on the Triton kernels (interpreter): the loss runs where the hooks have gathered the weight."""
    plain = build("llama", tied=False)
    stock, fused = copy.deepcopy(plain), copy.deepcopy(plain)
    Zero3Hooks(stock.get_output_embeddings())
    patch_causal_lm(fused, backend="triton", method=method)
    hooks = Zero3Hooks(fused.get_output_embeddings())
    ids, mask, labels = batch()
    assert_parity(stock, fused, input_ids=ids, attention_mask=mask, labels=labels)
    assert hooks.counts == {"pre": 1, "post": 1, "regather": 1}


def test_weight_read_outside_its_forward_is_refused_clearly():
    """A head whose weight is not gathered inside its own call cannot be computed: a TypeError says so."""
    model = patch_causal_lm(build("llama", tied=False))
    model.lm_head.weight.data = torch.empty(0)
    ids, mask, labels = batch()
    with pytest.raises(TypeError, match="inside the module's own forward is not a 2-D"):
        model(input_ids=ids, attention_mask=mask, labels=labels)


SUBPROCESS_TIMEOUT_S = 300   # measured: ~40 s on the 2-core VM, loaded


@pytest.mark.timeout(SUBPROCESS_TIMEOUT_S + 120)
def test_deepspeed_zero3_matches_stock():
    """DeepSpeed ZeRO-3 itself (CPU accelerator, gloo, one rank: the weights are still empty partitions
    outside their modules' forward), stock vs patched before and after ``deepspeed.initialize``. Runs in
    a subprocess (DeepSpeed initialises torch.distributed in-process), with a shorter limit than the test's
    own, so that a stuck subprocess's output (where it waits) is reported, not lost to pytest's timeout."""
    pytest.importorskip("deepspeed")
    tests = str(Path(__file__).resolve().parents[1] / "support")   # hf_models.py, the shared tiny models
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    try:
        run = subprocess.run([sys.executable, str(Path(__file__)), "deepspeed"], capture_output=True, text=True,
                             env=env, timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired as stuck:
        out = [(o.decode(errors="replace") if isinstance(o, bytes) else o or "")[-3000:]
               for o in (stuck.stdout, stuck.stderr)]
        pytest.fail(f"the DeepSpeed subprocess ran past {SUBPROCESS_TIMEOUT_S} s; its output:\n" + "\n".join(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "deepspeed zero3 parity ok" in run.stdout, run.stdout[-3000:]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_main() -> None:
    """The subprocess of ``test_deepspeed_zero3_matches_stock``: one SGD-free step (lr 0) of each model
    under ZeRO-3; prints loss and max gradient differences (full gradients gathered by DeepSpeed)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import safe_get_full_grad
    # One rank needs no shared-memory allreduce: without this, DeepSpeed JIT-compiles its CPU shm op
    # (minutes of g++ on a fresh machine, and a lock left by an interrupted build hangs every later run).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 3, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    plain = build("llama", tied=False)
    ids, mask, labels = batch()
    reference = copy.deepcopy(plain)
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    expected.backward()
    for run in ("stock", "patched before initialize", "patched after initialize"):
        model = copy.deepcopy(plain)
        if run == "patched before initialize":
            patch_causal_lm(model)
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        if run == "patched after initialize":
            patch_causal_lm(engine.module)
        assert engine.module.lm_head.weight.numel() == 0, "ZeRO-3 did not partition the head"
        loss = engine(input_ids=ids, attention_mask=mask, labels=labels).loss
        engine.backward(loss)
        grad_diff = max(float((safe_get_full_grad(p) - reference.get_parameter(n).grad).abs().max())
                        for n, p in engine.module.named_parameters())
        print(f"deepspeed zero3 {run}: loss {float(loss.detach()):.6f} |diff| "
              f"{abs(float(loss.detach() - expected.detach())):.2e} max |grad diff| {grad_diff:.2e}")
        scale = max(float(p.grad.abs().max()) for p in reference.parameters())
        assert abs(float(loss.detach() - expected.detach())) <= 2e-5 * float(expected.detach()), run
        assert grad_diff <= 2e-5 * scale, run
    print("deepspeed zero3 parity ok")


if __name__ == "__main__" and sys.argv[1:] == ["deepspeed"]:
    deepspeed_main()
