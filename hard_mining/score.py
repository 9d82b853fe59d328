"""Where is the draft weak? Per-sample, per-domain and per-language acceptance of a draft on
harvested data.

Each sample runs through the training-time-test unroll alone (the draft proposing K tokens from
every assistant position, as :mod:`eagle3.draft.ttt` trains it), so its figures are exactly the ones
the trainer's eval reports, split by sample:

* ``accepted``: per counted start position, how many of the K draft tokens in a row match the
  target's argmax (the per-token acceptance; tau_sim = 1 + its mean);
* ``loss``: the step-weighted soft cross-entropy against the target's distribution;
* ``entropy``: the same average of the target's own entropy (over the draft vocab), so that
  ``excess = loss - entropy`` is the part of the loss a draft can remove (the KL to the target):
  a sample whose loss is mostly entropy is text no draft can learn;
* per start, the target's top-1 probability at the first drafted token (``top1``), and the row it
  starts from (``starts``): where the target is confident and the draft still misses is where it
  can learn (:meth:`SampleScore.missed_confident`); the rounds the loop would serve follow from the
  starts and their runs (:func:`served_rounds`).

Groups (domain, language) pool their positions: tau of a group is 1 + sum(accepted) / starts,
not a mean of per-sample taus, so long samples weigh what they contain.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3.conversations import ConversationError, iter_jsonl
from eagle3.draft.families import family_of
from eagle3.draft.metrics import accepted_runs, step_hits
from eagle3.draft.model import DraftHead
from eagle3.draft.ttt import shift_left, step_weights
from eagle3.store.batches import load_batch
from eagle3.store.shards import HarvestStore
from eagle3.train.token_weights import target_entropy
from hard_mining.config import RANKS

UNKNOWN = "unknown"


@dataclass
class SampleScore:
    sample_id: str
    domain: str
    language: str
    tokens: int
    accepted: list[int]
    """Draft tokens accepted in a row from each counted start position (0..K)."""
    loss: float
    """Step-weighted soft cross-entropy (the training loss of this sample alone)."""
    step_hits: list[int] = field(default_factory=list)
    """Per TTT step: counted positions whose draft argmax matched."""
    step_counted: list[int] = field(default_factory=list)
    contexts: list[int] = field(default_factory=list)
    """Per start (as ``accepted``): the tokens before its first draft token (its context length)."""
    entropy: float = 0.0
    """The target's entropy averaged as ``loss`` is (same positions and step weights)."""
    top1: list[float] = field(default_factory=list)
    """Per start: the target's top-1 probability (over the draft vocab) at its first draft token."""
    starts: list[int] = field(default_factory=list)
    """Per start: its row t in the sample (the first draft token is token t + 2)."""

    @property
    def positions(self) -> int:
        return len(self.accepted)

    @property
    def tau_sim(self) -> float:
        return 1.0 + sum(self.accepted) / len(self.accepted) if self.accepted else 1.0

    @property
    def excess(self) -> float:
        """The loss above the target's own entropy: what the draft could still learn here."""
        return self.loss - self.entropy

    def missed_confident(self, confidence: float = 0.5) -> float:
        """The share of starts whose first draft token was rejected where the target gave its own
        token at least ``confidence``: learnable misses, per start."""
        if not self.accepted or len(self.top1) != len(self.accepted):  # scored without the target's top-1
            return 0.0
        missed = sum(a == 0 and p >= confidence for a, p in zip(self.accepted, self.top1, strict=True))
        return missed / len(self.accepted)

    def as_dict(self) -> dict[str, Any]:
        """As written to the scores files (the per-start ``contexts``, ``top1`` and ``starts`` left
        out: read in memory)."""
        out = {**asdict(self), "tau_sim": round(self.tau_sim, 4), "positions": self.positions,
               "excess": round(self.excess, 6), "missed_confident": round(self.missed_confident(), 4)}
        for key in ("contexts", "top1", "starts"):
            del out[key]
        return out


