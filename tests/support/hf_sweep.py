"""Every text causal LM class of the installed transformers, built tiny from its config's defaults, run
stock and patched (``tests/hf/test_hf_family_sweep.py``).

Which classes: every ``*ForCausalLM``, ``*LMHeadModel`` and ``*ForConditionalGeneration`` that transformers
exports whose forward takes ``input_ids`` and ``labels`` (the text-capable ones; speech and image-only
generation models take neither and are left out, counted as not text).

How tiny: the config class's defaults with every size ``SHRINK`` names replaced where the config (or any
of its sub-configs: text, vision, audio, ...) has it: hidden 32, one layer (encoder and decoder), 4 heads
of 8, 2 key-value heads, 4 experts of which 2 are routed, vocabulary 128; per-layer lists cut to one
layer; a hybrid stack (``layer_types`` of several kinds) keeps one layer of each kind; latent attention
(``kv_lora_rank``) as many key-value heads as heads; a multimodal rotary embedding's sections rescaled to the
shrunk head. MoE: ``output_router_logits=True`` wherever a config has it and the router-loss coefficients
visible (``ROUTER``, ``COEFFICIENTS``), so every MoE family adds its router loss. A family whose config
rejects that, whose model cannot be made from it, that has more than ``MAX_PARAMS`` parameters after it (a
size no attribute here names), or whose stock forward fails on a text-only batch is "not buildable", with
the exception's first line as the reason.

Each case: 2 sequences of ``SEQ`` tokens drawn away from every token id the config names, labels with the
first 3 positions -100; the same seed before the stock and the patched forward (a family that draws
random numbers in eval mode draws the same ones). Outcomes: ``"patched = stock"`` (loss and every
parameter gradient within ``tolerances``' ``HF_RTOL`` of each value plus ``HF_ATOL_SCALE`` of the LARGEST
gradient of the model: the two losses' hidden-state gradients differ by a few ulps of their own scale,
and that absolute error reaches every parameter, including those whose true gradient is zero and whose
stock one is rounding noise, e.g. attention key biases (1e-12 against 0.5) or DeepSeek-V4's ``hc_head``
(1e-5)),
``"refused"`` (patch_causal_lm or the patched forward raised a TypeError / ValueError from fusedce's own
code),
``"not buildable"``, ``"not text"``, ``"absent"`` (a class named by the test that this transformers lacks);
anything else is the test's failure: ``"differs"`` (with the first differing tensor) or ``"crashed"``
(the patched forward failed where the stock one did not, outside fusedce's refusals).
"""
from __future__ import annotations

import copy
import inspect
import time
import traceback

import torch

from hf_models import loss_and_grads
from tolerances import HF_ATOL_SCALE, HF_RTOL

SEQ, VOCAB, MAX_PARAMS = 8, 128, 2_000_000
SHRINK = dict(
    hidden_size=32, n_embd=32, d_model=32, embed_dim=32, intermediate_size=64, n_inner=64, ffn_dim=64, d_ff=64,
    encoder_ffn_dim=64, decoder_ffn_dim=64, num_hidden_layers=1, n_layer=1, num_layers=1, n_layers=1,
    encoder_layers=1, decoder_layers=1, num_decoder_layers=1, num_attention_heads=4, n_head=4, n_heads=4,
    encoder_attention_heads=4, decoder_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=64,
    n_positions=64, max_window_layers=1, first_k_dense_replace=0, out_hidden_size=32, projector_hidden_size=32,
    moe_hidden_size=16, text_hidden_size=32, vision_hidden_size=32, projection_dim=32, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16, moe_layer_start_index=0, n_group=1,
    topk_group=1, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=8, mamba_chunk_size=16, mamba_num_heads=4,
    mamba_head_dim=8, ssm_state_size=8, n_groups=1)
# Lists of layers that do NOT route (dense MLPs only): emptied, so the one layer kept is a MoE layer.
MOE_LAYER_LISTS = ("mlp_only_layers",)
# The logit transforms' numbers, set away from the identity where a config has them (a default of 1, or a
# softcap of 30 on O(1) logits, would hide a transform the patch got wrong): test-side only, the patch
# knows none of these names but through the forward's output.
VISIBLE = dict(logits_scaling=4.0, logit_scale=0.25, output_multiplier=0.3, lm_head_multiplier=0.3,
               final_logit_softcapping=2.0)
