"""Multi-turn generation over cached conversations, rows kept busy, states captured as generated.

The regeneration's HF engine. Each conversation holds one row of an
:class:`~eagle3.target.row_cache.RowCache` from its first prompt to its last reply: a turn's prompt
is fed only where it differs from what the row already holds (normally just the user's new
message; the whole history only once per conversation), its reply decoded with every other row's in
one forward per token, and a finished conversation's row taken by the next one waiting. A new turn's
prompt is matched against the row's tokens and the row rolled back to the longest common prefix
(a template that rewrites earlier replies, a reply whose text tokenizes otherwise): what the target
is fed is always exactly the prompt the turn renders, so the reply is the one a fresh forward over
that prompt gives (up to round-off).

With ``capture`` the forwards' aux-layer inputs and pre-norm last states are kept for every token
fed (the harvest's states, :class:`eagle3.store.capture.HFCapture`), and at the end of a
conversation its job names the token sequences a harvest would store for it
(:meth:`Job.sequences`): each is served from the tokens fed (or from an earlier version of the
row kept when it was rolled back); what was never fed (the last stop token, a template's tail) is
fed then. Sampling draws from one generator per conversation, seeded by the caller, so a
conversation's tokens do not depend on which others share the batch::

    a step:  rows with a prompt to feed -> one forward each (prefill, states kept)
             rows decoding              -> one forward together, one token each
    a turn:  ends on a stop id or max_new_tokens -> the job gets the reply, gives the next prompt
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from data_gen.generate import Reply
from eagle3.config import SamplingConfig
from eagle3.target.model import Target
from eagle3.target.row_cache import RowCache, row_attention


class Job(Protocol):
    """One conversation as the engine drives it."""

    def next_prompt(self) -> list[int] | None:
        """The next turn's prompt ids; None when the conversation has no more turns."""

    def take_reply(self, reply: Reply) -> None:
        """The reply the target wrote to the last prompt."""

    def sequences(self) -> list[list[int]]:
        """(With capture, once the conversation is over) the token sequences whose states are wanted."""


@dataclass
class Captured:
    """States of one token sequence: aux-layer inputs and the pre-norm last state, per position."""

    ids: list[int]
    aux: Tensor  # [T, n_aux, hidden]
    last: Tensor  # [T, hidden]


