"""Training-time test: shifts, masks and metrics by hand; the batched unroll against the draft
run exactly as at serving time (its own KV cache, one token at a time)."""

from __future__ import annotations

import pytest
import torch

import eagle3.draft.ttt as ttt
from eagle3.draft.model import Eagle3Draft, KVCache
from eagle3.draft.ttt import (
    prepare_targets,
    prepare_targets_from_topk,
    shift_left,
    soft_cross_entropy,
    step0_attention_mask,
    step_counted,
    step_input_ids,
    step_positions,
    step_weights,
    ttt_attention,
    ttt_forward,
)
from tests.helpers import conditional_acceptance, documents, packed_batch, simulated_tau, step_accuracy, tiny_draft

# ---------------------------------------------------------------- the arbiter


@torch.no_grad()
def serving_logits(draft: Eagle3Draft, batch: dict[str, torch.Tensor], num_steps: int) -> dict:
    """{(row, k, t): logits [Vd]} from the draft run as at serving time.

    For every document and start position t: the cache holds step 0 of positions <= t (fed one
    token at a time: token x[p+1], the target's states at p, RoPE position p), then K-1 draft
    steps feed the draft's own pre-norm output with the ground-truth next token, one at a time.
    """
    out = {}
    for row, start, end in documents(batch):
        ids = batch["input_ids"][row]
        fc = draft.combine_aux(batch["aux"][row : row + 1])  # [1, S, H]
        cache = KVCache()
        for t in range(start, end - 1):  # the last position has no next token to feed
            h, logits = draft(ids[t + 1].view(1, 1), fc[:, t : t + 1], torch.tensor([[t - start]]), cache)
            out[row, 0, t] = logits[0, 0]
            branch = cache.fork()
            for k in range(1, num_steps):
                if t + k + 1 >= end:
                    break
                h, logits = draft(ids[t + k + 1].view(1, 1), h, torch.tensor([[t - start + k]]), branch)
                out[row, k, t] = logits[0, 0]
    return out


def reference_loss(ref: dict, batch: dict[str, torch.Tensor], draft: Eagle3Draft, num_steps: int) -> torch.Tensor:
    """The TTT loss recomputed from the serving logits, position by position."""
    targets = prepare_targets(batch["target_logits"], draft.t2d)
    doc, mask = batch["document_ids"], batch["loss_mask"]
    b, s = doc.shape
    total = torch.tensor(0.0)
    for k in range(num_steps):
        ces = []
        for row in range(b):
            for t in range(s):
                p = t + k + 2  # the predicted token
                if p >= s or doc[row, p] != doc[row, t] or not mask[row, p]:
                    continue
                if not draft.t2d[targets.argmax[row, t + k + 1]]:
                    continue
                ces.append(soft_cross_entropy(ref[row, k, t], targets.probs[row, t + k + 1]))
        if ces:
            total = total + 0.8**k * torch.stack(ces).mean()
    return total


def _batched(draft: Eagle3Draft, batch: dict[str, torch.Tensor], num_steps: int, **kw) -> ttt.TTTOutput:
    return ttt_forward(draft, batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"],
                       batch["loss_mask"], prepare_targets(batch["target_logits"], draft.t2d),
                       num_steps=num_steps, return_logits=True, **kw)


def _max_gap(out: ttt.TTTOutput, ref: dict) -> dict[int, float]:
    gaps: dict[int, float] = {}
    for (row, k, t), logits in ref.items():
        gaps[k] = max(gaps.get(k, 0.0), (out.logits[k][row, t] - logits).abs().max().item())
    return gaps


SPECULATORS_VARIANT = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}


@pytest.mark.parametrize("num_layers,num_steps,variant", [
    (1, 4, {}), (1, 3, {}), (2, 3, {}), (1, 3, SPECULATORS_VARIANT), (2, 3, {"fc_norm": True, "norm_output": True}),
    # sliding windows shorter than the documents: step k's query sits k positions on, its window with it
    (1, 3, {"sliding_window": 4}), (1, 4, {"sliding_window": 5}),
    (2, 3, {"sliding_window": 4, "full_attention_layers": [1]})])
