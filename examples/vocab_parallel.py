"""Vocab-parallel cross-entropy and RL log-probs with fusedce: each rank holds a slice of the LM head's
vocabulary.

On CPU (gloo), two processes:

    torchrun --nproc-per-node 2 examples/vocab_parallel.py

On GPUs (NCCL), one process per GPU, e.g. 8 GPUs of one node:

    torchrun --nproc-per-node 8 examples/vocab_parallel.py --backend nccl --tokens 8192 --vocab 128256

With NCCL every rank puts its tensors on ``cuda:LOCAL_RANK`` (NCCL moves only device memory) and the
single-process comparison runs the Triton path (``backend="auto"``). The collectives are the same on
both backends: per forward one ``all_reduce(MAX)`` of BT int64 and one ``all_reduce(SUM)`` of BT x 3..5
fp32 (never the logits), no collective in the cross-entropy backward, and one ``all_reduce(SUM)`` of the
BT x H hidden gradient in the linear backward. The RL log-probs / entropy exchange the same statistics
(one fp32 column more for the entropy).

Every rank builds the same full problem from a fixed seed (a stand-in for a model whose LM head is
split by vocabulary rows), keeps its own, uneven, slice of the vocabulary, and rank 0 prints the
vocab-parallel losses next to the single-process ones.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import fusedce
from fusedce.distributed import (vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy,
                                 vocab_parallel_linear_token_log_probs)


def my_slice(vocab: int, rank: int, world: int) -> slice:
    """Uneven split on purpose: the first ``vocab % world`` ranks get one class more."""
    base, extra = divmod(vocab, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1003)
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)

    # The same full problem on every rank (fixed seed); about 1 in 5 tokens ignored (SFT-style masking).
    gen = torch.Generator().manual_seed(0)
    bt, h, v = args.tokens, args.hidden, args.vocab
    hidden = torch.randn(bt, h, generator=gen).to(device)
    weight = (torch.randn(v, h, generator=gen) * h ** -0.5).to(device)
    target = torch.randint(0, v, (bt,), generator=gen)
    target[torch.rand(bt, generator=gen) < 0.2] = -100
    target = target.to(device)
    cols = my_slice(v, rank, world)
    opts = dict(label_smoothing=0.1, lse_square_scale=1e-4)

    # 1. Logits already split by vocabulary (e.g. the output of a column-parallel LM head).
    logits = hidden @ weight.T
    logits_shard = logits[:, cols].clone().requires_grad_()
    loss_ce = vocab_parallel_cross_entropy(logits_shard, target, **opts)
    loss_ce.backward()
    full = logits.clone().requires_grad_()
    single_ce = fusedce.cross_entropy(full, target, **opts)
    single_ce.backward()
    grad_err_ce = (logits_shard.grad - full.grad[:, cols]).abs().max()

    # 2. Fused LM head + loss: each rank multiplies by its rows of the weight only.
    hid = hidden.clone().requires_grad_()
    w_shard = weight[cols].clone().requires_grad_()
    loss_lin = vocab_parallel_linear_cross_entropy(hid, w_shard, target, **opts)
    loss_lin.backward()
    hid_1, w_1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    single_lin = fusedce.linear_cross_entropy(hid_1, w_1, target, **opts)
    single_lin.backward()
    grad_err_h = (hid.grad - hid_1.grad).abs().max()
    grad_err_w = (w_shard.grad - w_1.grad[cols]).abs().max()

    # 3. RL: per-token log-probs and entropy at a temperature (a GRPO-style objective with an entropy bonus).
    adv = torch.randn(bt, generator=gen).to(device)
    hid_rl, w_rl = hidden.clone().requires_grad_(), weight[cols].clone().requires_grad_()
    rl = vocab_parallel_linear_token_log_probs(hid_rl, w_rl, target, temperature=0.7, return_entropy=True)
    (-(adv * rl.log_probs).sum() - 0.01 * rl.entropy.sum()).backward()
    hid_2, w_2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    single_rl = fusedce.linear_token_log_probs(hid_2, w_2, target, temperature=0.7, return_entropy=True)
    (-(adv * single_rl.log_probs).sum() - 0.01 * single_rl.entropy.sum()).backward()
    rl_errs = [(rl.log_probs - single_rl.log_probs).abs().max(), (rl.entropy - single_rl.entropy).abs().max(),
               (hid_rl.grad - hid_2.grad).abs().max(), (w_rl.grad - w_2.grad[cols]).abs().max()]

    errs = torch.stack([grad_err_ce, grad_err_h, grad_err_w, *rl_errs]).float()
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)  # worst slice over the ranks
    sizes = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor(cols.stop - cols.start, device=device))
    if rank == 0:
        print(f"{world} ranks ({args.backend}), vocabulary slices {[int(s) for s in sizes]} of V = {v}, "
              f"BT = {bt}, H = {h}, options {opts}")
        print(f"cross_entropy        vocab-parallel {loss_ce.item():.7f}   single-process "
              f"{single_ce.item():.7f}   |diff| {abs(loss_ce.item() - single_ce.item()):.2e}   "
              f"max |grad diff| {errs[0].item():.2e}")
        print(f"linear_cross_entropy vocab-parallel {loss_lin.item():.7f}   single-process "
              f"{single_lin.item():.7f}   |diff| {abs(loss_lin.item() - single_lin.item()):.2e}   "
              f"max |grad diff| hidden {errs[1].item():.2e}, weight {errs[2].item():.2e}")
        print(f"linear_token_log_probs (T = 0.7) vs single-process: max |diff| log-probs {errs[3].item():.2e}, "
              f"entropy {errs[4].item():.2e}; max |grad diff| hidden {errs[5].item():.2e}, weight "
              f"{errs[6].item():.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
