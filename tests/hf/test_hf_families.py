"""patch_causal_lm on families whose forward transforms the LM head's output (tiny random models of
transformers' own classes, CPU, fp32, no downloads): every transform the config or its text config
declares is reproduced, anything else is refused, with or without ``keep_logits``.

Families (transformers 5.24): FalconH1 (``logits * lm_head_multiplier``), PaliGemma 2 (a Gemma 2 text
config: ``text_config.final_logit_softcapping``), Gemma 4 conditional generation (the same, Gemma 4 text),
Granite 4 vision (``logits / text_config.logits_scaling``), Inkling (``logits[..., :unpadded_vocab_size]``
of a 128-row head), and LLaVA-NeXT around a Granite text config (Granite vision 3.x's layout: the
forward ignores ``text_config.logits_scaling``). Each is one decoder layer, hidden 32, vocabulary (head
rows) 128; the vision and audio towers are as small as their configs allow and are not run (text-only
batches). Softcap 2.0 and scales far from 1 make each transform visible on O(1) logits. Tolerances:
those of ``hf_models.py`` (fp32, summation order only).
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedce.integrations.hf.fit import fit_transform  # noqa: E402
from fusedce.integrations.hf.head import LogitTransform  # noqa: E402
from fusedce.integrations.hf.patch import patch_causal_lm  # noqa: E402
from hf_models import assert_close, assert_parity  # noqa: E402
from versions import transformers_at_least  # noqa: E402

V, H, SEQ, REAL = 128, 32, 10, 97   # REAL: Inkling's unpadded vocabulary (the head has V rows)
TEXT = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
GEMMA2 = dict(model_type="gemma2", query_pre_attn_scalar=8, sliding_window=8)
GEMMA4 = dict(vocab_size_per_layer_input=V, hidden_size_per_layer_input=8, layer_types=["full_attention"],
              per_layer_config={"0": {"head_dim": 8}})


def _falcon_h1():
    return transformers.FalconH1ForCausalLM(transformers.FalconH1Config(
        **TEXT, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
        mamba_chunk_size=16, lm_head_multiplier=0.3))


def _paligemma2():
    return transformers.PaliGemmaForConditionalGeneration(transformers.PaliGemmaConfig(
        text_config={**TEXT, **GEMMA2, "final_logit_softcapping": 2.0}, projection_dim=H, image_token_index=V - 1,
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8)))


def _gemma4():
    return transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config={**TEXT, **GEMMA4, "final_logit_softcapping": 2.0}, audio_config=None,
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=8, position_embedding_size=64, patch_size=4)))


def _granite4_vision():
    return transformers.Granite4VisionForConditionalGeneration(transformers.Granite4VisionConfig(
        text_config={**TEXT, "logits_scaling": 4.0}, image_token_index=V - 1, downsample_rate="1/2",
        vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8),
        qformer_config=dict(model_type="blip_2_qformer", num_hidden_layers=1, intermediate_size=32,
                            max_position_embeddings=16, use_qformer_text_input=False),
        deepstack_layer_map=[[0, 0]], spatial_target_layers=[0, 0, 0, 0]))


def _inkling():
    return transformers.InklingForCausalLM(transformers.InklingTextConfig(
        **TEXT, unpadded_vocab_size=REAL, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
        sliding_window_size=8, d_rel=4, rel_extent=16, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, logits_mup_width_multiplier=2.0))


FAMILIES = {"falcon_h1": _falcon_h1, "paligemma2": _paligemma2, "gemma4": _gemma4,
            "granite4_vision": _granite4_vision, "inkling": _inkling}


def _batch(n_classes=REAL):
    ids = torch.randint(1, n_classes, (2, SEQ))
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    torch.manual_seed(0)
    return request.param, FAMILIES[request.param]().eval()


@pytest.mark.parametrize("keep_logits", [None, True], ids=["default", "keep_logits"])
def test_declared_transform_reproduced(family, keep_logits):
    """Loss and every gradient as the stock model's, with and without ``keep_logits`` (which used to skip
    the transform check: FalconH1 4.566 vs 4.584, PaliGemma 2 35.9 vs 7.59); the kept logits are the
    stock ones."""
    name, stock = family
    fused = patch_causal_lm(copy.deepcopy(stock), keep_logits=keep_logits)
    ids, labels = _batch()
    out, ref = assert_parity(stock, fused, input_ids=ids, labels=labels)
    assert (out.logits is None) == (keep_logits is None)
    if keep_logits:
        assert_close(out.logits, ref.logits, "logits")


def test_inkling_trains_the_unpadded_classes_only():
    """Inkling's loss is over the first ``unpadded_vocab_size`` rows of its head: the padded rows get
    exactly zero gradient, as in the stock model; a label in the padding is an IndexError naming V."""
    fused = patch_causal_lm(_inkling().eval())
    ids, labels = _batch()
    fused(input_ids=ids, labels=labels).loss.backward()
    assert torch.count_nonzero(fused.lm_head.weight.grad[REAL:]) == 0
    assert torch.count_nonzero(fused.lm_head.weight.grad[:REAL]) > 0
    labels[1, 5] = REAL + 3
    with pytest.raises(IndexError, match=rf"labels\[1, 5\] = {REAL + 3} .*V = {REAL}\)"):
        fused(input_ids=ids, labels=labels)


def test_return_dict_false_keeps_the_stock_tuple_layout(family):
    """``return_dict=False``: the same tuple layout as the stock model (loss, logits, cache, ...), with
    None (or, with keep_logits, the logits) at index 1, never the cache there."""
    name, stock = family
    ids, labels = _batch()
    ref = stock(input_ids=ids, labels=labels, return_dict=False, use_cache=True)
    for keep in (None, True):
        got = patch_causal_lm(copy.deepcopy(stock), keep_logits=keep)(input_ids=ids, labels=labels,
                                                                       return_dict=False, use_cache=True)
        assert len(got) == len(ref)
        assert [type(x) for x in got[2:]] == [type(x) for x in ref[2:]]
        assert_close(got[0], ref[0], "loss")
        if keep:
            assert_close(got[1], ref[1], "logits")
        else:
            assert got[1] is None


class _Sliced(transformers.LlamaForCausalLM):
    """A family that keeps only part of its head's rows without declaring it in its config."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits[..., :REAL]
        return out