def test_batched_ttt_equals_serving_time_draft(num_layers: int, num_steps: int, variant: dict) -> None:
    draft = tiny_draft(num_layers, **variant)
    batch = packed_batch([[9, 7], [5, 11]], t2d=draft.t2d)
    ref = serving_logits(draft, batch, num_steps)
    with torch.no_grad():
        out = _batched(draft, batch, num_steps)
    gaps = _max_gap(out, ref)
    assert sorted(gaps) == list(range(num_steps))
    assert max(gaps.values()) < 1e-4, gaps
    # every (step, start) the reference could run was compared: 2 rows x 2 docs
    assert len(ref) == sum(max(0, n - 1 - k) for row in ([9, 7], [5, 11]) for n in row for k in range(num_steps))
    assert out.count.sum() > 0
    torch.testing.assert_close(out.loss, reference_loss(ref, batch, draft, num_steps), rtol=1e-5, atol=1e-5)


def test_negative_controls_disagree_with_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """The arbiter is sensitive: EAGLE's shifted step-0 window and unshifted RoPE both fail it."""
    draft = tiny_draft()
    batch = packed_batch([[9, 7]])
    ref = serving_logits(draft, batch, 3)

    real_attention = ttt.ttt_attention

    def shifted_window(q, step0, diagonal, mask0):  # EAGLE's shift: step k hides step-0 keys t-k..t-1
        k = len(diagonal)
        rows = torch.arange(mask0.shape[-1])
        gap = rows[:, None] - rows[None, :]  # t - s
        return real_attention(q, step0, diagonal, mask0 & ~((gap >= 1) & (gap <= k)))

    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(ttt, "ttt_attention", shifted_window)
        gaps = _max_gap(_batched(draft, batch, 3), ref)
    assert gaps[0] < 1e-4 and gaps[1] > 1e-2 and gaps[2] > 1e-2, gaps

    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(ttt, "step_positions", lambda position_ids, step: position_ids)
        gaps = _max_gap(_batched(draft, batch, 3), ref)
    assert gaps[0] < 1e-4 and gaps[1] > 1e-2 and gaps[2] > 1e-2, gaps


def test_gradient_checkpointing_gives_identical_gradients() -> None:
    draft = tiny_draft(num_layers=2).train()
    batch = packed_batch([[9, 7], [5, 11]], seed=3, t2d=draft.t2d)

    def grads(checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        draft.zero_grad(set_to_none=True)
        out = ttt_forward(draft, batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"],
                          batch["loss_mask"], prepare_targets(batch["target_logits"], draft.t2d),
                          num_steps=4, gradient_checkpointing=checkpointing)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}

    loss_plain, plain = grads(False)
    loss_ckpt, ckpt = grads(True)
    assert torch.equal(loss_plain, loss_ckpt)
    assert plain.keys() == ckpt.keys() and "embed_tokens.weight" not in plain
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=0, atol=0, msg=name)
    assert all(g.abs().sum() > 0 for g in plain.values())


@pytest.mark.parametrize("k", [0, 1, 2])  # 0: step 0 (its own fused path), then 1 and 2 diagonal keys
def test_attention_equals_dense_masked_attention(k: int) -> None:
    """ttt_attention == softmax over explicitly listed keys (step 0 rows <= t same doc, then the diagonal)."""
    g = torch.Generator().manual_seed(0)
    b, s, nh, nkv, d = 2, 6, 4, 2, 8
    q = torch.randn(b, s, nh, d, generator=g)
    kv = [(torch.randn(b, s, nkv, d, generator=g), torch.randn(b, s, nkv, d, generator=g)) for _ in range(k + 1)]
    doc = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    got = ttt_attention(q, kv[0], kv[1:], step0_attention_mask(doc))
    for bi in range(b):
        for t in range(s):
            for h in range(nh):
                kh = h // (nh // nkv)
                keys = [kv[0][0][bi, j, kh] for j in range(t + 1) if doc[bi, j] == doc[bi, t]]
                vals = [kv[0][1][bi, j, kh] for j in range(t + 1) if doc[bi, j] == doc[bi, t]]
                keys += [kv[j][0][bi, t, kh] for j in range(1, k + 1)]
                vals += [kv[j][1][bi, t, kh] for j in range(1, k + 1)]
                w = torch.softmax(torch.stack(keys) @ q[bi, t, h] / d**0.5, 0)
                torch.testing.assert_close(got[bi, t, h], w @ torch.stack(vals))


