"""The tensors a bench path consumes, built from a JSON-able source description."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

IGNORE_INDEX = -100
SEQ_LEN = 256
PROMPT_FRACTION = 0.3
SYNTHETIC_LOGIT_STD = 2.0


def sft_labels(input_ids: torch.Tensor, prompt_fraction: float = PROMPT_FRACTION) -> torch.Tensor:
    """``labels`` as passed to a Hugging Face causal LM: ``input_ids`` (n, T) with the prompt (the first
    ``round(prompt_fraction * T)`` positions of each sequence) set to ``IGNORE_INDEX``."""
    labels = input_ids.clone()
    labels[:, : round(prompt_fraction * input_ids.shape[1])] = IGNORE_INDEX
    return labels


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """(n, T) labels -> (n * T,) targets, shifted the Hugging Face way: position j predicts token j + 1,
    the last position of each sequence predicts nothing (``IGNORE_INDEX``)."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1).reshape(-1)


def sft_target(input_ids: torch.Tensor, prompt_fraction: float = PROMPT_FRACTION) -> torch.Tensor:
    """(n, T) token ids -> (n * T,) SFT targets: ``shift_labels(sft_labels(input_ids))``."""
    return shift_labels(sft_labels(input_ids, prompt_fraction))


@dataclass
class Inputs:
    """What a path's forward receives. Fields an op does not need stay None."""

    target: torch.Tensor
    logits: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None

    def tensors(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def row_slice(n_rows: int, rows: Optional[int]) -> Optional[torch.Tensor]:
    """``rows`` row indices spread evenly over ``n_rows`` (so prompt, answer and last positions all
    appear), or None for all rows."""
    if rows is None or rows >= n_rows:
        return None
    return torch.linspace(0, n_rows - 1, rows).round().long().unique()


def _synthetic(source: dict, needs: tuple) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(int(source.get("seed", 0)))
    n_rows, hidden_size, vocab = int(source["tokens"]), int(source["hidden"]), int(source["vocab"])
    seq_len = min(SEQ_LEN, n_rows)
    n_seq = -(-n_rows // seq_len)
    ids = torch.randint(0, vocab, (n_seq, seq_len), generator=gen)
    data = {"target": sft_target(ids)[:n_rows]}
    if "logits" in needs:
        data["logits"] = torch.randn(n_rows, vocab, generator=gen).mul_(SYNTHETIC_LOGIT_STD)
    if "hidden" in needs or "weight" in needs:
        data["hidden"] = torch.randn(n_rows, hidden_size, generator=gen)
        data["weight"] = torch.randn(vocab, hidden_size, generator=gen).mul_(
            SYNTHETIC_LOGIT_STD / hidden_size ** 0.5)
    return data


def _random(source: dict, needs: tuple, device: str) -> dict:
    dev = torch.device(device if source.get("draw", "cpu") == "device" else "cpu")
    gen = torch.Generator(device=dev).manual_seed(int(source.get("seed", 0)))
    n_rows, vocab = int(source["tokens"]), int(source["vocab"])
    direct_logits = source.get("logit_std") is not None
    data = {}
    if not direct_logits or "hidden" in needs or "weight" in needs:
        hidden_size = int(source["hidden"])
        data["hidden"] = torch.randn(n_rows, hidden_size, generator=gen, device=dev)
        data["weight"] = torch.randn(vocab, hidden_size, generator=gen, device=dev).mul_(
            float(source["weight_std"]))
    target = torch.randint(0, vocab, (n_rows,), generator=gen, device=dev)
    n_ignored = round(float(source.get("ignore_fraction", 0.0)) * n_rows)
    target[torch.randperm(n_rows, generator=gen, device=dev)[:n_ignored]] = IGNORE_INDEX
    data["target"] = target
    if direct_logits and "logits" in needs:
        data["logits"] = torch.randn(n_rows, vocab, generator=gen, device=dev).mul_(float(source["logit_std"]))
    return data


def build(source: dict, needs: tuple, dtype: torch.dtype, device: str,
          rows: Optional[int] = None) -> Inputs:
    """Build the ``needs`` fields (names of ``Inputs`` fields) for ``source`` on ``device`` in ``dtype``."""
    dev = torch.device(device)
    if source["kind"] == "real":
        data = torch.load(source["file"], map_location="cpu", weights_only=True)
    elif source["kind"] == "synthetic":
        data = _synthetic(source, needs)
    elif source["kind"] == "random":
        data = _random(source, needs, device)
    else:
        raise ValueError(f"unknown input source {source['kind']!r}")
    keep = row_slice(data["target"].shape[0], rows)
    if keep is not None:
        data = {k: (v[keep] if k in ("target", "hidden", "logits") else v) for k, v in data.items()
                if isinstance(v, torch.Tensor)}
    out = Inputs(target=data["target"].to(dev))
    if "logits" in needs:
        logits = data.get("logits")
        if logits is None:  # real input: the model's own LM head, fp32 matmul
            logits = data["hidden"].to(dev) @ data["weight"].to(dev).T
        out.logits = logits.to(device=dev, dtype=dtype).requires_grad_(True)
    for name in ("hidden", "weight"):
        if name in needs:
            setattr(out, name, data[name].to(device=dev, dtype=dtype).requires_grad_(True))
    return out
