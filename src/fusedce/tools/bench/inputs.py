"""The tensors a bench path consumes, built from a JSON-able source description.

Sources (``source["kind"]``):

- ``"real"``: a cache file written by ``real_input.py`` with ``hidden`` (BT, H) fp32, ``weight`` (V, H)
  fp32 (SmolLM2's LM head) and ``target`` (BT,) int64; logits are ``hidden @ weight.T`` in fp32, then
  cast to the bench dtype.
- ``"synthetic"``: seeded random data of a named shape. Logits are drawn directly, N(0, 2^2) (the
  spread of a trained LM's logits; no BT x H x V matmul, so large vocabularies stay cheap on CPU);
  ``hidden``/``weight`` are drawn so that ``hidden @ weight.T`` has the same spread.
- ``"random"`` (the memory sweep, ``sweep.py``; ``benchmarks/gpu_check.py``): seeded ``hidden`` ~ N(0, 1),
  ``weight`` ~ N(0, 1) * ``source["weight_std"]``, targets uniform in [0, V) with
  ``round(ignore_fraction * BT)`` positions, drawn at random, set to ``IGNORE_INDEX``. Logits, when
  asked for, are ``hidden @ weight.T`` in fp32, unless ``source["logit_std"]`` is given: then they are
  drawn directly, N(0, logit_std^2), and ``hidden`` / ``weight`` are drawn only when asked for (so
  ``"hidden"`` and ``"weight_std"`` may be left out). ``source["draw"] == "device"`` draws everything on
  the build device with a generator there (fast at GPU sizes, where a CPU draw of BT x V values takes
  longer than the measurement; the values differ from the CPU draw of the same seed); the default
  ``"cpu"`` draws on the CPU. Order of the draws: hidden and weight (when drawn), targets, the ignored
  positions, logits (when drawn directly): a build without logits gives the same targets as one with.

Targets of ``"real"`` and ``"synthetic"`` follow the SFT layout of ``sft_target``: sequences of
``SEQ_LEN`` tokens whose first ``PROMPT_FRACTION`` (the prompt) and last position (no next token) are
``IGNORE_INDEX``.
"""
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
    """What a path's forward receives. Fields an op does not need stay None.

    ``target`` (BT,) int64; ``logits`` (BT, V); ``hidden`` (BT, H); ``weight`` (V, H). Every tensor field
    but ``target`` that is built is a leaf with ``requires_grad=True``.
    """

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
    """Build the ``needs`` fields (names of ``Inputs`` fields) for ``source`` on ``device`` in ``dtype``.

    ``rows``: keep only that many rows (``row_slice``), e.g. for the Triton interpreter.
    """
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
