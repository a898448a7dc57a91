"""The family's post-head transform read off its forward, when the config attributes ``hf_head.DECLARED``
names do not describe it (docs/internals.md)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from fusedce.integrations.hf.settings import text_configs
from fusedce.integrations.hf.head import LogitTransform, describe, mismatch, verify_rtol, width_mismatch

# Columns each candidate is first checked on (all of them for the survivors), and the grid on which two
# matching candidates must agree (the probe's range, ``hf_call.probe_row``).
_SUBSET, _GRID = 256, torch.linspace(-24.0, 24.0, 97, dtype=torch.float64)


# Numbers of a config that are a row of the vocabulary or a count, never a multiplier (a token id or a
# key-value head count of 2 would otherwise explain a forward's undeclared ``logits * 2``).
_NOT_SCALES = ("_id", "_ids", "_index", "_idx", "_size", "_dim", "_layers", "_heads", "_experts", "_tokens",
               "_length", "_embeddings", "_positions", "_window", "_groups")
_COUNTS = ("num_", "n_", "max_")


def config_scalars(config) -> list:
    """``(name, value)`` of every finite non-zero int or float attribute of ``config`` and of its text
    config (``hf_settings.text_config``, named ``text_config.<attr>``), in attribute order, text config first;
    token ids, sizes and counts left out (``_NOT_SCALES``, ``_COUNTS``)."""
    found = []
    configs = text_configs(config)
    for prefix, source in zip(("text_config.", "") if len(configs) == 2 else ("",), configs):
        for name, value in vars(source).items():
            if name.endswith(_NOT_SCALES) or name.startswith(_COUNTS):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value:
                found.append((prefix + name, float(value)))
    return found


def _candidates(scalars: list) -> list:
    """``(scale, softcap, description)`` from the simplest to the most complex."""
    scales = [(1.0, None)] + [(v, f"* {n}") for n, v in scalars] + [(1.0 / v, f"/ {n}") for n, v in scalars]
    caps = [(None, None)] + [(v, n) for n, v in scalars if v > 0]
    ordered = []
    for with_cap in (False, True):
        for scale, said in scales:
            for cap, cap_name in caps:
                if (cap is not None) == with_cap:
                    x = "x" if said is None else f"x {said}"
                    ordered.append((scale, cap, x if cap is None else f"{cap_name} * tanh(({x}) / {cap_name})"))
    return ordered


def _apply(x: torch.Tensor, scale: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """``(K, N)``: candidate k's transform of ``x`` (N,); ``cap`` inf for none (float64)."""
    z = scale[:, None] * x[None, :]
    capped = cap[:, None] * torch.tanh(z / cap[:, None])
    return torch.where(torch.isinf(cap)[:, None], z, capped)


def _close(got: torch.Tensor, expected: torch.Tensor, rtol: float) -> torch.Tensor:
    """Per row of ``got`` (K, N) against ``expected`` (N,): ``hf_head``'s rule (rtol of each value plus
    rtol of the largest)."""
    atol = rtol * float(expected.abs().max())
    return ((got - expected).abs() <= atol + rtol * expected.abs()).all(dim=-1)


def fit_transform(logits_row: torch.Tensor, head_row: torch.Tensor, config, n_classes: Optional[int],
                  probe: bool):
    """``(LogitTransform, description, settled)`` for the simplest candidate mapping ``head_row`` to
    ``logits_row``, or ``(None, why, False)``."""
    rtol = verify_rtol(logits_row.dtype)
    y = logits_row.detach().double().cpu()
    x = head_row.detach().double().cpu()
    cands = _candidates(config_scalars(config))
    scale = torch.tensor([c[0] for c in cands], dtype=torch.float64)
    cap = torch.tensor([math.inf if c[1] is None else c[1] for c in cands], dtype=torch.float64)
    pick = torch.unique(torch.cat([torch.linspace(0, y.numel() - 1, min(_SUBSET, y.numel())).long(),
                                   x.argmax()[None], x.argmin()[None], y.abs().argmax()[None]]))
    near = torch.nonzero(_close(_apply(x[pick], scale, cap), y[pick], rtol)).flatten()
    if near.numel():
        near = near[_close(_apply(x, scale[near], cap[near]), y, rtol)]
    if not near.numel():
        return None, _seen(x, y), False
    first = int(near[0])
    grid = _apply(_GRID, scale[near], cap[near])
    settled = probe or bool(_close(grid, grid[0], 4 * rtol).all())
    found = LogitTransform(scale=cands[first][0], softcap=cands[first][1], n_classes=n_classes)
    return found, cands[first][2], settled


