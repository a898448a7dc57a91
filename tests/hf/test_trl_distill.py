"""``fusedce.patch_distillation_trainer``: TRL's DistillationTrainer and GKDTrainer through
``fusedce.linear_distillation_loss``, against TRL alone and the float64 formula.

Tiny random Llama student (H=32) and teacher (H=48: the widths may differ, the vocabulary V=211 may not),
a hand-made batch of 2 sequences (prompt 4, completion 5, a ragged completion mask), so the trainer's
``compute_loss`` runs without generation. Per case: the loss, the logged student entropy and every
student gradient equal TRL's own (fp32 noise), and the loss equals ``reference64_distill``'s float64
formula on the backbones' hidden states. No tensor of the fused step has V columns (no logits).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

import fusedce  # noqa: E402
from fusedce.integrations.trl import distill as trl_distill  # noqa: E402
from reference64_distill import linear_distillation_loss64  # noqa: E402
from hf_models import VOCAB  # noqa: E402
from trl_data import _tokenizer  # noqa: E402

PROMPT, COMPLETION = 4, 5


def _llama(hidden: int, seed: int, bias=False):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():   # a head of scale ~1 so the two distributions differ clearly
        model.lm_head.weight.normal_(0, 1.0 / math.sqrt(hidden) * 4)
    return model.eval()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return dict(prompt_ids=torch.randint(3, VOCAB, (2, PROMPT), generator=g),
                prompt_mask=torch.ones(2, PROMPT, dtype=torch.long),
                completion_ids=torch.randint(3, VOCAB, (2, COMPLETION), generator=g),
                completion_mask=torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]))


def _trainer(tmp_path, **config):
    args = trl.DistillationConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                                  report_to=[], use_cpu=True, save_strategy="no", bf16=False, disable_tqdm=True,
                                  gradient_checkpointing=False, **config)
    dataset = datasets.Dataset.from_dict({"prompt": ["t3 t4 t5"] * 4})
    tokenizer = _tokenizer()
    tokenizer.padding_side = "left"
    return trl.DistillationTrainer(model=_llama(32, 0), teacher_model=_llama(48, 1), args=args,
                                   train_dataset=dataset, processing_class=tokenizer)


def _step(trainer, inputs, num_items_in_batch=None):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    entropy = trainer._metrics["eval"]["entropy"][-1]
    return loss.detach(), grads, entropy


def _oracle(trainer, inputs, num_items_in_batch, **kw):
    """The float64 loss of the formula on the backbones' hidden states (TRL's own hidden-state code)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        h_s = trainer._get_last_hidden_state(trainer.model, ids, mask, COMPLETION)
        h_t = trainer._get_last_hidden_state(trainer.teacher_model, ids, mask, COMPLETION)
    target = torch.where(inputs["completion_mask"] != 0, 0, -100).reshape(-1)
    s_weight = trainer.model.lm_head.weight
    t_head = trainer.teacher_model.lm_head
    return linear_distillation_loss64(h_s.reshape(-1, h_s.shape[-1]) * kw.pop("s_scale"), s_weight,
                                      h_t.reshape(-1, h_t.shape[-1]) * kw.pop("t_scale"), t_head.weight, target,
                                      num_items_in_batch=num_items_in_batch, **kw)


def _float64_copy(model):
    """A float64 model with ``model``'s weights, built from its config (``copy.deepcopy`` would also copy
    the instance ``forward`` that accelerate and TRL's forward redirection leave bound to the original)."""
    copied = type(model)(model.config)
    copied.load_state_dict(model.state_dict())
    return copied.double().eval()


def _reference_grads(trainer, inputs, num_items_in_batch, **kw):
    """Float64 gradients of the formula's loss w.r.t. every student parameter (a float64 copy of the
    student; the teacher's hidden states in float64 too)."""
    student = _float64_copy(trainer.model)
    teacher = _float64_copy(trainer.teacher_model)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    h_s = trainer._get_last_hidden_state(student, ids, mask, COMPLETION)
    with torch.no_grad():
        h_t = trainer._get_last_hidden_state(teacher, ids, mask, COMPLETION)
    target = torch.where(inputs["completion_mask"] != 0, 0, -100).reshape(-1)
    loss = linear_distillation_loss64(h_s.reshape(-1, h_s.shape[-1]) * kw.pop("s_scale"), student.lm_head.weight,
                                      h_t.reshape(-1, h_t.shape[-1]) * kw.pop("t_scale"), teacher.lm_head.weight,
                                      target, num_items_in_batch=num_items_in_batch, **kw)
    loss.backward()
    return {n: p.grad for n, p in student.named_parameters() if p.grad is not None}


CASES = [  # (beta, temperature, student (scale, softcap), teacher (scale, softcap), num_items_in_batch)
    (0.0, 1.0, (1.0, None), (1.0, None), None),
    (1.0, 2.0, (1.0, None), (1.0, None), None),
    (0.5, 0.7, (1.0, 3.0), (0.5, None), None),
    (0.25, 1.0, (2.0, None), (1.0, 4.0), torch.tensor(9.0)),
]