@pytest.mark.parametrize(("s", "block", "k"), [(10, 4, 1), (10, 4, 2), (12, 4, 2), (300, 64, 2)])
def test_blocked_attention_equals_the_explicit_softmax(monkeypatch: pytest.MonkeyPatch, s: int, block: int,
                                                       k: int) -> None:
    """The fused, query-blocked path (long rows, steps >= 1): same outputs and gradients."""
    g = torch.Generator().manual_seed(1)
    b, nh, nkv, d = 2, 4, 2, 8
    leaves = [torch.randn(b, s, nh, d, generator=g)]
    leaves += [torch.randn(b, s, nkv, d, generator=g) for _ in range(2 * k + 2)]
    doc = torch.zeros(b, s, dtype=torch.long)
    doc[0, s // 3:] = 1
    doc[1, s - 3:] = 2
    mask0 = step0_attention_mask(doc)
    grad_out = torch.randn(b, s, nh, d, generator=g)

    def run(fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = [t.clone().requires_grad_() for t in leaves]
        out = fn(x[0], (x[1], x[2]), [(x[3 + 2 * j], x[4 + 2 * j]) for j in range(k)], mask0)
        (out * grad_out).sum().backward()
        return out.detach(), [t.grad for t in x]

    monkeypatch.setattr(ttt, "BLOCKED_ATTENTION_MIN_LEN", 10**9)
    want, want_grads = run(ttt_attention)  # the explicit softmax
    got, got_grads = run(lambda *a: ttt._blocked_attention(*a, block))
    torch.testing.assert_close(got, want)
    for a, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, w)
    if s >= 256:  # and ttt_attention takes that path by itself for long rows
        monkeypatch.setattr(ttt, "BLOCKED_ATTENTION_MIN_LEN", 256)
        calls, blocked = [], ttt._blocked_attention
        monkeypatch.setattr(ttt, "_blocked_attention", lambda *a: calls.append(a[-1]) or blocked(*a))
        torch.testing.assert_close(run(ttt_attention)[0], want)
        assert calls == [64]


# ---------------------------------------------------------------- shifts and masks by hand


def test_shifts_by_hand() -> None:
    x = torch.tensor([[10, 11, 12, 13, 14]])
    assert shift_left(x, 2, -1).tolist() == [[12, 13, 14, -1, -1]]
    assert shift_left(x, 7, 0).tolist() == [[0, 0, 0, 0, 0]]
    assert step_input_ids(x, 0).tolist() == [[11, 12, 13, 14, 0]]  # x[t+1]
    assert step_input_ids(x, 2).tolist() == [[13, 14, 0, 0, 0]]  # x[t+3]
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    assert step_positions(pos, 2).tolist() == [[2, 3, 4, 2, 3]]


def test_step_counted_by_hand() -> None:
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1]]).bool()
    # step 0 at t is gated by mask[t+2] in t's document: t=0 -> m2, t=1 -> m3, t=2,3 -> next doc, t=4 -> m6
    assert step_counted(mask, doc, 0).int().tolist() == [[1, 1, 0, 0, 1, 0, 0]]
    # step 1: t=0 -> m3; t=1 -> index 4 is the next document; t=4 -> index 7 is past the row
    assert step_counted(mask, doc, 1).int().tolist() == [[1, 0, 0, 0, 0, 0, 0]]
    assert not step_counted(mask, doc, 2).any()