@dataclass
class EngineStats:
    """What the engine fed the target, and how long it took."""

    prefill_tokens: int = 0
    prefill_forwards: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_forwards: int = 0
    decode_seconds: float = 0.0
    decode_kv_slots: int = 0
    """Cache slots the decode forwards' rows attended over, summed: the KV bytes they read."""
    decode_idle_rows: int = 0
    """Row-steps of decode forwards that ran a dummy token (an idle row below a busy one)."""
    conversation_tokens: int = 0
    """Tokens of the conversations as they ended (each row's last sequence, its last token included)."""
    tail_tokens: int = 0
    """Tokens fed only for the capture (a conversation's last stop, a template's tail, a re-feed)."""

    @property
    def fed_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    def add(self, other: EngineStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def summary(self) -> dict[str, Any]:
        """What was fed (nothing: {}): prefill and decode tokens, their rates per process-second, and
        how many tokens were fed per token of the conversations (1.0: nothing fed twice)."""
        if not self.fed_tokens:
            return {}

        def rate(n: float, per: float, digits: int = 1) -> float | None:
            return round(n / per, digits) if per else None

        return {
            "fed_tokens": self.fed_tokens, "conversation_tokens": self.conversation_tokens,
            "fed_per_conversation_token": rate(self.fed_tokens, self.conversation_tokens, 3),
            "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens,
            "capture_tail_tokens": self.tail_tokens, "decode_forwards": self.decode_forwards,
            "decode_rows_per_forward": rate(self.decode_tokens, self.decode_forwards, 2),
            "decode_idle_row_steps": self.decode_idle_rows,
            "prefill_tokens_per_s": rate(self.prefill_tokens, self.prefill_seconds),
            "decode_tokens_per_s": rate(self.decode_tokens, self.decode_seconds),
        }


@dataclass
class _Row:
    job: int
    fed: list[int] = field(default_factory=list)
    aux: list[Tensor] = field(default_factory=list)  # chunks [t, A, H] of the fed tokens' states
    last: list[Tensor] = field(default_factory=list)  # chunks [t, H]
    kept: list[Captured] = field(default_factory=list)  # earlier versions of the row, rolled back
    pending: list[int] = field(default_factory=list)  # to feed (prefill) before the next token is picked
    reply: list[int] = field(default_factory=list)
    tail: bool = False  # feeding for the capture only: no token is picked after it


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pick_token(logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """One token from ``logits`` [V] (fp32): the argmax when greedy, else a draw after temperature,
    top-k and top-p (the smallest set of most likely tokens whose mass reaches top_p)."""
    if sampling.greedy:
        return int(logits.argmax())
    logits = logits.float().cpu() / sampling.temperature  # the generator is a CPU one, whatever the device
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass of the more likely tokens
        sorted_p = sorted_p.masked_fill(before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


class Engine:
    """Runs :class:`Job` s on ``target`` with ``rows`` rows (module docstring)."""

    def __init__(self, target: Target, rows: int, stop_ids: Iterable[int], max_new_tokens: int,
                 sampling: SamplingConfig = SamplingConfig(), *, capture: bool = False,
                 capture_dtype: torch.dtype = torch.float32) -> None:
        if rows < 1:
            raise ValueError(f"rows={rows}: must be >= 1")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        self.stops = frozenset(int(i) for i in stop_ids)
        if not self.stops:
            raise ValueError("stop_ids is empty: generation would only end at max_new_tokens; pass the EOS id")
        self.target, self.rows, self.max_new_tokens, self.sampling = target, rows, max_new_tokens, sampling
        self.capture, self.capture_dtype = capture, capture_dtype
        self.stats = EngineStats()

    @torch.no_grad()
    def run(self, jobs: Sequence[Job], seeds: Sequence[int]) -> list[list[Captured]]:
        """Every job to its end, started in order (a free row takes the next); with capture, per job
        the states of its :meth:`Job.sequences`."""
        cache = RowCache(self.target.config, self.rows, slots=1024)
        generators = [None if self.sampling.greedy else torch.Generator(device="cpu").manual_seed(int(s))
                      for s in seeds]
        with row_attention(self.target.model):
            return self._run(jobs, generators, cache)

    def _run(self, jobs: Sequence[Job], generators: list[torch.Generator | None],
             cache: RowCache) -> list[list[Captured]]:
        waiting = deque(range(len(jobs)))
        slots: list[_Row | None] = [None] * self.rows
        captured: list[list[Captured]] = [[] for _ in jobs]
        while True:
            for r in range(self.rows):  # a free row takes the next conversation
                while slots[r] is None and waiting:
                    j = waiting.popleft()
                    prompt = jobs[j].next_prompt()
                    if prompt is not None:
                        slots[r] = _Row(job=j, pending=list(prompt))
                        cache.keep(r, 0)
            active = [r for r in range(self.rows) if slots[r] is not None]
            if not active:
                return captured
            for r in range(self.rows):  # a free row: nothing to attend over in its dummy steps
                if slots[r] is None:
                    cache.keep(r, 0)
            while not waiting and active[-1] >= len(active):  # the last ones: packed into rows 0..n-1
                free = next(r for r in range(self.rows) if slots[r] is None)
                cache.move(active[-1], free)
                slots[free], slots[active[-1]] = slots[active[-1]], None
                active = [r for r in range(self.rows) if slots[r] is not None]
            for r in active:  # prompts (and capture tails) fed one row at a time
                row = slots[r]
                assert row is not None
                if row.pending:
                    logits = self._forward(cache, [r], [row.pending], [row])
                    if row.tail:
                        self.stats.tail_tokens += len(row.pending)
                    row.pending = []
                    if row.tail:
                        slots[r] = self._finish_capture(cache, r, row, jobs, captured)
                    else:
                        slots[r] = self._take(cache, r, row, pick_token(logits[0], self.sampling,
                                                                        generators[row.job]), jobs, captured)
            decoding = [r for r in range(self.rows) if slots[r] is not None and not slots[r].pending
                        and not slots[r].tail]
            if decoding:  # rows 0..hi-1 together (a view of the cache); an idle one among them runs a dummy
                hi = decoding[-1] + 1
                rows = [slots[r] if r in decoding else None for r in range(hi)]
                tokens = [[row.reply[-1]] if row is not None else [0] for row in rows]
                logits = self._forward(cache, list(range(hi)), tokens, rows)
                for r in decoding:
                    row = slots[r]
                    assert row is not None
                    slots[r] = self._take(cache, r, row, pick_token(logits[r], self.sampling, generators[row.job]),
                                          jobs, captured)

    def _forward(self, cache: RowCache, rows: list[int], tokens: list[list[int]],
                 states: Sequence[_Row | None]) -> Tensor:
        """Feed ``tokens[k]`` to row ``rows[k]`` (a None state: an idle row's dummy, not kept); the
        logits [b, V] (fp32) after each row's last token."""
        n = len(tokens[0])
        t0 = time.perf_counter()
        device = self.target.device
        cache.select(rows, n)
        # one row has no stale slots: transformers' own causal mask (its fused kernels where it can)
        mask = None if len(rows) == 1 else cache.mask(n, device)
        out = self.target(torch.tensor(tokens, device=device), attention_mask=mask,
                          past_key_values=cache, use_cache=True, return_logits=False,
                          position_ids=cache.positions(n).to(device))
        real = [k for k, row in enumerate(states) if row is not None]
        attended = sum(cache.length[rows[k]] + n for k in real)
        cache.advance(n, [rows[k] for k in real])
        logits = self.target.head(out.last[real, -1]).float()  # [real rows, V]
        full = logits.new_zeros((len(rows), logits.shape[-1]))
        full[real] = logits
        for k in real:
            row = states[k]
            assert row is not None
            row.fed += tokens[k]
            if self.capture:
                row.aux.append(out.aux[k].to("cpu", self.capture_dtype))
                row.last.append(out.last[k].to("cpu", self.capture_dtype))
        seconds = time.perf_counter() - t0
        if len(rows) == 1 and (n > 1 or not states[0].reply):
            self.stats.prefill_tokens += n
            self.stats.prefill_forwards += 1
            self.stats.prefill_seconds += seconds
        else:
            self.stats.decode_tokens += n * len(real)
            self.stats.decode_forwards += 1
            self.stats.decode_seconds += seconds
            self.stats.decode_idle_rows += len(rows) - len(real)
            self.stats.decode_kv_slots += attended
        return full

    def _take(self, cache: RowCache, r: int, row: _Row, token: int, jobs: Sequence[Job],
              captured: list[list[Captured]]) -> _Row | None:
        """Row ``r`` picked ``token``: decoding goes on, or its turn ends (the row then feeds the next
        prompt, its capture tail, or is freed)."""
        row.reply.append(token)
        if token not in self.stops and len(row.reply) < self.max_new_tokens:
            return row
        stop = token if token in self.stops else None
        body = row.reply[:-1] if stop is not None else list(row.reply)
        job = jobs[row.job]
        job.take_reply(Reply(body, "stop" if stop is not None else "length", stop))
        unfed = row.reply[-1]  # the turn's last token: never fed to pick another
        row.reply = []
        prompt = job.next_prompt()
        if prompt is not None:
            self._roll_to(cache, r, row, prompt)
            return row
        if not self.capture:
            self.stats.conversation_tokens += len(row.fed) + 1
            return None
        row.pending, row.tail = [unfed], True  # its state belongs to the conversation's samples
        return row

    def _roll_to(self, cache: RowCache, r: int, row: _Row, tokens: Sequence[int]) -> None:
        """Make row ``r`` hold a prefix of ``tokens`` and the rest pending (one token at least)."""
        keep = min(common_prefix(row.fed, tokens), len(tokens) - 1)
        if keep < len(row.fed):
            if self.capture:
                aux, last = torch.cat(row.aux), torch.cat(row.last)
                row.kept.append(Captured(list(row.fed), aux, last))
                row.aux, row.last = [aux[:keep]], [last[:keep]]
            row.fed = row.fed[:keep]
            cache.keep(r, keep)
        row.pending = list(tokens[keep:])

    def _finish_capture(self, cache: RowCache, r: int, row: _Row, jobs: Sequence[Job],
                        captured: list[list[Captured]]) -> _Row | None:
        """The conversation is over: its sequences' states, feeding first what was never fed."""
        versions = [*row.kept, Captured(row.fed, torch.cat(row.aux), torch.cat(row.last))]
        row.aux, row.last = [versions[-1].aux], [versions[-1].last]
        found = []
        for ids in jobs[row.job].sequences():
            source = next((v for v in reversed(versions) if common_prefix(v.ids, ids) == len(ids)), None)
            if source is None:  # some of it never fed: feed it on the row as it is now
                self._roll_to(cache, r, row, ids)
                return row
            found.append(Captured(list(ids), source.aux[:len(ids)].clone(), source.last[:len(ids)].clone()))
        captured[row.job] = found
        self.stats.conversation_tokens += len(row.fed)
        return None


@torch.no_grad()
def greedy_check(target: Target, conversations: Sequence[Any]) -> tuple[int, int, int]:
    """(tokens written, tokens that are the argmax of one full forward over their prompt and the reply
    so far, tokens at a round-off tie: top two logits within 1e-4) over regenerated conversations."""
    checked = equal = ties = 0
    for conv in conversations:
        for prompt, turn in zip(conv.prompts, conv.turns, strict=True):
            written = [*turn.token_ids, *([turn.stop_id] if turn.stop_id is not None else [])]
            logits = target(torch.tensor([[*prompt, *written]])).logits[0, len(prompt) - 1:-1]  # [reply, V]
            top2 = logits.topk(2, dim=-1).values
            chosen = logits.gather(1, torch.tensor(written)[:, None])[:, 0]
            checked += len(written)
            equal += int((chosen == top2[:, 0]).sum())
            ties += int(((chosen != top2[:, 0]) & ((top2[:, 0] - top2[:, 1]).abs() < 1e-4)).sum())
    return checked, equal, ties


__all__ = ["Captured", "Engine", "EngineStats", "Job", "common_prefix", "greedy_check", "pick_token"]
