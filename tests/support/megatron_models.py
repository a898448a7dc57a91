"""A tiny megatron-core ``GPTModel`` under tensor parallelism on gloo / CPU, for the Megatron tests.

megatron-core 0.16's attention (``DotProductAttention``) asks for two CUDA-only helpers: the global
memory buffer (``parallel_state.get_global_memory_buffer()``: a CUDA scratch tensor that ``baddbmm`` reads
with ``beta=0``, so any tensor of the shape serves) and the CUDA RNG tracker's ``fork()`` (around the
attention dropout, 0 here). Its multi-token-prediction block gathers the hidden states over the
tensor-parallel ranks into a buffer on ``torch.cuda.current_device()`` (``mappings._gather_along_last_dim``),
as sequence parallel's mappings (gather / reduce-scatter along the sequence) and the MTP loss logging do:
``torch.cuda.current_device`` returns ``"cpu"`` here. The local spec's torch norm asserts
``not config.sequence_parallel`` (a guard: it has no sequence-parallel code; under SP its weight gradient is
each rank's partial sum, which Megatron's DDP all-reduces), so it is built from a copy of the config with
``sequence_parallel=False``; its per-rank gradients are compared rank by rank like every other.
``install_cpu_stand_ins`` gives these a CPU stand-in, in these test processes only (the library never
touches them).

Sizes: H = 16 and 2 attention heads (one per rank at TP = 2), V = 64 (32 rows per rank), s = 8, b = 2:
the smallest model whose every piece (embedding, attention, MLP, final norm, head) is split over the ranks.
"""
from __future__ import annotations

import contextlib
import copy

import torch

VOCAB, HIDDEN, HEADS, SEQ, BATCH = 64, 16, 2, 8, 2


class _CpuBuffer:
    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(shape, dtype=dtype)


class _NoForkTracker:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


def _gather_along_last_dim(input_, group):
    parts = [torch.empty_like(input_) for _ in range(group.size())]
    torch.distributed.all_gather(parts, input_.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _norm_without_sequence_parallel(stock_new):
    def new(cls, config, *args, **kwargs):
        if getattr(config, "sequence_parallel", False):
            config = copy.copy(config)
            config.sequence_parallel = False
        return stock_new(cls, config, *args, **kwargs)
    new._fusedce_stand_in = True
    return new


def install_cpu_stand_ins() -> None:
    """The CUDA-only helpers replaced by CPU stand-ins (module docstring)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    parallel_state.get_global_memory_buffer = _CpuBuffer
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: _NoForkTracker()
    mappings._gather_along_last_dim = _gather_along_last_dim
    torch.cuda.current_device = lambda: "cpu"
    if not getattr(WrappedTorchNorm.__new__, "_fusedce_stand_in", False):
        WrappedTorchNorm.__new__ = _norm_without_sequence_parallel(WrappedTorchNorm.__new__)


def init_tensor_parallel(world: int) -> None:
    """Megatron's parallel state with every rank of the (already initialised) default group in one
    tensor-parallel group; once per process."""
    from megatron.core import parallel_state
    install_cpu_stand_ins()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)


def tiny_gpt(world: int, *, tied: bool, post_process: bool = True, mtp_num_layers=None, **config):
    """A fp32 ``GPTModel`` (local layer spec, no dropout, CPU-initialised: the same weights on every rank
    for the same seed), tensor-parallel over ``world`` ranks."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig
    init_tensor_parallel(world)
    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
                            tensor_model_parallel_size=world, attention_dropout=0.0, hidden_dropout=0.0,
                            mtp_num_layers=mtp_num_layers, **config)
    spec = get_gpt_layer_local_spec()
    mtp = None if mtp_num_layers is None else get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
    return GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ, post_process=post_process,
                    share_embeddings_and_output_weights=tied, mtp_block_spec=mtp)


def batch(seed: int = 0):
    """``(input_ids, position_ids, attention_mask, labels)`` for ``BATCH x SEQ`` tokens, the same on every
    rank (a causal mask: True = masked out, as Megatron's)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool).tril().logical_not()
    return ids, pos, mask, labels