def test_step0_mask_by_hand() -> None:
    got = step0_attention_mask(torch.tensor([[0, 0, 1, 1]]))[0].int().tolist()
    assert got == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    # a window of 2: the row itself and the one before, within the document
    got = step0_attention_mask(torch.tensor([[0, 0, 0, 0, 1, 1, 1]]), window=2)[0].int().tolist()
    assert got == [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0],
                   [0, 0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1]]


def test_a_window_too_short_for_the_unroll_is_refused() -> None:
    draft = tiny_draft(1, sliding_window=3)
    batch = packed_batch([[9]], t2d=draft.t2d)
    with pytest.raises(ValueError, match="sliding_window=3: must exceed the 3 unrolled steps"):
        _batched(draft, batch, 3)


def test_targets_restricted_renormalised_and_argmax_outside_masked() -> None:
    t2d = torch.tensor([True, False, True, True])
    logits = torch.tensor([[[0.0, 5.0, 1.0, 2.0], [3.0, 0.0, 1.0, 2.0]]])
    targets = prepare_targets(logits, t2d)
    sub = torch.tensor([0.0, 1.0, 2.0])
    torch.testing.assert_close(targets.probs[0, 0], torch.softmax(sub, 0))
    torch.testing.assert_close(targets.probs[0, 0].sum(), torch.tensor(1.0))
    assert targets.argmax.tolist() == [[1, 0]]  # position 0's argmax (id 1) is outside the draft vocab


def test_targets_from_probs_and_from_topk_agree_with_logits() -> None:
    g = torch.Generator().manual_seed(0)
    t2d = torch.zeros(12, dtype=torch.bool)
    t2d[[0, 2, 3, 7, 11]] = True
    logits = torch.randn(2, 5, 12, generator=g)
    full = prepare_targets(logits, t2d)
    from_probs = prepare_targets(torch.softmax(logits, -1), t2d, are_probs=True)
    torch.testing.assert_close(from_probs.probs, full.probs)
    assert torch.equal(from_probs.argmax, full.argmax)
    # top-k: the same as full logits with everything outside the top-k at -inf
    logprobs = torch.log_softmax(logits, -1)
    top = logprobs.topk(6, dim=-1)
    truncated = torch.full_like(logprobs, float("-inf")).scatter(-1, top.indices, top.values)
    got = prepare_targets_from_topk(top.indices, top.values, t2d)
    want = prepare_targets(truncated, t2d)
    torch.testing.assert_close(got.probs, want.probs)
    assert torch.equal(got.argmax, full.argmax)
    # no top-k id in the draft vocab: zero distribution, argmax outside (masked)
    none = prepare_targets_from_topk(torch.tensor([[[1, 4]]]), torch.tensor([[[-0.1, -2.0]]]), t2d)
    assert none.probs.abs().sum() == 0 and none.argmax.item() == 1


@pytest.mark.parametrize("temperature", [0.25, 2.0])
def test_a_target_temperature_tempers_the_distribution_not_the_argmax(temperature: float) -> None:
    g = torch.Generator().manual_seed(1)
    t2d = torch.zeros(12, dtype=torch.bool)
    t2d[[0, 2, 3, 7, 11]] = True
    logits = torch.randn(2, 5, 12, generator=g) * 3
    plain = prepare_targets(logits, t2d)
    tempered = prepare_targets(logits, t2d, temperature=temperature)
    # p^(1/T) renormalised over the draft vocab, by hand
    by_hand = plain.probs ** (1 / temperature)
    torch.testing.assert_close(tempered.probs, by_hand / by_hand.sum(-1, keepdim=True))
    assert torch.equal(tempered.argmax, plain.argmax)
    assert not torch.allclose(tempered.probs, plain.probs)
    # sharper below 1, flatter above: the entropy moves accordingly
    entropy = [-(t.probs * t.probs.log()).sum(-1).mean() for t in (plain, tempered)]
    assert (entropy[1] < entropy[0]) == (temperature < 1)
    top = torch.log_softmax(logits, -1).topk(12, dim=-1)  # every id: top-k equals the full distribution
    from_topk = prepare_targets_from_topk(top.indices, top.values, t2d, temperature)
    torch.testing.assert_close(from_topk.probs, tempered.probs)


