"""A Megatron-core ``GPTModel`` with tensor parallelism, stock vs ``fusedce.patch_megatron``: the same loss
curve, and the peak memory of the LM head + loss per rank.

    torchrun --nproc-per-node 2 examples/megatron_tp.py                # CPU, gloo: 2 ranks, TP = 2
    torchrun --nproc-per-node 2 examples/megatron_tp.py --steps 5 --head-vocab 32000 --head-hidden 256 \\
        --head-tokens 2048
    torchrun --nproc-per-node 2 examples/megatron_tp.py --sequence-parallel --mtp 1   # SP + one MTP depth

Needs megatron-core 0.16 (``make install``, or ``pip install --no-deps megatron-core==0.16.1``); the
training part runs on 0.17 .. 0.19 too (``make test-megatron``'s environment), the head measurement calls
0.16's ``_postprocess`` directly.

What it does (every rank; rank 0 prints and writes ``results/megatron_tp.json``):
1. Megatron's parallel state with all ranks in one tensor-parallel group (TP = world size). On CPU,
   megatron-core's attention asks for a CUDA scratch buffer and the CUDA RNG tracker's ``fork``; this
   script gives both a CPU stand-in (``cpu_stand_ins``: a plain tensor, a null context; dropout is 0).
   With ``--sequence-parallel`` (or ``--mtp``) two more: ``torch.cuda.current_device()`` returns "cpu"
   (SP's gather / reduce-scatter and the MTP loss logging allocate on it) and the torch norm of the local
   spec is built from a copy of the config with ``sequence_parallel=False`` (its assert is a guard).
2. Two copies of the same tiny ``GPTModel`` (local layer spec, fp32, CPU-initialised from one seed, untied
   head unless ``--tied``), one stock and one patched, each with its own AdamW, trained ``--steps`` steps
   on the same batches: sequences that count up modulo V from a random start (learnable, so the loss
   falls). The loss is Megatron's per-token ``[b, s]`` tensor, averaged; both curves and their largest
   difference are printed.
3. The head alone at ``--head-vocab`` x ``--head-hidden`` and ``--head-tokens`` tokens: a ``GPTModel`` of that
   vocabulary and width, its ``_postprocess`` (output layer + ``compute_language_model_loss``, Megatron's
   own head code) forward + backward from ``[s, b, H]`` hidden states given as an input, stock and
   patched; the peak memory beyond the inputs per rank (``fusedce.tools.bench.harness.peak_memory``: peak
   RSS on CPU, with glibc's mmap threshold fixed at 64 KiB so that freed buffers leave the RSS:
   ``exact_rss``). Both include the weight shard's fp32 gradient (``V/TP x H``) and the hidden states'
   (``s x b x H``). Stock holds the ``[s, b, V/TP]`` fp32 logits and their softmax; patched one chunk of
   ``chunk x V/TP`` logits at a time (``--chunk-size``; default the op's rule, 64 rows on CPU). With
   ``--mtp D`` the head computes D + 1 losses (the main head's and each MTP depth's, from ``(D + 1) s``
   hidden rows); with ``--sequence-parallel`` each rank is given its ``s/TP`` rows and the head gathers them.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import fusedce
from fusedce.integrations.megatron.version import check_megatron
from fusedce.tools.bench import harness, machine


def cpu_stand_ins() -> None:
    """CPU stand-ins for the CUDA-only helpers megatron-core calls (CPU runs only; module docstring, 1.)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class Buffer:
        def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
            return torch.empty(shape, dtype=dtype)   # baddbmm reads it with beta = 0

    class Tracker:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

    stock_norm = WrappedTorchNorm.__new__

    def norm(cls, config, *args, **kwargs):
        config = copy.copy(config)
        config.sequence_parallel = False
        return stock_norm(cls, config, *args, **kwargs)

    parallel_state.get_global_memory_buffer = Buffer
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: Tracker()
    torch.cuda.current_device = lambda: "cpu"
    WrappedTorchNorm.__new__ = norm


def gpt(vocab: int, hidden: int, layers: int, seq: int, tied: bool, world: int, sp: bool = False, mtp: int = 0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig
    torch.manual_seed(0)   # CPU initialisation: the same full weights, split, on every rank
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=world * 2,
                            use_cpu_initialization=True, tensor_model_parallel_size=world,
                            attention_dropout=0.0, hidden_dropout=0.0, sequence_parallel=sp and world > 1,
                            mtp_num_layers=mtp or None)
    spec = get_gpt_layer_local_spec()
    mtp_spec = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False) if mtp else None
    return GPTModel(cfg, spec, vocab_size=vocab, max_sequence_length=seq,
                    share_embeddings_and_output_weights=tied, mtp_block_spec=mtp_spec)


def counting_batch(gen, batch: int, seq: int, vocab: int):
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    tokens = (start + torch.arange(seq + 1)) % vocab
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(seq).expand(batch, seq)
    mask = torch.ones(batch, 1, seq, seq, dtype=torch.bool).tril().logical_not()   # True = masked out
    return ids, pos, mask, labels


