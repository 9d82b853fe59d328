"""Error replay: the rounds the draft serves on a conversation, the tokens it failed to propose, and
the loss weights that replay them (``train.loss.token_weights``).

Greedy speculative decoding is lossless, so the reply the loop serves is the target's greedy reply,
token for token, and the draft's proposal in every round depends only on that reply's prefix. The
training-time-test unroll of a harvested reply therefore holds every round the loop would serve:
a round starting at row t (the first draft token is token t + 2) accepts the run of matches from t,
``a``, and the next round starts at row t + a + 1 (after the a accepted tokens and the target's own
token). The first round of a reply starts one row before its second token (the target writes the
first in its prefill). ``tests/test_replay.py`` checks these rounds against the bundled loop's.

A round that accepted ``a`` of ``K`` tokens rejected token t + a + 2: that token (every TTT step whose
target it is, so the steps after the rejected one too) gets the replay weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hard_mining.score import SampleScore


def reply_spans(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """[T] bool -> the (first, last) token index of each run of loss-masked tokens: the replies."""
    mask = loss_mask.bool().tolist()
    spans, first = [], None
    for j, on in enumerate([*mask, False]):
        if on and first is None:
            first = j
        elif not on and first is not None:
            spans.append((first, j - 1))
            first = None
    return spans


def served_rounds(score: SampleScore, spans: Sequence[tuple[int, int]], depth: int) -> list[tuple[int, int, int]]:
    """The rounds the loop serves on a scored sample, per reply in order: (row t, tokens accepted, the
    token it rejected or -1 where it rejected none: all ``depth`` accepted, or the reply ran out). A
    reply needs at least two tokens for a round (its first is the target's)."""
    run_at = dict(zip(score.starts, score.accepted, strict=True))
    rounds = []
    for first, last in spans:
        t = first - 1
        while t + 2 <= last:
            a = min(run_at.get(t, 0), depth)
            rejected = t + a + 2 if a < depth and t + a + 2 <= last else -1
            rounds.append((t, a, rejected))
            t += a + 1
    return rounds


def replay_weights(rounds: dict[str, list[tuple[int, int, int]]], weight: float) -> dict[str, list[list[int | float]]]:
    """``train.loss.token_weights`` entries: per sample (its :func:`served_rounds`), the tokens its rounds
    rejected, at ``weight``."""
    out: dict[str, list[list[int | float]]] = {}
    for sample_id, served in rounds.items():
        rejected = [j for _, _, j in served if j >= 0]
        if rejected:
            out[sample_id] = [[j, weight] for j in rejected]
    return out


__all__ = ["replay_weights", "reply_spans", "served_rounds"]