def test_loss_skips_positions_whose_target_argmax_is_outside_the_draft_vocab() -> None:
    draft = tiny_draft()
    batch = packed_batch([[16]])
    batch["loss_mask"][:] = True
    batch["target_logits"][..., draft.t2d] += 100.0  # every argmax inside the draft vocab ...
    outside = int((~draft.t2d).nonzero()[0])
    batch["target_logits"][0, 5, outside] = 300.0  # ... but position 5's, learnt by step 0 at t=4, step 1 at t=3
    with torch.no_grad():
        out = _batched(draft, batch, 2)
    assert not out.valid[0, 0, 4] and not out.valid[1, 0, 3]
    assert out.counted[0, 0, 4] and not out.match[0, 0, 4]  # counted by the metrics as a miss
    assert out.valid[0, 0, 3] and out.count.tolist() == [13, 12]


def test_loss_on_oov_trains_those_positions_on_the_renormalised_draft_vocab() -> None:
    draft = tiny_draft()
    batch = packed_batch([[16]])
    batch["loss_mask"][:] = True
    batch["target_logits"][..., draft.t2d] += 100.0
    outside = int((~draft.t2d).nonzero()[0])
    batch["target_logits"][0, 5, outside] = 300.0  # argmax outside the draft vocab at position 5
    targets = prepare_targets(batch["target_logits"], draft.t2d)
    with torch.no_grad():
        dropped = _batched(draft, batch, 2)
        kept = _batched(draft, batch, 2, loss_on_oov=True)
    assert kept.valid[0, 0, 4] and kept.valid[1, 0, 3] and kept.count.tolist() == [14, 13]
    assert torch.equal(kept.match, dropped.match)  # the metrics are the same; only the loss differs
    extra = soft_cross_entropy(kept.logits[0][0, 4], targets.probs[0, 5])  # step 0 at t=4 learns p[5]
    torch.testing.assert_close(kept.loss_sum[0], dropped.loss_sum[0] + extra)
    # a top-k target with no mass on the draft vocab stays out of the loss even so
    no_mass = ttt.TTTTargets(probs=targets.probs.clone(), argmax=targets.argmax)
    no_mass.probs[0, 5] = 0.0
    with torch.no_grad():
        out = ttt_forward(draft, batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"],
                          batch["loss_mask"], no_mass, num_steps=2, loss_on_oov=True)
    assert not out.valid[0, 0, 4] and out.count.tolist() == [13, 12]


def test_gated_steps_train_only_where_the_chain_reaches_them() -> None:
    draft = tiny_draft()
    batch = packed_batch([[12, 20], [32]], t2d=None)
    batch["loss_mask"][:] = True
    plain = _batched(draft, batch, 3)
    # make the target agree with the draft's step 0 at every other start position, so that
    # some chains reach step 1 and some do not,
    guess = draft.draft_to_target_ids(plain.logits[0].argmax(-1))  # [B, S] target ids
    for b, t in (plain.counted[0] & (torch.arange(32) % 2 == 0)).nonzero().tolist():
        batch["target_logits"][b, t + 1, guess[b, t]] += 100.0
    # and with its step 1 at every fourth, so that some chains reach step 2 too
    plain = _batched(draft, batch, 3)
    guess = draft.draft_to_target_ids(plain.logits[1].argmax(-1))
    for b, t in (plain.counted[1] & (torch.arange(32) % 4 == 0)).nonzero().tolist():
        batch["target_logits"][b, t + 2, guess[b, t]] += 100.0
    plain = _batched(draft, batch, 3)
    gated = _batched(draft, batch, 3, gate_steps=True)
    assert torch.equal(gated.match, plain.match) and torch.equal(gated.count, plain.count)
    torch.testing.assert_close(gated.loss_sum[0], plain.loss_sum[0])
    targets = prepare_targets(batch["target_logits"], draft.t2d)
    reached = plain.match[0].clone()
    for k in (1, 2):
        trained = plain.valid[k] & reached
        assert 0 < int(trained.sum()) < int(plain.valid[k].sum())  # the gate drops some, keeps some
        ce = soft_cross_entropy(plain.logits[k], ttt.shift_left(targets.probs, k + 1, 0.0))
        torch.testing.assert_close(gated.loss_sum[k], ce[trained].sum())
        reached &= plain.match[k]
    weights = step_weights(3)
    torch.testing.assert_close(gated.loss, sum(float(weights[k]) * gated.loss_sum[k] / gated.count[k]
                                               for k in range(3)).float())
    # the training path (logits on counted rows only, unread rows skipped) gives the same loss
    with torch.no_grad():
        fast = ttt_forward(draft, batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"],
                           batch["loss_mask"], targets, num_steps=3, gate_steps=True)
    torch.testing.assert_close(fast.loss_sum, gated.loss_sum)