def train(args, world: int) -> dict:
    shape = (args.vocab, args.hidden, args.layers, args.seq, args.tied, world, args.sequence_parallel, args.mtp)
    stock, fused = gpt(*shape), fusedce.patch_megatron(gpt(*shape))
    optims = [torch.optim.AdamW(m.parameters(), lr=args.lr) for m in (stock, fused)]
    gen = torch.Generator().manual_seed(1)   # the same batches on every rank and for both models
    curves = {"stock": [], "fusedce": []}
    for _ in range(args.steps):
        ids, pos, mask, labels = counting_batch(gen, args.batch, args.seq, args.vocab)
        for name, model, opt in zip(curves, (stock, fused), optims):
            opt.zero_grad(set_to_none=True)
            loss = model(ids, pos, mask, labels=labels).mean()
            loss.backward()
            opt.step()
            curves[name].append(loss.item())
    return curves


def head_memory(args, world: int, device: str) -> dict:
    """Peak memory per rank of the head's forward + backward, stock and patched (module docstring, 3.)."""
    seq, batch = args.head_tokens // 2, 2
    model = gpt(args.head_vocab, args.head_hidden, 1, seq, False, world, args.sequence_parallel, args.mtp)
    gen = torch.Generator().manual_seed(2)
    rows = (1 + args.mtp) * seq // (world if args.sequence_parallel else 1)   # this rank's hidden rows
    hidden = torch.randn(rows, batch, args.head_hidden, generator=gen).requires_grad_()
    labels = torch.randint(0, args.head_vocab, (batch, seq), generator=gen)

    def clear():   # outside the measurement: the last run's gradients are freed before it starts
        model.zero_grad(set_to_none=True)
        hidden.grad = None

    def step():
        loss = model._postprocess(hidden_states=hidden, input_ids=None, position_ids=None, labels=labels,
                                  rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None)
        loss.sum().backward()

    out = {}
    for name in ("stock", "fusedce"):
        if name == "fusedce":
            options = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
            fusedce.patch_megatron(model, **options)
        step()   # warm-up: first-call set-up outside the measurement
        clear()
        out[name], method = harness.peak_memory(step, device)
        clear()
    out["method"] = method
    return out


def exact_rss() -> None:
    """glibc only: every allocation of 64 KiB or more straight from mmap and back to the system when freed
    (a fixed ``M_MMAP_THRESHOLD``; by default glibc raises it up to 32 MiB after large frees, so a later
    run's buffers come from pages an earlier run freed and the peak RSS would not see them)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)   # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def report(args, world: int, curves: dict, per_rank: list) -> None:
    """Rank 0: the curves and the head's memory printed, and results/megatron_tp.json."""
    diff = max(abs(a - b) for a, b in zip(curves["stock"], curves["fusedce"]))
    for step, (a, b) in enumerate(zip(curves["stock"], curves["fusedce"])):
        print(f"step {step:3d}  loss stock {a:.6f}  fusedce {b:.6f}")
    print(f"TP = {world}: largest |loss difference| over {args.steps} steps {diff:.2e}")
    if per_rank[0] is None:
        print("head measurement skipped: it calls megatron-core 0.16 / 0.17's _postprocess directly")
    else:
        print(f"head + loss at V = {args.head_vocab}, H = {args.head_hidden}, {args.head_tokens} tokens, "
              f"sequence parallel {args.sequence_parallel}, MTP depths {args.mtp} ({per_rank[0]['method']}):")
        for r, mem in enumerate(per_rank):
            print(f"  rank {r}: stock {mem['stock'] / 2**20:.1f} MiB, fusedce {mem['fusedce'] / 2**20:.1f} MiB "
                  f"({mem['stock'] / max(mem['fusedce'], 1):.1f}x less)")
    Path("results").mkdir(exist_ok=True)
    Path("results/megatron_tp.json").write_text(json.dumps(
        {"machine": machine.describe("cpu"), "args": vars(args), "world": world, "curves": curves,
         "max_loss_difference": diff, "head_memory_bytes_per_rank": per_rank}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--head-vocab", type=int, default=32000)
    parser.add_argument("--head-hidden", type=int, default=256)
    parser.add_argument("--head-tokens", type=int, default=2048)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--sequence-parallel", action="store_true", help="sequence_parallel=True (TP > 1)")
    parser.add_argument("--mtp", type=int, default=0, help="multi-token-prediction depths (0: none)")
    args = parser.parse_args()

    exact_rss()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from megatron.core import parallel_state
    cpu_stand_ins()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)

    curves = train(args, world)
    hooked = check_megatron().output_processor   # 0.18+: patched through forward's hook, not _postprocess
    memory = None if hooked else head_memory(args, world, "cpu")
    per_rank = [None] * world
    dist.all_gather_object(per_rank, memory)
    if rank == 0:
        report(args, world, curves, per_rank)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
