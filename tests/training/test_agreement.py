"""The agreement term of reuse training (training/reuse/trainer.py): a hinge on composed's margin for
full's greedy token, checked against a plain loop, and shown to do what it is for on a tiny hybrid:
composed's greedy tokens come to equal full's where the KL terms alone leave them apart."""

from __future__ import annotations

import pytest
import torch

from hypic_core.testing import tiny_model
from training.reuse.trainer import TrainConfig, Trainer, agreement_hinge

from test_reuse_training import sample


def hinge_reference(anchor: torch.Tensor, student: torch.Tensor, margin: float) -> tuple[float, float]:
    hinges, agree = [], 0
    for a, s in zip(anchor.tolist(), student.tolist()):
        y = max(range(len(a)), key=a.__getitem__)
        other = max(v for i, v in enumerate(s) if i != y)
        hinges.append(max(0.0, margin - (s[y] - other)))
        agree += s[y] > other
    return sum(hinges) / len(hinges), agree / len(anchor)


def test_the_hinge_equals_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    anchor, student = torch.randn(7, 11, generator=g), torch.randn(7, 11, generator=g)
    student[2] = anchor[2] * 5  # one position where the student agrees by a wide margin: no hinge there
    for margin in (0.0, 0.5, 2.0):
        hinge, agree = agreement_hinge(anchor, student, margin)
        ref_hinge, ref_agree = hinge_reference(anchor, student, margin)
        assert hinge.item() == pytest.approx(ref_hinge, rel=1e-6, abs=1e-7)
        assert agree.item() == pytest.approx(ref_agree)
    same = agreement_hinge(anchor, anchor * 100, 1.0)
    assert same[0].item() == 0.0 and same[1].item() == 1.0


def test_the_hinge_sends_gradient_only_where_the_margin_is_short():
    anchor = torch.tensor([[3.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    student = torch.tensor([[5.0, 0.0, 0.0], [0.0, 0.4, 0.0]], requires_grad=True)  # wide, then short of 1.0
    hinge, agree = agreement_hinge(anchor, student, 1.0)
    hinge.backward()
    assert agree.item() == 1.0
    assert student.grad[0].abs().sum().item() == 0.0, "a position already past the margin gets no gradient"
    assert student.grad[1, 1].item() < 0 and student.grad[1].abs().sum().item() > 0


def test_the_agreement_term_brings_composed_greedy_tokens_to_full_s():
    """Same seed, same steps, the same teacher the student cannot match: with the hinge, composed
    prefers full's greedy token on more positions (and by a wider margin) than the KL terms alone
    leave it; the logged loss counts the term with its weight."""
    s = sample(reply=12)

    def after(agreement: float):
        torch.manual_seed(0)
        trainer = Trainer(TrainConfig(model="bamba", out="-", rank=4, seam=0, lr=1e-2, warmup=1, consistency=1.0,
                                      agreement=agreement, margin=2.0), tiny_model("bamba"), tiny_model("bamba", seed=1))
        for _ in range(12):
            step = trainer.train_step(s)
        assert step.loss == pytest.approx(step.kl_full + step.kl_composed + step.gap + agreement * step.hinge, rel=1e-5)
        trainer.student.eval()
        with torch.no_grad():
            from training.reuse.modes import full_logits
            reply = trainer.reply_for(s)
            full = full_logits(trainer.student, s.layout, reply)
            comp = trainer.composer.logits(s.layout, reply).detach()
        return agreement_hinge(full, comp, 2.0)

    plain_hinge, plain_agree = after(0.0)
    hinge, agree = after(10.0)
    assert plain_hinge.item() > 0.05, "the KL terms alone already met the margin: the test would not see the term"
    assert hinge.item() < 0.5 * plain_hinge.item(), (plain_hinge.item(), hinge.item())
    assert agree.item() >= plain_agree.item()


def test_the_settings_are_checked():
    with pytest.raises(ValueError, match="agreement"):
        TrainConfig(model="m", out="-", agreement=-1.0)
    with pytest.raises(ValueError, match="margin"):
        TrainConfig(model="m", out="-", margin=-0.5)
