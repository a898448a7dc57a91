"""The pieces of verl 0.9.1's actor that the verl-venv tests drive on CPU (``make test-verl``).

verl 0.9.1 has no ``DataParallelPPOActor`` any more: its actor is the engine worker's
``FSDPEngineWithLMHead`` (``verl/workers/engine/fsdp/transformer_impl.py``), whose ``forward_step``
prepares the packed inputs (``prepare_model_inputs``), runs the model's forward (verl's fused forward after
``apply_monkey_patch``), lays out log-probs / entropy / Σπ² (``prepare_model_outputs``) and applies the loss
(``ppo_loss``). Those run here unchanged. What does not run on CPU, and why:

- ``FSDPEngine.__init__`` / ``initialize()``: builds a device mesh and FSDP2 over an accelerator, inside a Ray
  worker (``engine_workers.py``); ``engine()`` below makes the object without them and sets the attributes
  ``forward_step`` reads, the model unwrapped.
- verl's platform layer has no CPU platform (``verl.utils.device``: it falls back to "nvidia", so
  ``get_device_id()`` calls ``torch.cuda.current_device()`` and fails on a CPU-only torch):
  ``transformer_impl``'s ``get_device_id`` / ``get_device_name`` are pointed at the CPU (``cpu_device``).
- verl's own Triton kernel (``verl.utils.kernel.kernels``) asserts CUDA tensors, so verl's ``triton`` backend
  is compared on a GPU only; the plugin's function under that backend runs here.
"""
from __future__ import annotations

import types

import torch


def nested(tensors):
    return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)


def micro_batch(prompt_lens, resp_lens, vocab, *, fused=True, sum_pi_squared=False, temperature=0.8, seed=0):
    """A verl micro-batch as its trainer hands it to the engine: packed (nested) prompts + responses,
    response mask, old log-probs and advantages, and the engine's flags."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (p,), generator=g) for p in prompt_lens]
    resps = [torch.randint(1, vocab, (r,), generator=g) for r in resp_lens]
    ids = [torch.cat([a, b]) for a, b in zip(prompts, resps)]
    return tu.get_tensordict({
        "input_ids": nested(ids), "position_ids": nested([torch.arange(len(i)) for i in ids]),
        "prompts": nested(prompts), "responses": nested(resps),
        "response_mask": nested([torch.ones(r, dtype=torch.long) for r in resp_lens]),
        "old_log_probs": nested([-torch.rand(r, generator=g) * 3 for r in resp_lens]),
        "advantages": nested([torch.randn(r, generator=g) for r in resp_lens]),
    }, non_tensor_dict={"temperature": temperature, "use_remove_padding": True, "use_fused_kernels": fused,
                        "calculate_entropy": True, "calculate_sum_pi_squared": sum_pi_squared,
                        "pad_mode": DatasetPadMode.NO_PADDING, "dp_size": 1, "batch_num_tokens": None,
                        "global_batch_size": None})


def cpu_device(monkeypatch):
    import verl.workers.engine.fsdp.transformer_impl as impl
    monkeypatch.setattr(impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(impl, "get_device_name", lambda: "cpu")


def engine(model):
    """An ``FSDPEngineWithLMHead`` around the unwrapped ``model`` (module docstring)."""
    import verl.utils.torch_functional as verl_F
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    e = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    e.module, e.use_ulysses_sp, e.pad_to_length, e._autocast_dtype = model, False, False, torch.float32
    e.engine_config = types.SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    e.compute_entropy_from_logits = verl_F.entropy_from_logits
    e.get_data_parallel_group = lambda: None
    return e


def ppo_loss():
    """verl's PPO loss (vanilla clip, token-mean) with its default actor config."""
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss as loss
    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False, rollout_n=1,
                         entropy_coeff=0.01)
    return lambda model_output, data, dp_group: loss(config, model_output, data, dp_group)