class _ScaledPerPosition(transformers.LlamaForCausalLM):
    """A family whose logit transform depends on the position."""

    def forward(self, input_ids, **kwargs):
        out = super().forward(input_ids, **kwargs)
        out.logits = out.logits * torch.linspace(0.5, 1.5, input_ids.shape[-1])[:, None]
        return out


class _Transformed(transformers.LlamaForCausalLM):
    """A family whose forward applies ``TRANSFORMS[config.transform]`` to its logits."""

    TRANSFORMS = {"offset": lambda z: z + 0.5, "unknown scale": lambda z: z * 0.37, "cube": lambda z: z ** 3}

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = self.TRANSFORMS[self.config.transform](out.logits)
        return out


def _llama_config(**extra):
    return transformers.LlamaConfig(**{**TEXT, **extra})


@pytest.mark.parametrize("keep_logits", [None, True], ids=["default", "keep_logits"])
@pytest.mark.parametrize("case,match", [
    ("undeclared slice", "128 columns into 97 logit columns"),
    ("per position", "does not match"),
    ("offset", "an offset added after the head"),
    ("unknown scale", r"0\.37 \* x .*a scale that is no number of its config"),
    ("cube", "a non-linear map"),
])
def test_unreproducible_transform_refused(case, match, keep_logits):
    """A vocabulary slice the config does not declare (invisible to a 2-column probe), a position-dependent
    transform, an offset (a bias the head does not hold), a scale that no number of the config gives, a
    non-linear map other than a softcap: refused at the first labelled call, keep_logits or not, with a
    message naming the family and what its forward does."""
    model = {"undeclared slice": lambda: _Sliced(_llama_config()),
             "per position": lambda: _ScaledPerPosition(_llama_config())}.get(
        case, lambda: _Transformed(_llama_config(transform=case)))()
    patch_causal_lm(model, keep_logits=keep_logits)
    ids, labels = _batch()
    if case == "per position" and not keep_logits:
        match = "depends on the position"
    with pytest.raises(ValueError, match=match) as err:
        model(input_ids=ids, labels=labels)
    assert type(model).__name__ in str(err.value)


@pytest.mark.parametrize("keep_logits", [None, True], ids=["default", "keep_logits"])
def test_declared_but_not_applied_follows_the_forward(keep_logits):
    """A config that declares a scale its forward does not apply (``logits_scaling`` in a Llama; MiniCPM3
    divides its hidden states, not its logits, by it): the patch follows the forward, whose logits are
    the head's output, and trains the stock loss (it refused before it read the transform off the
    forward)."""
    stock = transformers.LlamaForCausalLM(_llama_config(logits_scaling=4.0)).eval()
    fused = patch_causal_lm(copy.deepcopy(stock), keep_logits=keep_logits)
    ids, labels = _batch()
    for _ in range(2):   # the verifying call (its loss recomputed for the transform found), then another
        assert_parity(stock, fused, input_ids=ids, labels=labels)
    assert fused._fusedce_patch.verified and fused._fusedce_patch.transforms == (LogitTransform(),)