@pytest.mark.parametrize("method", ["chunked", "tiled"])
@pytest.mark.parametrize("beta,temperature,student,teacher,num_items", CASES)
def test_same_loss_entropy_and_gradients_as_trl(tmp_path, method, beta, temperature, student, teacher, num_items):
    trainer = _trainer(tmp_path, beta=beta, temperature=temperature)
    for model, (scale, cap) in ((trainer.model, student), (trainer.teacher_model, teacher)):
        if scale != 1.0:
            model.config.logit_scale = scale          # read by TRL's _compute_loss from the config
        model.config.final_logit_softcapping = cap
    inputs = _inputs()
    loss, grads, entropy = _step(trainer, inputs, num_items)
    assert fusedce.patch_distillation_trainer(trainer, method=method, backend="torch") is trainer
    f_loss, f_grads, f_entropy = _step(trainer, inputs, num_items)

    expected = _oracle(trainer, inputs, num_items, beta=beta, temperature=temperature, s_scale=student[0],
                       t_scale=teacher[0], student_softcap=student[1], teacher_softcap=teacher[1])
    assert float(loss) > 1e-3   # the case tests something
    assert float(f_loss) == pytest.approx(float(expected), rel=1e-5)
    assert float(f_loss) == pytest.approx(float(loss), rel=1e-5)
    assert f_entropy == pytest.approx(entropy, rel=1e-5)
    assert grads.keys() == f_grads.keys() and "lm_head.weight" in grads and "model.embed_tokens.weight" in grads
    # every student gradient against float64 autograd through the whole student (backbone included), the
    # fused error no larger than twice TRL's (per tensor, in norm: deep layers amplify fp32 rounding)
    reference = _reference_grads(trainer, inputs, num_items, beta=beta, temperature=temperature,
                                 s_scale=student[0], t_scale=teacher[0], student_softcap=student[1],
                                 teacher_softcap=teacher[1])
    assert grads.keys() == f_grads.keys() == reference.keys()
    for name, g64 in reference.items():
        stock_error = float((grads[name].double() - g64).norm())
        fused_error = float((f_grads[name].double() - g64).norm())
        assert fused_error <= 2 * stock_error + 1e-6 * float(g64.norm()), (name, fused_error, stock_error)
    # the head's gradient entry by entry against the float64 formula's
    head = reference["lm_head.weight"]
    torch.testing.assert_close(f_grads["lm_head.weight"].double(), head, rtol=1e-4, atol=1e-5 * float(head.abs().max()))
    for p in trainer.teacher_model.parameters():
        assert p.grad is None


class WidestOutput(TorchDispatchMode):
    """The largest last dimension of any tensor of >= 2 dims that an op returns while active."""

    def __init__(self):
        super().__init__()
        self.widest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                self.widest = max(self.widest, t.shape[-1])
        return out


def test_no_logits_in_the_fused_step(tmp_path):
    trainer = _trainer(tmp_path, beta=0.5)
    inputs = _inputs()
    with WidestOutput() as stock:
        _step(trainer, inputs)
    fusedce.patch_distillation_trainer(trainer, method="tiled", backend="torch")
    with WidestOutput() as fused:
        _step(trainer, inputs)
    assert stock.widest >= VOCAB    # TRL's (tokens x 32768) tiles
    assert fused.widest < VOCAB, fused.widest


def test_entropy_off_logs_nan_and_unpatch_restores(tmp_path):
    trainer = _trainer(tmp_path, beta=0.0)
    inputs = _inputs()
    loss, _, _ = _step(trainer, inputs)
    fusedce.patch_distillation_trainer(trainer, entropy=False, backend="torch")
    assert trl_distill.distillation_options(trainer)["entropy"] is False
    f_loss, _, f_entropy = _step(trainer, inputs)
    assert math.isnan(f_entropy) and float(f_loss) == pytest.approx(float(loss), rel=1e-5)
    fusedce.unpatch_distillation_trainer(trainer)
    assert "_compute_loss" not in vars(trainer) and trl_distill.distillation_options(trainer) is None
    _, _, entropy = _step(trainer, inputs)
    assert not math.isnan(entropy)
    fusedce.unpatch_distillation_trainer(trainer)   # no-op


def test_refusals(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="DistillationTrainer"):
        fusedce.patch_distillation_trainer(object())
    trainer = _trainer(tmp_path)
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(RuntimeError, match="1.17.0"):
        fusedce.patch_distillation_trainer(trainer)
    monkeypatch.undo()
    monkeypatch.setitem(trl_distill.FINGERPRINTS, "trl.trainer.distillation_trainer._chunked_divergence_loss", "0" * 16)
    with pytest.raises(RuntimeError, match="_chunked_divergence_loss"):
        fusedce.patch_distillation_trainer(trainer)
    monkeypatch.undo()

    class Custom(trl.DistillationTrainer):
        def _compute_loss(self, *args):
            raise AssertionError

    trainer.__class__ = Custom
    with pytest.raises(TypeError, match="overrides"):
        fusedce.patch_distillation_trainer(trainer)
    assert "_compute_loss" not in vars(trainer)