@dataclass
class GroupScore:
    name: str
    samples: int
    positions: int
    accepted: int
    loss: float
    """Mean of the samples' losses, weighted by their positions."""
    acceptance: list[float]
    """Per depth i: share of starts whose first i draft tokens were all accepted."""

    @property
    def tau_sim(self) -> float:
        return 1.0 + self.accepted / self.positions if self.positions else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tau_sim": round(self.tau_sim, 4)}


def read_sample_meta(records: str | Path | Iterable[str | Path]) -> dict[str, dict[str, str]]:
    """``{id: {"domain", "language"}}`` from regenerated-conversation JSONL files (the harvest's input)."""
    paths = [records] if isinstance(records, (str, Path)) else list(records)
    out: dict[str, dict[str, str]] = {}
    for path in paths:
        for where, record in iter_jsonl(Path(path)):
            if isinstance(record, Exception):
                raise ConversationError(f"{where}: {record}")
            out[str(record["id"])] = {"domain": str(record.get("domain") or UNKNOWN),
                                      "language": str(record.get("language") or UNKNOWN)}
    return out


def record_of(sample_id: str) -> str:
    """The record a sample came from: the harvest names a conversation's per-reply samples ``<id>-t<k>``."""
    match = re.fullmatch(r"(.+)-t\d+", sample_id)
    return match.group(1) if match else sample_id


def meta_of(sample_id: str, meta: dict[str, dict[str, str]]) -> dict[str, str]:
    """A sample's domain and language; per-turn samples (``<id>-t<k>``) inherit their record's."""
    if sample_id in meta:
        return meta[sample_id]
    return meta.get(record_of(sample_id), {"domain": UNKNOWN, "language": UNKNOWN})


def target_head(target: Any) -> Any:
    """The trainer's frozen head (the target's final norm + lm_head, copied) for ``target``."""
    from eagle3.draft.target_head import TargetHead

    return TargetHead.of_target(target).to(device=target.device, dtype=torch.float32).eval()


@torch.no_grad()
def score_sample(draft: DraftHead, head: Any, batch: dict[str, torch.Tensor], ttt_steps: int,
                 step_decay: float = 0.8) -> dict[str, Any]:
    """One sample (a batch of one row) -> the :class:`SampleScore` fields its unroll gives: accepted
    run per start, loss and target entropy, per-step hits and counts, and per start its context
    length, the target's top-1 probability at its first draft token and its row."""
    dtype, device = draft.fc.weight.dtype, draft.fc.weight.device
    batch = {k: v.to(device) for k, v in batch.items()}  # the loader builds it on the host
    targets = head.targets(batch, draft.t2d)
    weights = step_weights(ttt_steps, step_decay)
    out = family_of(draft.config).forward(draft, batch["input_ids"], batch["aux"].to(dtype), batch["position_ids"],
                      batch["document_ids"], batch["loss_mask"], targets, num_steps=ttt_steps, weights=weights)
    run, start = accepted_runs(out.match, out.counted)  # [N] each
    contexts = batch["position_ids"].flatten() + 2  # row t's first draft token is x[t+2]: t+2 tokens before it
    h = target_entropy(targets.probs)  # [1, S]: at p[t]
    entropy = sum(float(weights[k]) * float(torch.where(out.valid[k], shift_left(h, k + 1, 0.0), 0.0).sum())
                  / max(int(out.valid[k].sum()), 1) for k in range(ttt_steps))
    top1 = shift_left(targets.probs.max(-1).values, 1, 0.0).flatten()  # [N]: at the first draft token, p[t+1]
    where = start.to(contexts.device)
    return {"accepted": run[start].tolist(), "loss": float(out.loss), "entropy": entropy,
            "step_hits": step_hits(out.match, out.counted).sum(1).tolist(),
            "step_counted": out.counted.flatten(1).sum(1).tolist(), "contexts": contexts[where].tolist(),
            "top1": top1[where].tolist(), "starts": where.nonzero().flatten().tolist()}