def test_real_logits_too_small_to_tell_a_softcap_leave_it_unsettled():
    """Read off a tiny model's O(1) real logits (``keep_logits``), ``x`` and ``128 * tanh(x / 128)`` agree
    within fp32 tolerance but not on the probe's range: the simplest (no softcap) is used for that call,
    unsettled (the next call looks again); the probe row, which spans that range, settles it."""
    config = transformers.PretrainedConfig(some_cap=128.0)
    small = torch.linspace(-0.5, 0.5, 64)
    found, said, settled = fit_transform(small, small, config, None, probe=False)
    assert found == LogitTransform() and said == "x" and not settled
    probe = torch.linspace(-24.0, 24.0, 64)
    capped = 128.0 * torch.tanh(probe / 128.0)
    found, said, settled = fit_transform(capped, probe, config, None, probe=True)
    assert found == LogitTransform(softcap=128.0) and said == "some_cap * tanh((x) / some_cap)" and settled


def _llava_next_granite():
    """Granite vision 3.x's layout: LLaVA-NeXT around a Granite text config whose ``logits_scaling`` the
    LLaVA-NeXT forward does not apply."""
    return transformers.LlavaNextForConditionalGeneration(transformers.LlavaNextConfig(
        text_config={**TEXT, "model_type": "granite", "logits_scaling": 4.0}, image_token_index=V - 1,
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8,
                           projection_dim=16), image_grid_pinpoints=[[16, 16]]))


def _paligemma2_top_level_differs():
    model = _paligemma2()
    model.config.final_logit_softcapping = 5.0   # top level 5, text config 2: the forward reads the text's
    return model


# transformers before 5.24 (seen on 5.17): with the top level's final_logit_softcapping different from the
# text config's, PaliGemma's forward returns the head's logits uncapped, matching neither declared transform,
# and patch_causal_lm rightly refuses (ValueError); 5.24's forward applies the text config's.
_PALIGEMMA_SOFTCAP = pytest.mark.skipif(
    not transformers_at_least(5, 24), reason=f"transformers {transformers.__version__}'s PaliGemma forward applies "
                                             "no softcap here; the test assumes 5.24's (the text config's)")


@pytest.mark.parametrize("build", [_llava_next_granite,
                                   pytest.param(_paligemma2_top_level_differs, marks=_PALIGEMMA_SOFTCAP)],
                         ids=["llava_next_granite", "paligemma2_top_level_differs"])
@pytest.mark.parametrize("keep_logits", [None, True], ids=["default", "keep_logits"])
def test_the_transform_the_forward_applies_is_chosen(build, keep_logits):
    """A multimodal config declares a transform in its text config and perhaps another at its top level;
    the first labelled call computes the loss for both candidates and keeps the one the forward applied:
    the stock loss and gradients from that very call on."""
    stock = build().eval()
    fused = patch_causal_lm(copy.deepcopy(stock), keep_logits=keep_logits)
    assert len(fused._fusedce_patch.transforms) == 2
    ids, labels = _batch()
    for _ in range(2):   # the verifying call, then a plain one
        assert_parity(stock, fused, input_ids=ids, labels=labels)
    assert len(fused._fusedce_patch.transforms) == 1


class _Multiplied(transformers.LlamaForCausalLM):
    """A family unknown to fusedce: ``logits * config.head_gain`` before a ``config.cap`` softcap, the way
    Muse Glimmer / Spark transform theirs (attribute names no list in fusedce holds)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        out.logits = self.config.cap * torch.tanh(out.logits * self.config.head_gain / self.config.cap)
        if labels is not None:   # the stock loss is on the transformed logits
            out.loss = self.loss_function(out.logits, labels, vocab_size=self.config.vocab_size)
        return out


@pytest.mark.parametrize("keep_logits", [None, True], ids=["default", "keep_logits"])
def test_a_new_family_transform_read_off_the_forward(keep_logits):
    """The scale and softcap are found among the config's numbers by their values: the stock loss and
    gradients from the first call on, and the transform kept for the next calls."""
    stock = _Multiplied(_llama_config(head_gain=0.3, cap=2.0)).eval()
    fused = patch_causal_lm(copy.deepcopy(stock), keep_logits=keep_logits)
    ids, labels = _batch()
    for _ in range(2):
        assert_parity(stock, fused, input_ids=ids, labels=labels)
    assert fused._fusedce_patch.transforms == (LogitTransform(scale=0.3, softcap=2.0),)


def test_a_transform_read_off_the_forward_needs_the_head_weight_after_it():
    """The first call's loss is computed again for a transform found after the forward; a hook that
    releases the head's weight after its call (as ZeRO-3 does) makes that impossible: ValueError naming
    the family and the transform, never a loss for the wrong transform."""
    model = patch_causal_lm(_Multiplied(_llama_config(head_gain=0.3, cap=2.0)).eval())

    def release(module, args, output):
        module.weight.data = torch.empty(0)
    model.lm_head.register_forward_hook(release)
    ids, labels = _batch()
    with pytest.raises(ValueError, match=r"_Multiplied.forward applies scale=0\.3, softcap=2\.0.*released"):
        model(input_ids=ids, labels=labels)
