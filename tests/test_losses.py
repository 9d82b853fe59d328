"""The draft objectives (eagle3.draft.losses): hand-worked values, the hybrid's detached weight, and the
TTT unroll summing the chosen objective over each step's loss positions."""

from __future__ import annotations

import math

import pytest
import torch

from eagle3.draft import ttt
from eagle3.draft.losses import Objective, acceptance, draft_loss, kl_divergence
from eagle3.draft.ttt import prepare_targets, ttt_forward
from tests.helpers import packed_batch, tiny_draft

P = torch.tensor([0.5, 0.3, 0.2])
Q = torch.tensor([0.2, 0.5, 0.3])


def test_the_losses_by_hand() -> None:
    logits = Q.log()  # softmax(log q) = q
    # alpha = min(.5,.2) + min(.3,.5) + min(.2,.3) = .2 + .3 + .2 = .7
    assert float(acceptance(logits, P)) == pytest.approx(0.7)
    assert float(draft_loss("tv", logits, P)) == pytest.approx(0.3)
    assert float(draft_loss("nla", logits, P)) == pytest.approx(-math.log(0.7))  # 0.35667
    # KL = .5 ln(.5/.2) + .3 ln(.3/.5) + .2 ln(.2/.3) = .45815 - .15325 - .08109 = .22380
    assert float(kl_divergence(logits, P)) == pytest.approx(0.22380, abs=1e-5)
    # soft CE = -(.5 ln .2 + .3 ln .5 + .2 ln .3) = .80472 + .20794 + .24079 = 1.25346
    assert float(draft_loss("soft_ce", logits, P)) == pytest.approx(1.25346, abs=1e-5)
    # lambda = exp(-3 * .7) = .12246; .12246 * .22380 + .87754 * .3 = .02741 + .26326 = .29067
    assert float(draft_loss("lk_hybrid", logits, P)) == pytest.approx(0.29067, abs=1e-5)
    assert float(draft_loss("lk_hybrid", logits, P, eta=1.0)) == pytest.approx(
        math.exp(-0.7) * 0.22380 + (1 - math.exp(-0.7)) * 0.3, abs=1e-5)
    assert float(draft_loss("tv", P.log(), P)) == pytest.approx(0.0, abs=1e-6)  # q = p: always accepted
    with pytest.raises(ValueError, match="loss 'ce': expected one of soft_ce, tv, nla, lk_hybrid"):
        Objective("ce")


def test_the_hybrid_weight_carries_no_gradient_and_empty_rows_stay_finite() -> None:
    logits = Q.log().clone().requires_grad_(True)
    draft_loss("lk_hybrid", logits, P).backward()
    weight = math.exp(-3 * 0.7)
    parts = Q.log().clone().requires_grad_(True)
    (weight * kl_divergence(parts, P) + (1 - weight) * (1 - acceptance(parts, P))).backward()
    torch.testing.assert_close(logits.grad, parts.grad)  # lambda is a constant in the gradient
    empty = torch.zeros(3)  # a target with no mass on the draft vocab
    for name in ("soft_ce", "tv", "nla", "lk_hybrid"):
        x = torch.randn(3, requires_grad=True)
        value = draft_loss(name, x, empty)
        value.backward()
        assert torch.isfinite(value) and torch.equal(x.grad, torch.zeros(3))  # such rows teach nothing


@pytest.mark.parametrize("name", ["tv", "nla", "lk_hybrid"])
def test_the_unroll_sums_the_chosen_objective_over_each_steps_loss_positions(name: str) -> None:
    draft = tiny_draft()
    batch = packed_batch([[12, 20], [32]], t2d=None)
    targets = prepare_targets(batch["target_logits"], draft.t2d)
    args = (draft, batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"],
            batch["loss_mask"], targets)
    full = ttt_forward(*args, num_steps=3, return_logits=True, objective=Objective(name))
    for k in range(3):
        per_position = draft_loss(name, full.logits[k], ttt.shift_left(targets.probs, k + 1, 0.0))
        torch.testing.assert_close(full.loss_sum[k], per_position[full.valid[k]].sum())
    fast = ttt_forward(*args, num_steps=3, objective=Objective(name))  # the training path: counted rows only
    torch.testing.assert_close(fast.loss, full.loss)
    plain = ttt_forward(*args, num_steps=3)
    assert torch.equal(fast.match, plain.match)  # the objective changes the loss, never the proposals