def test_step_weights() -> None:
    torch.testing.assert_close(step_weights(3), torch.tensor([1.0, 0.8, 0.64], dtype=torch.float64))
    torch.testing.assert_close(step_weights(2, decay=1.0), torch.ones(2, dtype=torch.float64))


# ---------------------------------------------------------------- metrics by hand

MATCH = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]]).bool()  # [K=3, N=4]
COUNTED = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]]).bool()


def test_step_accuracy_by_hand() -> None:
    torch.testing.assert_close(step_accuracy(MATCH, COUNTED), torch.tensor([3 / 4, 3 / 4, 2 / 3]))


def test_conditional_acceptance_by_hand() -> None:
    # step 0: 3 of 4; step 1: of the 3 that matched step 0 (0, 1, 3), 0 and 3 match -> 2/3;
    # step 2: of positions 0 and 3, 3 is not counted and 0 misses -> 0 of 1
    torch.testing.assert_close(conditional_acceptance(MATCH, COUNTED), torch.tensor([3 / 4, 2 / 3, 0.0]))


def test_simulated_tau_multiplies_per_position() -> None:
    # accepted runs per position: 2, 1, 0, 2 (position 3's step 2 is not counted) -> 1 + 5/4
    assert simulated_tau(MATCH, COUNTED).item() == pytest.approx(2.25)
    acc = step_accuracy(MATCH, COUNTED)
    product_of_means = 1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2]
    assert product_of_means.item() == pytest.approx(2.6875)  # the biased estimate is not what we report
    # only positions counted at step 0 are averaged; batch dims are flattened
    counted = COUNTED.clone()
    counted[0, 2] = False
    assert simulated_tau(MATCH.view(3, 2, 2), counted.view(3, 2, 2)).item() == pytest.approx(1 + 5 / 3)


@pytest.mark.parametrize("variant", [{}, SPECULATORS_VARIANT])
def test_logits_on_counted_rows_only_change_nothing(variant: dict) -> None:
    """Training computes logits only where a step is counted; losses, matches and gradients equal
    the full computation (return_logits=True runs every row)."""
    draft = tiny_draft(num_layers=2, **variant).train()
    batch = packed_batch([[9, 7], [5, 11]], seed=4, t2d=draft.t2d)

    def run(full: bool) -> tuple[ttt.TTTOutput, dict[str, torch.Tensor]]:
        draft.zero_grad(set_to_none=True)
        out = ttt_forward(draft, batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"],
                          batch["loss_mask"], prepare_targets(batch["target_logits"], draft.t2d), num_steps=3,
                          return_logits=full)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}

    (full, g_full), (fast, g_fast) = run(True), run(False)
    torch.testing.assert_close(fast.loss, full.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast.loss_sum, full.loss_sum, rtol=1e-6, atol=1e-6)
    assert torch.equal(fast.count, full.count) and torch.equal(fast.counted, full.counted)
    assert torch.equal(fast.match & fast.counted, full.match & full.counted)
    assert not (fast.match & ~fast.counted).any()
    for name in g_full:
        torch.testing.assert_close(g_fast[name], g_full[name], rtol=1e-5, atol=1e-6, msg=name)