# MoE: router logits on wherever a config has the switch, so every MoE family returns its load-balancing
# ``aux_loss`` and adds it to the stock loss; its coefficient, under each name a family keeps it, set to a
# visible value, a different one in sub-configs (a wrapper's text config) than at the top level, so that the
# patch reading the wrong level shows (test-side only: the patch finds the coefficient the family uses).
ROUTER = dict(output_router_logits=True)
COEFFICIENTS = dict(router_aux_loss_coef=(0.5, 0.75), aux_loss_coef=(0.5, 0.75), moe_loss_weight=(0.5, 0.75))
_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def classes(transformers) -> list:
    """The names of the model classes swept, sorted (the ``PreTrainedModel`` ones: not the Auto classes)."""
    return sorted(n for n in dir(transformers) if n.endswith(_SUFFIXES) and not n.startswith(("TF", "Auto"))
                  and isinstance(getattr(transformers, n, None), type)
                  and issubclass(getattr(transformers, n), transformers.PreTrainedModel))


def _config_class(model_cls):
    return getattr(model_cls, "config_class", None)


def _shrunk(config, depth: int = 0) -> dict:
    """``config``'s ``to_dict()`` with ``SHRINK``, ``VISIBLE``, ``ROUTER`` and ``COEFFICIENTS`` applied, to it
    and every sub-config, recursively."""
    values = config.to_dict()
    before = values.get("num_hidden_layers")
    for name, value in list(values.items()):
        sub = getattr(config, name, None)
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            values[name] = _shrunk(sub, depth + 1)
        elif name in ROUTER and isinstance(value, bool):
            values[name] = ROUTER[name]
        elif name in COEFFICIENTS and isinstance(value, (int, float)) and not isinstance(value, bool):
            values[name] = COEFFICIENTS[name][min(depth, 1)]
        elif name in SHRINK and isinstance(value, int) and not isinstance(value, bool):
            values[name] = SHRINK[name]
        elif name in VISIBLE and isinstance(value, (int, float)) and not isinstance(value, bool):
            values[name] = VISIBLE[name]
        elif name in ("pad_token_id", "padding_idx") and isinstance(value, int) and value >= VOCAB:
            values[name] = 0   # an embedding's padding row must be inside the shrunk vocabulary
    layers = values.get("num_hidden_layers")
    kinds = values.get("layer_types")
    keep = list(range(layers or 0))
    if layers and isinstance(kinds, list) and len(kinds) == before and len(set(map(str, kinds))) > 1:
        # a hybrid stack (linear and full attention, Mamba and attention, ...): one layer of each kind, in the
        # stack's order (the first layer alone may have no attention layer for the masks, or no MoE router)
        keep = sorted({str(kind): i for i, kind in reversed(list(enumerate(kinds)))}.values())
        values["num_hidden_layers"] = layers = len(keep)
    for name, value in list(values.items()):   # per-layer lists: the kept layers' entries
        if isinstance(value, list) and layers and len(value) == before:
            values[name] = [value[i] for i in keep]
        elif isinstance(value, list) and layers and name.endswith("layer_types"):
            values[name] = value[:layers]
        elif name in MOE_LAYER_LISTS and isinstance(value, list):
            values[name] = []
    if "kv_lora_rank" in values and values.get("num_attention_heads"):   # latent attention: as many kv heads
        values["num_key_value_heads"] = values["num_attention_heads"]
    rope = values.get("rope_parameters")
    multimodal_rope = "mrope_section" in getattr(type(config), "ignore_keys_at_rope_validation", ())
    if isinstance(rope, dict) and (isinstance(rope.get("mrope_section"), list) or multimodal_rope):
        values["rope_parameters"] = {**rope, "mrope_section": _mrope(rope, values)}
    return values


def _mrope(rope: dict, values: dict) -> list:
    """A multimodal rotary embedding's sections (temporal, height, width) rescaled to the shrunk rotary width:
    half the rotated part of a head (``head_dim * partial_rotary_factor / 2``)."""
    sections = rope.get("mrope_section") or [8, 12, 12]   # GLM-4V's default when the config names none
    head = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    half = int(head * rope.get("partial_rotary_factor", values.get("partial_rotary_factor") or 1.0)) // 2
    scaled = [round(s * half / sum(sections)) for s in sections]
    return [scaled[0] + half - sum(scaled)] + scaled[1:]


def _token_ids(config, found=None) -> set:
    found = set() if found is None else found
    for name, value in vars(config).items():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _token_ids(value, found)
        elif name.endswith(("_id", "_index")) and isinstance(value, int) and not isinstance(value, bool):
            found.add(value)
    return found


def _first_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()[0]
    return text[:160]


