"""Messages that point at the caller's actual mistake (issue 47 item 4): one model's hidden states and
head swapped in ``linear_distillation_loss`` name that model (the student is not blamed for the
teacher's swap); a head module passed for its weight gets a ``.weight`` hint; an ``ignore_index`` passed
positionally (where ``weight`` / ``bias`` sit) is named as such. (The Hugging Face patch's pre-shifted
labels: ``tests/hf/test_hf_reduction_none.py``.)"""
import pytest
import torch

import fusedce

N, HS, HT, V = 6, 8, 16, 11   # tokens, student / teacher hidden sizes, vocabulary (N != V: shapes tell)


def _models():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N, HS, generator=g), torch.randn(V, HS, generator=g), torch.randn(N, HT, generator=g),
            torch.randn(V, HT, generator=g), torch.randint(0, V, (N,), generator=g))


def _message(exc, call) -> str:
    with pytest.raises(exc) as info:
        call()
    return str(info.value)


def test_teacher_swap_names_the_teacher():
    h, w, th, tw, t = _models()
    for call in (lambda: fusedce.linear_distillation_loss(h, w, tw, th, t),                # 2-D: the target tells
                 lambda: fusedce.linear_distillation_loss(h.view(2, 3, HS), w, tw, th)):  # 3-D student: shapes tell
        msg = _message(ValueError, call)
        assert "teacher_hidden (11, 16) and teacher_weight look swapped" in msg, msg
        assert "student_hidden" not in msg.split(";")[-1].split(":")[0], msg
    msg = _message(ValueError, lambda: fusedce.linear_distillation_loss(h, w, tw, th.view(2, 3, HT)))
    assert "teacher_weight (V, H); got (11, 16) and (2, 3, 16); they look swapped" in msg, msg


def test_student_swap_names_the_student():
    h, w, th, tw, t = _models()
    msg = _message(ValueError, lambda: fusedce.linear_distillation_loss(w, h, th, tw, t))
    assert "student_hidden (11, 8) and student_weight look swapped" in msg, msg


def test_ambiguous_swap_blames_neither_alone():
    """2-D hidden states and no target: the shapes fit either model's swap; both are named."""
    h, w, th, tw, _ = _models()
    msg = _message(ValueError, lambda: fusedce.linear_distillation_loss(h, w, tw, th))
    assert "the student's or the teacher's hidden states and head look swapped" in msg, msg


def test_a_head_module_gets_a_weight_hint():
    h, w, th, tw, t = _models()
    head = torch.nn.Linear(HS, V, bias=False)
    for name, call in (("weight", lambda: fusedce.linear_cross_entropy(h, head, t)),
                       ("weight", lambda: fusedce.linear_token_log_probs(h, head, t)),
                       ("student_weight", lambda: fusedce.linear_distillation_loss(h, head, th, tw, t))):
        msg = _message(TypeError, call)
        expected = f"{name} must be a tensor, got Linear (a module: pass its weight tensor, e.g. lm_head.weight"
        assert expected in msg, msg


def test_positional_ignore_index_is_named():
    h, w, _, _, t = _models()
    logits = torch.randn(N, V)
    for where, call in (("weight, the third", lambda: fusedce.cross_entropy(logits, t, -100)),
                        ("bias, the fourth", lambda: fusedce.linear_cross_entropy(h, w, t, -100)),
                        ("weight, the first", lambda: fusedce.CrossEntropyLoss(-100))):
        msg = _message(TypeError, call)
        assert f"-100 was passed as {where} positional argument; for ignore_index, pass ignore_index=-100" in msg, msg
    msg = _message(TypeError, lambda: fusedce.cross_entropy(logits, t, torch.ones(V, dtype=torch.long)))
    assert "got torch.int64" in msg and "ignore_index" not in msg, msg
