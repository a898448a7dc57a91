"""patch_causal_lm on every text causal LM class of the installed transformers (``hf_sweep``: each built
tiny from its config's defaults, CPU, fp32, no downloads): patched = stock (loss and every gradient),
refused with a message naming the family, or not buildable (why). One test loops over all of them (about
330 classes in transformers 5.24, 30-60 s on 2 cores: each model is one layer of hidden 32); the counts
and the refusal reasons are printed (``pytest -s``) and the patched = stock and refused lists are also
part of the assertion messages.

Named families whose forward transforms the head with numbers the patch finds in their config, not by
the attribute's name (``hf_fit``), must be patched = stock where this transformers has them (the lent GPU
image's 5.17 lacks some): HyperCLOVA X and its vision model (``logits * logits_scaling``), Granite (``logits /
logits_scaling``), Muse Glimmer and Muse Spark (``softcap * tanh(logits * output_multiplier / softcap)``).
"""
from __future__ import annotations

import collections
import time

import pytest

transformers = pytest.importorskip("transformers")

import hf_sweep  # noqa: E402
from fusedce.integrations.hf.patch import patch_causal_lm  # noqa: E402

MUST_MATCH = ("HyperCLOVAXForCausalLM", "HyperCLOVAXVisionV2ForConditionalGeneration", "GraniteForCausalLM",
              "MuseGlimmerForConditionalGeneration", "MuseSparkForConditionalGeneration")
FAILING = ("differs", "crashed")


@pytest.fixture(scope="module")
def sweep():
    start = time.perf_counter()
    names = sorted(set(hf_sweep.classes(transformers)) | set(MUST_MATCH))
    results = {name: hf_sweep.run(transformers, name, patch_causal_lm) for name in names}
    seconds = time.perf_counter() - start
    counts = collections.Counter(outcome for outcome, _, _ in results.values())
    print(f"\ntransformers {transformers.__version__}: {len(results)} classes in {seconds:.1f} s: {dict(counts)}")
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