# --- GKDTrainer: TRL computes both models' full logits in compute_loss -----------------------------------

def _gkd(tmp_path, student, teacher, beta):
    from trl.experimental.gkd import GKDConfig, GKDTrainer
    args = GKDConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[],
                     use_cpu=True, save_strategy="no", bf16=False, disable_tqdm=True, gradient_checkpointing=False,
                     beta=beta)
    dataset = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "t3"},
                                                        {"role": "assistant", "content": "t4"}]] * 2})
    return GKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=dataset,
                      processing_class=_tokenizer())


def _gkd_inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    labels = ids.clone()
    labels[:, :PROMPT] = -100              # prompt
    labels[1, 7:] = -100                   # padding
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _gkd_step(trainer, inputs, num_items_in_batch=None):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _gkd_reference(trainer, inputs, num_items_in_batch):
    """Float64 loss and student gradients of the formula on float64 copies of both models' full logits
    (temperature 1, as TRL's GKD calls its loss), the model's own logit transform included."""
    student = _float64_copy(trainer.model)
    teacher = _float64_copy(trainer.teacher_model)
    from reference64_distill import distillation_loss64
    z_s = student(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits[:, :-1]
    with torch.no_grad():
        z_t = teacher(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits[:, :-1]
    loss = distillation_loss64(z_s, z_t, inputs["labels"][:, 1:], beta=trainer.beta,
                               num_items_in_batch=num_items_in_batch)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in student.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("student_family,beta,num_items", [("llama", 0.5, None), ("gemma2", 0.0, None),
                                                             ("llama", 1.0, torch.tensor(7.0))])
def test_gkd_same_loss_and_gradients_as_trl_without_logits(tmp_path, student_family, beta, num_items):
    from hf_models import build
    student = build(student_family)         # gemma2: final_logit_softcapping 2.0, applied by its forward
    teacher = _llama(48, 1)
    trainer = _gkd(tmp_path, student, teacher, beta)
    inputs = _gkd_inputs()
    loss, grads = _gkd_step(trainer, inputs, num_items)
    fusedce.patch_distillation_trainer(trainer, method="tiled", backend="torch")
    _gkd_step(trainer, inputs, num_items)   # the first call checks each head transform on one token (1 x V)
    with WidestOutput() as fused_step:
        f_loss, f_grads = _gkd_step(trainer, inputs, num_items)
    assert fused_step.widest < VOCAB, fused_step.widest
    expected, reference = _gkd_reference(trainer, inputs, num_items)
    assert float(loss) > 1e-3
    assert float(f_loss) == pytest.approx(float(expected), rel=1e-5)
    assert float(f_loss) == pytest.approx(float(loss), rel=1e-5)
    assert grads.keys() == f_grads.keys() == reference.keys()
    for name, g64 in reference.items():
        stock_error = float((grads[name].double() - g64).norm())
        fused_error = float((f_grads[name].double() - g64).norm())
        assert fused_error <= 2 * stock_error + 1e-6 * float(g64.norm()), (name, fused_error, stock_error)


def test_gkd_outputs_requested_run_trl_and_unpatch(tmp_path):
    trainer = _gkd(tmp_path, _llama(32, 0), _llama(48, 1), 0.5)
    inputs = _gkd_inputs()
    fusedce.patch_distillation_trainer(trainer, backend="torch")
    loss, outputs = trainer.compute_loss(trainer.model, inputs, return_outputs=True)
    assert outputs.logits.shape == (2, 9, VOCAB)      # TRL's own path: the caller asked for the logits
    assert float(loss) == pytest.approx(float(trainer.compute_loss(trainer.model, inputs)), rel=1e-5)
    fusedce.unpatch_distillation_trainer(trainer)
    assert "compute_loss" not in vars(trainer)


def test_gkd_follows_the_forward_not_the_declared_name(tmp_path):
    """A config may declare a transform under a known name that its forward does not apply (a Llama with
    ``logits_scaling``, which Granite divides by and HyperCLOVA X multiplies by): the GKD path checks the
    declared transform on one token of each model's forward and follows the forward. Before, it divided the
    student's logits by 4 and trained another loss than TRL's."""
    student = _llama(32, 0)
    student.config.logits_scaling = 4.0          # declared, not applied by LlamaForCausalLM.forward
    trainer = _gkd(tmp_path, student, _llama(48, 1), 0.5)
    inputs = _gkd_inputs()
    loss, grads = _gkd_step(trainer, inputs)
    fusedce.patch_distillation_trainer(trainer, backend="torch")
    f_loss, f_grads = _gkd_step(trainer, inputs)
    assert float(f_loss) == pytest.approx(float(loss), rel=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(f_grads[name], g, rtol=1e-4, atol=1e-6 * float(g.abs().max()))