def score_store(draft: DraftHead, head: Any, store: HarvestStore, meta: dict[str, dict[str, str]],
                *, ttt_steps: int, indices: Sequence[int] | None = None, step_decay: float = 0.8,
                progress: bool = False) -> list[SampleScore]:
    """Score every sample of ``store`` (or ``indices``) with ``draft``."""
    draft = draft.eval()
    ids = store.sample_ids
    chosen = range(len(store)) if indices is None else indices
    if progress:
        from tqdm import tqdm

        chosen = tqdm(chosen, desc="score", unit="sample")
    out = []
    for i in chosen:
        batch = load_batch(store, [i], "buckets")
        m = meta_of(ids[i], meta)
        out.append(SampleScore(ids[i], m["domain"], m["language"], int(batch["input_ids"].shape[1]),
                               **score_sample(draft, head, batch, ttt_steps, step_decay)))
    return out


def group_scores(scores: Sequence[SampleScore], key: str, depth: int | None = None) -> dict[str, GroupScore]:
    """Pool samples by ``key`` (``domain``, ``language``, or ``all``)."""
    groups: dict[str, list[SampleScore]] = defaultdict(list)
    for s in scores:
        groups["all" if key == "all" else getattr(s, key)].append(s)
    k = depth if depth is not None else max((len(s.step_hits) for s in scores), default=0)
    out = {}
    for name, items in sorted(groups.items()):
        runs = [a for s in items for a in s.accepted]
        positions = len(runs)
        loss = sum(s.loss * s.positions for s in items) / positions if positions else 0.0
        acceptance = [sum(a >= i for a in runs) / positions if positions else 0.0 for i in range(1, k + 1)]
        out[name] = GroupScore(name, len(items), positions, sum(runs), loss, acceptance)
    return out


def group_by_context(scores: Sequence[SampleScore]) -> dict[str, dict[str, Any]]:
    """Starts pooled by the context before their first draft token, in the serving reports' buckets
    (:func:`eagle3.draft.metrics.context_bucket`), shortest first: starts, tau_sim and the share of
    starts whose first draft token is accepted (``accept_1``)."""
    from eagle3.draft.metrics import CONTEXT_BUCKETS, context_bucket

    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for s in scores:
        for accepted, tokens in zip(s.accepted, s.contexts, strict=True):
            bucket = sums[context_bucket(tokens)]
            bucket[0] += 1
            bucket[1] += accepted
            bucket[2] += accepted > 0
    return {b: {"starts": sums[b][0], "tau_sim": round(1.0 + sums[b][1] / sums[b][0], 4),
                "accept_1": round(sums[b][2] / sums[b][0], 4)} for b in CONTEXT_BUCKETS if b in sums}


def rank_key(rank: str = "loss", confidence: float = 0.5) -> Callable[[SampleScore], tuple]:
    """The sort key that puts the hardest sample first under ``rank`` (ties: lower tau, then id)."""
    if rank == "loss":
        return lambda s: (-s.loss, s.tau_sim, s.sample_id)
    if rank == "excess":
        return lambda s: (-s.excess, s.tau_sim, s.sample_id)
    if rank == "missed_confident":
        return lambda s: (-s.missed_confident(confidence), -s.excess, s.sample_id)
    raise ValueError(f"rank {rank!r}: expected one of {', '.join(RANKS)}")


def hardest(scores: Sequence[SampleScore], n: int, min_positions: int = 8, rank: str = "loss",
            confidence: float = 0.5) -> list[SampleScore]:
    """The ``n`` hardest samples under ``rank`` (:data:`RANKS`), among those with at least
    ``min_positions`` scored positions (a 2-token reply says little)."""
    pool = [s for s in scores if s.positions >= min_positions]
    return sorted(pool, key=rank_key(rank, confidence))[:n]


def write_scores(path: Path, scores: Sequence[SampleScore]) -> None:
    from eagle3.atomic import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(s.as_dict()) + "\n" for s in scores))


__all__ = ["RANKS", "GroupScore", "SampleScore", "group_by_context", "group_scores", "hardest", "meta_of",
           "rank_key", "read_sample_meta", "record_of", "score_sample", "score_store", "target_head", "write_scores"]