def _prompt_reply_mask(doc_lengths: list[list[int]], prompt: float) -> torch.Tensor:
    """Loss mask of packed conversations: each document's first ``prompt`` share unmasked."""
    return torch.stack([torch.cat([torch.arange(n) >= int(prompt * n) for n in row]) for row in doc_lengths])


def test_read_rows_by_hand() -> None:
    doc = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 0, 0]])
    mask = torch.tensor([[0, 0, 0, 0, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    # K=3: step k at t predicts x[t+k+2], same document, masked (row 0: nothing reaches x7 in doc 1)
    idx, live = ttt.read_rows(mask, doc, 3)
    assert idx.tolist() == [[0, 1, 2, 3, 4], [3, 4, 5, 0, 0]]
    assert live.tolist() == [[True] * 5, [True, True, True, False, False]]
    idx, live = ttt.read_rows(mask, doc, 1)
    assert idx.tolist() == [[2, 4], [5, 0]] and live.tolist() == [[True, True], [True, False]]
    idx, live = ttt.read_rows(torch.zeros_like(mask), doc, 3)  # nothing counted: one padding row
    assert live.shape == (2, 1) and not live.any()


@pytest.mark.parametrize(("doc_lengths", "num_layers", "variant", "checkpointing", "num_steps", "oov"), [
    ([[30, 20, 30], [40, 40]], 1, {}, False, 4, False),
    ([[30, 30, 20], [60, 20]], 2, SPECULATORS_VARIANT, True, 4, False),
    ([[30, 30, 20], [60, 20]], 2, {}, False, 1, True),
    ([[150, 130], [280]], 1, SPECULATORS_VARIANT, False, 4, False),  # 280 rows: the blocked attention
    ([[150, 130], [280]], 2, {"sliding_window": 40, "full_attention_layers": [1]}, True, 4, False),
])
def test_skipping_unread_rows_changes_nothing(doc_lengths: list[list[int]], num_layers: int, variant: dict,
                                              checkpointing: bool, num_steps: int, oov: bool) -> None:
    """The unroll only on the rows some step counts (prompts drop out; step 0 keeps every row's
    keys): the same loss, metrics and gradients as every row, with fewer rows (and unequal counts
    per batch row: padding, in a batch row whose position 0 is read too)."""
    draft = tiny_draft(num_layers=num_layers, **variant).train()
    batch = packed_batch(doc_lengths, seed=5, t2d=draft.t2d)
    batch["loss_mask"] = torch.cat([_prompt_reply_mask(doc_lengths[:1], 0.75),
                                    _prompt_reply_mask(doc_lengths[1:], 0.5)])
    batch["loss_mask"][0, :5] = True  # row 0 reads position 0 (steps predict x[2..]) and has the fewest rows
    idx, live = ttt.read_rows(batch["loss_mask"], batch["document_ids"], num_steps)
    assert idx.shape[1] < 0.6 * batch["input_ids"].shape[1] and not live.all()
    assert idx[0, 0] == 0 and live[0, 0] and not live[0].all()

    def run(skip: bool) -> tuple[ttt.TTTOutput, dict[str, torch.Tensor]]:
        draft.zero_grad(set_to_none=True)
        out = ttt_forward(draft, batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"],
                          batch["loss_mask"], prepare_targets(batch["target_logits"], draft.t2d),
                          num_steps=num_steps, gradient_checkpointing=checkpointing, skip_unread_rows=skip,
                          loss_on_oov=oov)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}

    (full, g_full), (fast, g_fast) = run(False), run(True)
    assert (full.count > 0).all()
    torch.testing.assert_close(fast.loss, full.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast.loss_sum, full.loss_sum, rtol=1e-6, atol=1e-5)
    assert torch.equal(fast.count, full.count) and torch.equal(fast.counted, full.counted)
    assert torch.equal(fast.valid, full.valid)
    assert torch.equal(fast.match & fast.counted, full.match & full.counted)
    assert not (fast.match & ~fast.counted).any()
    for name in g_full:
        torch.testing.assert_close(g_fast[name], g_full[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_row_plan_made_elsewhere_is_the_one_the_unroll_makes_and_fits_only_its_batch() -> None:
    """The trainer plans the rows on the host (:func:`eagle3.draft.ttt.layout_rows`): given to the unroll it
    gives the very loss and matches of the unroll's own layout; a layout of another batch, another depth
    or read rows for a forward over every row is refused by name."""
    draft = tiny_draft().train()
    batch = packed_batch([[30, 20], [50]], seed=6, t2d=draft.t2d)
    batch["loss_mask"] = _prompt_reply_mask([[30, 20], [50]], 0.5)
    targets = prepare_targets(batch["target_logits"], draft.t2d)
    args = (draft, batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"], batch["loss_mask"],
            targets)
    layout = ttt.layout_rows(batch["loss_mask"], batch["document_ids"], 3)
    own, given = ttt_forward(*args, num_steps=3), ttt_forward(*args, num_steps=3, layout=layout)
    assert torch.equal(own.loss, given.loss) and torch.equal(own.match, given.match)
    other = ttt.layout_rows(batch["loss_mask"][:1], batch["document_ids"][:1], 3)
    for bad, kwargs in ((other, {}), (layout, {"num_steps": 2}), (layout, {"skip_unread_rows": False})):
        with pytest.raises(ValueError, match="row layout"):
            ttt_forward(*args, **{"num_steps": 3, **kwargs}, layout=bad)


def test_document_groups_by_hand() -> None:
    """Documents are grouped until a group holds ``min_tokens``; the rows read are split at the same
    places, and their padding (position 0) is a segment of its own that sees the first key."""
    doc = torch.tensor([[0] * 10 + [1] * 3 + [2] * 20])
    at, live = torch.tensor([[2, 5, 11, 12, 20, 0]]), torch.tensor([[True] * 5 + [False]])
    every, read = ttt.layout_segments(doc, at, live, 8)
    assert every == ((0, 0, 10, 0, 10), (0, 10, 33, 10, 33))
    assert read == ((0, 0, 10, 0, 2), (0, 10, 33, 2, 5), (0, 0, 1, 5, 6))
    assert ttt.layout_segments(doc, None, None, 100) == (((0, 0, 33, 0, 33),), None)


@pytest.mark.parametrize("skip", [True, False])
def test_attention_by_document_groups_changes_nothing(skip: bool) -> None:
    """Attention per group of documents (small groups here, so that every row splits) gives the loss,
    matches and gradients of attention over whole rows: rows read or every row, a row ending in
    padding (as bucketed rows do), gradient checkpointing, two layers."""
    draft = tiny_draft(num_layers=2).train()
    lengths = [[30, 5, 60, 20, 5, 40], [70, 40, 50]]
    batch = packed_batch(lengths, seed=4, t2d=draft.t2d)
    batch["loss_mask"] = _prompt_reply_mask(lengths, 0.5)
    batch["document_ids"][1, 150:], batch["loss_mask"][1, 150:], batch["position_ids"][1, 150:] = -1, False, 0
    targets = prepare_targets(batch["target_logits"], draft.t2d)

    def run(segment_tokens: int | None) -> tuple[ttt.TTTOutput, dict[str, torch.Tensor], ttt.RowLayout]:
        draft.zero_grad(set_to_none=True)
        layout = ttt.layout_rows(batch["loss_mask"], batch["document_ids"], 3, skip, segment_tokens)
        out = ttt_forward(draft, batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"],
                          batch["loss_mask"], targets, num_steps=3, skip_unread_rows=skip, layout=layout,
                          gradient_checkpointing=True)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}, layout

    whole, g_whole, _ = run(None)
    split, g_split, layout = run(16)
    assert layout.segments is not None and len(layout.segments[0]) >= 7 and (not skip or len(layout.segments[1]) >= 6)
    torch.testing.assert_close(split.loss, whole.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(split.match, whole.match) and whole.count.sum() > 0
    for name in g_whole:
        torch.testing.assert_close(g_split[name], g_whole[name], rtol=1e-4, atol=1e-6, msg=name)
