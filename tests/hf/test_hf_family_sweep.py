"""patch_causal_lm on every text causal LM class of the installed transformers (``hf_sweep``: each built
tiny from its config's defaults, CPU, fp32, no downloads): patched = stock (loss and every gradient),
refused with a message naming the family, or not buildable (why). One fixture runs all of them (339
classes in transformers 5.25: 175 patched = stock, 30 refused; 500 s on 2 cores shared with other jobs at
load 9, about 200 s before the MoE and hybrid families became buildable: each model is one layer of hidden
32, a hybrid one layer of each kind); the counts, the slowest classes and the refusal reasons are printed
(``pytest -s``) and the patched = stock and refused lists are also part of the assertion messages.

With ``output_router_logits=True`` wherever a config has it, every MoE family adds its router loss; the
named MoE families (text-only and multimodal) must add it as stock. A representative subset also runs compiled
before its first call (``hf_sweep.run(compile_first=True)``).

Named families whose forward transforms the head with numbers the patch finds in their config, not by
the attribute's name (``hf_fit``), must be patched = stock where this transformers has them (the lent GPU
image's 5.17 lacks some): HyperCLOVA X and its vision model (``logits * logits_scaling``), Granite (``logits /
logits_scaling``), Muse Glimmer and Muse Spark (``softcap * tanh(logits * output_multiplier / softcap)``),
Aya Vision (``logits * text_config.logit_scale`` from transformers 5.25; before, its forward ignored it).
"""
from __future__ import annotations

import collections
import time

import pytest

transformers = pytest.importorskip("transformers")

import hf_sweep  # noqa: E402
from fusedce.integrations.hf.patch import patch_causal_lm  # noqa: E402
from versions import transformers_at_least  # noqa: E402

# MoE families whose forward adds its router loss (output_router_logits=True in the sweep, coefficients set to
# visible values): the patched loss must add the same ``coefficient * aux_loss``. The multimodal wrappers keep
# the coefficient in ``config.text_config`` (Qwen3-VL-MoE, Qwen3.5-MoE, GLM-4V-MoE, MiniMax-M3), JetMoE under
# its own name (``aux_loss_coef``).
MOE_MUST_MATCH = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "JetMoeForCausalLM", "Qwen3_5MoeForCausalLM",
                  "Qwen3VLMoeForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                  "Glm4vMoeForConditionalGeneration", "MiniMaxM3SparseForConditionalGeneration")
# Compiled before the first call (``torch.compile``, as ``Trainer(torch_compile=True)``): the first labelled
# call checks the transform outside the graph; a representative subset (tracing costs seconds per family):
# a transform read off the forward (HyperCLOVA X multiplies; MiniCPM3 scales the hidden states, not the
# logits), a declared one (Granite divides), a MoE router loss.
COMPILED_FIRST = ("HyperCLOVAXForCausalLM", "MiniCPM3ForCausalLM", "GraniteForCausalLM", "MixtralForCausalLM")
MUST_MATCH = ("HyperCLOVAXForCausalLM", "HyperCLOVAXVisionV2ForConditionalGeneration", "GraniteForCausalLM",
              "MuseGlimmerForConditionalGeneration", "MuseSparkForConditionalGeneration",
              "AyaVisionForConditionalGeneration")
FAILING = ("differs", "crashed")


@pytest.fixture(scope="module")
def sweep():
    start = time.perf_counter()
    names = sorted(set(hf_sweep.classes(transformers)) | set(MUST_MATCH) | set(MOE_MUST_MATCH))
    results = {name: hf_sweep.run(transformers, name, patch_causal_lm) for name in names}
    seconds = time.perf_counter() - start
    counts = collections.Counter(outcome for outcome, _, _ in results.values())
    print(f"\ntransformers {transformers.__version__}: {len(results)} classes in {seconds:.1f} s: {dict(counts)}")
    slowest = sorted(results.items(), key=lambda item: -item[1][2])[:8]
    print("  slowest: " + ", ".join(f"{name} {r[2]:.1f} s" for name, r in slowest))
    for outcome in ("refused", "not buildable", *FAILING):
        for name, (got, detail, _) in results.items():
            if got == outcome:
                print(f"  {outcome}: {name}: {detail[:240]}")
    return results


def test_every_family_patched_as_stock_or_refused(sweep):
    """No family is patched into a different loss or gradient, or crashes where the stock forward runs."""
    bad = {name: r[:2] for name, r in sweep.items() if r[0] in FAILING}
    assert not bad, f"patched != stock: {bad}"
    assert sum(r[0] == "patched = stock" for r in sweep.values()) > 0


def test_refusals_name_the_family(sweep):
    refused = {name: detail for name, (outcome, detail, _) in sweep.items() if outcome == "refused"}
    unnamed = {name: detail for name, detail in refused.items() if name not in detail}
    assert not unnamed, f"refusals that do not name the family: {unnamed}"


@pytest.mark.parametrize("name", MUST_MATCH)
def test_transforming_families_patched_as_stock(sweep, name):
    outcome, detail, _ = sweep[name]
    if outcome == "absent":
        pytest.skip(detail)
    assert outcome == "patched = stock", f"{name}: {outcome}: {detail}"


@pytest.mark.parametrize("name", MOE_MUST_MATCH)
def test_moe_families_add_the_router_loss_as_stock(sweep, name):
    outcome, detail, _ = sweep[name]
    if outcome == "absent":
        pytest.skip(detail)
    assert outcome == "patched = stock", f"{name}: {outcome}: {detail}"
    if transformers_at_least(5, 24):   # 5.17's forwards of these families return no router loss at all
        assert "aux_loss" in detail, f"{name}: the stock forward returned no aux_loss: the case tests nothing"


@pytest.mark.parametrize("name", COMPILED_FIRST)
def test_compiled_first_patched_as_stock(name):
    """Both calls of a model compiled before its first call (the verifying one, then the traced one) train
    the stock loss and gradients."""
    outcome, detail, _ = hf_sweep.run(transformers, name, patch_causal_lm, compile_first=True)
    if outcome == "absent":
        pytest.skip(detail)
    assert outcome == "patched = stock", f"{name}: {outcome}: {detail}"