def build(transformers, name: str):
    """``(model, config)`` in eval mode, or ``(None, reason)``."""
    model_cls = getattr(transformers, name)
    params = inspect.signature(model_cls.forward).parameters
    if "input_ids" not in params or "labels" not in params:
        return None, "not text"
    config_cls = _config_class(model_cls)
    if config_cls is None:
        return None, "no config_class"
    try:
        config = config_cls.from_dict(_shrunk(config_cls()))
        with torch.device("meta"):
            n = sum(p.numel() for p in model_cls(config).parameters())
        if n > MAX_PARAMS:
            return None, f"over {MAX_PARAMS} parameters after shrinking ({n}): a size SHRINK does not name"
        torch.manual_seed(0)
        return model_cls(config).eval(), config
    except Exception as err:   # noqa: BLE001  (any reason is the family's "not buildable")
        return None, _first_line(err)


def batch(config, vocab: int):
    usable = [t for t in range(1, vocab) if t not in _token_ids(config)]
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor(usable)[torch.randint(0, len(usable), (2, SEQ), generator=generator)]
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


def _by_fusedce(err: BaseException) -> bool:
    """Raised by fusedce itself (its innermost frame is fusedce's), not by the family's code under the
    patched forward."""
    frames = traceback.extract_tb(err.__traceback__)
    return isinstance(err, (TypeError, ValueError)) and bool(frames) and "/fusedce/" in frames[-1].filename


def _compiled(model, graph_runs: list):
    """``model`` under ``torch.compile`` with a backend that runs each graph as traced (the patch's question
    is what dynamo traces, not how inductor lowers it) and appends to ``graph_runs`` each time a compiled graph
    runs; dynamo's caches reset first, so every family is traced afresh (its recompile limit is per code
    object, and the patched forward's is shared)."""
    torch._dynamo.reset()

    def backend(graph, inputs):
        def run(*args):
            graph_runs.append(graph)
            return graph.forward(*args)
        return run
    return torch.compile(model, backend=backend)


def run(transformers, name: str, patch, compile_first: bool = False) -> tuple:
    """``(outcome, detail, seconds)`` for the class ``name`` (see the module docstring). ``compile_first``: the
    patched model is compiled before its first call, and called twice (the first labelled call, which checks
    the family's logit transform, then one traced with what it found): both must be patched = stock, and the
    second must have run compiled graphs (``"not compiled"`` otherwise)."""
    start = time.perf_counter()
    if not hasattr(transformers, name):
        return "absent", f"transformers {transformers.__version__} has no {name}", 0.0
    stock, config = build(transformers, name)
    if stock is None:
        return ("not text" if config == "not text" else "not buildable"), config, time.perf_counter() - start
    head = stock.get_output_embeddings() if callable(getattr(stock, "get_output_embeddings", None)) else None
    vocab = getattr(head, "out_features", None) or VOCAB
    ids, labels = batch(config, min(vocab, VOCAB))
    try:
        torch.manual_seed(1)
        ref, ref_grads = loss_and_grads(stock, input_ids=ids, labels=labels)
    except Exception as err:   # noqa: BLE001
        return "not buildable", f"stock forward: {_first_line(err)}", time.perf_counter() - start
    graph_runs, results = [], []
    try:
        fused = patch(copy.deepcopy(stock))
        forward = _compiled(fused, graph_runs) if compile_first else fused
        for _call in range(2 if compile_first else 1):
            torch.manual_seed(1)
            before = len(graph_runs)
            fused.zero_grad(set_to_none=True)
            out = forward(input_ids=ids, labels=labels)
            out.loss.backward()
            grads = {n: p.grad.clone() for n, p in fused.named_parameters() if p.grad is not None}
            results.append((out, grads, len(graph_runs) > before))
    except Exception as err:   # noqa: BLE001
        outcome = "refused" if _by_fusedce(err) else "crashed"
        return outcome, f"{type(err).__name__}: {err}", time.perf_counter() - start
    finally:
        if compile_first:
            torch._dynamo.reset()
    for call, (out, grads, _traced) in enumerate(results):
        try:
            torch.testing.assert_close(out.loss, ref.loss, rtol=HF_RTOL, atol=0.0, msg="loss")
            assert grads.keys() == ref_grads.keys(), f"gradients of {sorted(set(grads) ^ set(ref_grads))}"
            largest = max((float(g.abs().max()) for g in ref_grads.values() if g.numel()), default=0.0)
            for key, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[key], rtol=HF_RTOL, atol=HF_ATOL_SCALE * largest + 1e-12,
                                           msg=key)
        except AssertionError as err:
            return "differs", f"call {call + 1}: {str(err).splitlines()[0][:300]}", time.perf_counter() - start
    if compile_first and not results[-1][2]:
        return "not compiled", "the second call ran no compiled graph", time.perf_counter() - start
    aux = getattr(ref, "aux_loss", None)
    detail = f"loss {float(ref.loss.detach()):.4f}" + ("" if aux is None else f" (aux_loss {float(aux.detach()):.4f})")
    return "patched = stock", detail, time.perf_counter() - start