def _seen(x: torch.Tensor, y: torch.Tensor) -> str:
    """What the family does to the head's output ``x``, in words: the least-squares line ``y = a x + c``
    and how far the logits are from it."""
    design = torch.stack([x, torch.ones_like(x)], dim=-1)
    a, c = torch.linalg.lstsq(design, y[:, None]).solution.flatten().tolist()
    worst = float((design @ torch.tensor([a, c], dtype=torch.float64) - y).abs().max())
    span = float(y.abs().max()) or 1.0
    if worst > 1e-3 * span:
        kind = "a non-linear map that is not a softcap of a config number"
    elif abs(c) > 1e-4 * span:
        kind = "an offset added after the head (a bias the head does not hold)"
    else:
        kind = "a scale that is no number of its config (nor its inverse)"
    return (f"it maps the head's output x to about {a:.6g} * x + {c:.6g} (worst deviation {worst:.3g}): {kind}")


def logit_rows(logits, head_shape: torch.Size, rows: torch.Tensor, model_name: str, probe: bool):
    """The family's ``logits`` at the flat positions ``rows`` of the head's output (shape ``head_shape``):
    ``(len(rows), n)``, detached."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ValueError(f"{model_name}.forward does not return its LM head's output as `logits`: "
                         "patch_causal_lm cannot tell what it does to the logits")
    if tuple(logits.shape[:-1]) != tuple(head_shape[:-1]):
        what = ("it turned one probe row of its LM head's output into logits of shape "
                f"{tuple(logits.shape)}: what it does to its logits depends on the position") if probe else \
            (f"it turned its LM head's output of shape {tuple(head_shape)} into logits of shape "
             f"{tuple(logits.shape)}: not position by position")
        raise ValueError(f"{model_name}.forward transforms the LM head's output in a way that does not match "
                         f"any transform patch_causal_lm can reproduce ({what}); call the model unpatched")
    return logits.detach().reshape(-1, logits.shape[-1])[rows.to(logits.device)]


def choose_transform(logits, head_rows: torch.Tensor, rows: torch.Tensor, head_shape, transforms: tuple,
                     config, model_name: str, probe: bool):
    """What the family does to its head's output, from the first labelled call: ``(index, transform, settled)``,
    the first declared transform that matches, else the one read off the forward."""
    got = logit_rows(logits, head_shape, rows, model_name, probe)
    head_rows = head_rows.detach().to(got.device)
    reasons = []
    for index, transform in enumerate(transforms):
        reason = mismatch(got, head_rows, transform)
        if reason is None:
            return index, transform, True
        reasons.append(f"against {describe(transform)}: {reason}")
    widths = {head_rows.shape[-1]} | {t.width(head_rows.shape[-1]) for t in transforms}
    reason = width_mismatch(got, head_rows, widths)
    if reason is None:
        n_classes = None if got.shape[-1] == head_rows.shape[-1] else got.shape[-1]
        found, reason, settled = fit_transform(got.flatten(), head_rows[:, :got.shape[-1]].flatten(), config,
                                               n_classes, probe)
        if found is not None:
            return None, found, settled
    raise ValueError(
        f"{model_name}.forward transforms the LM head's output in a way that does not match what its config "
        f"declares (read from the config and its text config; {'; '.join(reasons)}) nor a logit scale and "
        f"softcap made of its config's numbers ({reason}). patch_causal_lm would train a different loss, so it "
        "refuses; call the model unpatched")
