"""Speculative decoding with a draft (EAGLE-3, P-EAGLE or DFlash): the target (HF, KV cache,
aux-layer capture) and the draft (its own KV cache), chain or dynamic tree, greedy or sampled,
lossless.

One round, with ``n`` tokens in the target's cache and ``x`` the newest emitted token (not yet in
it; position ``n``); the draft's cache holds rows 0..n-1 (row t: target states at t, token t+1)::

    propose   the draft's root state (from its last catch-up row) -> chain of K tokens, or a tree
              (EAGLE-2: expand the best ``topk`` nodes per depth by cumulative log-prob, keep the
              best ``budget`` nodes); node at depth d sits at position n + d
    verify    one target forward over [x, nodes...] (tree attention: a node sees the prefix and
              its ancestors) -> logits and aux states at every node
    accept    serve_eval.verify (greedy or rejection sampling) -> accepted path + one more token
    rollback  target cache: keep the prefix, x and the accepted path; draft cache: keep rows < n
    catch up  draft rows n..n+a from the target's aux states at x and the accepted nodes, tokens =
              the accepted tokens then the new one; its last row is the next root state (run
              lazily: pending rows go through the draft in one forward before the next proposal,
              so a round at depth 0, plain decoding under an adaptive policy, costs no draft step)

Parallel families propose the whole chain in one draft forward, run with the catch-up rows: a
P-EAGLE draft appends k - 1 mask rows to them (rolled back with the proposals), a DFlash draft adds
the rows' context to its cache and runs its trained block (the newest token and block_size - 1 mask
tokens, attending both ways), whose first k mask slots are the proposal.

Plain decoding runs in the same loop (one target forward per token), so a speedup compares like
with like. Timings split draft / verify / other; ``stats`` has tau and acceptance per depth.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from eagle3.config import SamplingConfig
from eagle3.device import synchronize
from eagle3.draft.families import Proposal, Proposer, family_of
from eagle3.draft.metrics import acceptance_per_position, accepted_by_source, served_tau
from eagle3.draft.model import DraftHead, DraftKV
from eagle3.errors import ConfigError
from eagle3.target.model import Target
from serve_eval.config import SpecConfig
from serve_eval.lookup import (
    DRAFT,
    LOOKUP,
    MATCH_CAP,
    Continuation,
    LookupIndex,
    LookupPolicy,
    Merged,
    SharedLookup,
    fit_budget,
    merge_branch,
)
from serve_eval.static_cache import StaticDraftKV, StaticKV, check_static_target
from serve_eval.verify import (
    Acceptance,
    greedy_chain,
    greedy_tree,
    sample_chain,
    sample_tree,
    target_probs,
    tree_attention_mask,
    tree_depths,
)


class DepthPolicy(Protocol):
    """Chooses each round's chain depth (adaptive speculation, :mod:`serve_eval.adaptive`)."""

    def choose(self) -> int: ...

    def observe(self, depth: int, accepted: int, kept_depth: int | None = None, kept: int | None = None) -> None:
        """A round proposed ``depth`` tokens deep and the target accepted ``accepted`` of them; of those
        the reply keeps ``kept`` (fewer where it ended inside the round), reported as a round
        ``kept_depth`` deep (None: as proposed and accepted)."""


@dataclass
class DecodeStats:
    """What one generation measured."""

    new_tokens: int = 0
    target_forwards: int = 0  # verify (or plain decode) forwards, prefill excluded
    accepted: list[int] = field(default_factory=list)
    """Per round: proposed tokens accepted and kept (none past a stop token or the token limit, which
    the reply drops: with the round's last token, its tokens in the reply; a round cut short that way is
    recorded in ``depths`` as proposing only what it kept)."""
    proposed: int = 0  # the deepest proposal of any round (K), for acceptance per position
    depths: list[int] = field(default_factory=list)  # depth proposed per round (K, or the adaptive choice)
    contexts: list[int] = field(default_factory=list)  # per round: tokens before its first drafted token
    sources: list[tuple[int, int, int]] = field(default_factory=list)
    """Per round: accepted tokens proposed by the draft only, the lookup only, and both."""
    lookup: list[int] = field(default_factory=list)  # per round: the lookup's branch length (0: no match)
    lookup_match: list[int] = field(default_factory=list)  # per round: its match length (0: none)
    first: list[tuple[float | None, bool | None, bool | None]] = field(default_factory=list)
    """Per round: the draft's probability of its first token (None: no draft token), whether the target's
    first token was the draft's first, and whether it was the lookup's first (None: no proposal)."""
    seconds_prefill: float = 0.0
    seconds_draft: float = 0.0
    seconds_verify: float = 0.0
    seconds_total: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per verify forward, the bonus token included (1.0 for plain decoding)."""
        return served_tau(self.accepted)

    def accepted_by(self) -> dict[str, int]:
        """Accepted tokens by who proposed them: draft, lookup, both; and the rounds with a lookup branch."""
        return {**accepted_by_source(self.sources), "lookup_rounds": sum(1 for n in self.lookup if n)}

    def acceptance_per_position(self) -> list[float]:
        """Share of the rounds proposing a token at depth i (1-based) in which it was accepted."""
        return acceptance_per_position(self.accepted, self.depths or [self.proposed] * len(self.accepted),
                                       self.proposed)

    def as_dict(self) -> dict[str, Any]:
        decode = self.seconds_total - self.seconds_prefill
        return {
            "new_tokens": self.new_tokens, "target_forwards": self.target_forwards, "tau": round(self.tau, 4),
            "accept_per_pos": [round(x, 4) for x in self.acceptance_per_position()],
            "ttft_s": round(self.seconds_prefill, 4), "seconds": round(self.seconds_total, 4),
            "tokens_per_s": round(self.new_tokens / self.seconds_total, 2) if self.seconds_total else None,
            "draft_s": round(self.seconds_draft, 4), "verify_s": round(self.seconds_verify, 4),
            "other_s": round(max(decode - self.seconds_draft - self.seconds_verify, 0.0), 4),
            "accepted_by": self.accepted_by(),
        }


class StateTape:
    """The target states of every token a generation fed, as its forwards computed them (the
    prefill's rows, then each round's newest token and accepted nodes): what a harvest of the served
    sequence stores, taken without another target forward (:mod:`serve_eval.capture`)."""

    def __init__(self) -> None:
        self.aux: list[Tensor] = []  # [R, A, H] per forward
        self.last: list[Tensor] = []  # [R, H]

    def add(self, aux: Tensor, last: Tensor) -> None:
        """Rows of one forward: ``aux`` [1, R, A, H] and ``last`` [1, R, H] (copied: a static cache's
        outputs are overwritten by its next forward)."""
        self.aux.append(aux[0].clone())
        self.last.append(last[0].clone())

    def rows(self, n: int) -> tuple[Tensor, Tensor]:
        """The first ``n`` fed tokens' states: aux [n, A, H] and last [n, H], fp32 on the host."""
        aux, last = torch.cat(self.aux)[:n], torch.cat(self.last)[:n]
        if aux.shape[0] < n:
            raise ValueError(f"the tape holds {aux.shape[0]} rows, {n} asked")
        return aux.float().cpu(), last.float().cpu()


@dataclass
class Generation:
    tokens: list[int]
    stats: DecodeStats
    states: tuple[Tensor, Tensor] | None = None
    """With ``capture``: aux [T - 1, A, H] and last [T - 1, H] of the prompt and every emitted token but
    the last one (never fed to the target), fp32."""


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions of an HF cache (transformers 5 crops by a negative count)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def keep_accepted(cache: Any, prefix: int, path: list[int]) -> None:
    """Keep the first ``prefix`` positions of an HF cache and then the verified nodes ``path``
    (ascending node indices; node i sits at position prefix + i), in place.

    A chain's path is 0..a-1, a plain crop. A tree's path is moved down entry by entry: node
    path[i] >= i, so copying in increasing i never overwrites a source still to be read. A static
    cache moves the path's entries down in place (:meth:`StaticKV.keep_path`).
    """
    if isinstance(cache, StaticKV):
        cache.keep_path(prefix, path)
        return
    chain = path == list(range(len(path)))
    if not chain:
        for layer in cache.layers:
            for i, node in enumerate(path):
                if node != i:
                    layer.keys[..., prefix + i, :] = layer.keys[..., prefix + node, :]
                    layer.values[..., prefix + i, :] = layer.values[..., prefix + node, :]
    crop_cache(cache, prefix + len(path))


class SpeculativeDecoder:
    """Batch-1 generation with a target and a draft of any family (or without, for the baseline)."""

    def __init__(self, target: Target, draft: DraftHead | None, config: SpecConfig = SpecConfig()) -> None:
        self.target, self.draft, self.config = target, draft, config
        self.device = target.device
        self._static: StaticKV | None = None  # the target's static cache, kept between generations
        if config.target_cache != "dynamic":
            check_static_target(target, config.target_cache)
            self._static = StaticKV(target, graphs=config.target_cache == "graphs")
        self.proposer: Proposer | None = None
        self.lookup_policy = LookupPolicy()
        """Sizes the lookup's branches (its token cost is 0 until told the machine's: :meth:`cost_lookup`)."""
        if config.proposer == "hybrid" and draft is None:
            raise ConfigError("proposer=hybrid needs a draft (proposer=lookup speculates without one)")
        self.set_draft(draft)

    def set_draft(self, draft: DraftHead | None) -> None:
        """Serve ``draft`` from the next generation on (checked against the target first; the decoder
        keeps everything else: its target cache, its lookup policy)."""
        target, config = self.target, self.config
        proposer = None
        if draft is not None and config.uses_draft:
            c = draft.config
            if c.target_hidden_size != target.hidden_size or c.vocab_size != target.vocab_size:
                raise ConfigError(f"draft (target_hidden_size {c.target_hidden_size}, vocab {c.vocab_size}) does "
                                 f"not fit the target (hidden {target.hidden_size}, vocab {target.vocab_size})")
            if c.num_aux_layers != len(target.aux_layer_ids):
                raise ConfigError(f"draft reads {c.num_aux_layers} aux states, the target captures "
                                 f"{len(target.aux_layer_ids)} layers {list(target.aux_layer_ids)}")
            family = family_of(c)
            # under graphs a family that drafts step by step replays its steps over a static draft cache
            replayed = config.target_cache == "graphs" and family.replays_steps
            proposer = family.proposer(draft, StaticDraftKV(draft) if replayed else DraftKV(draft), config)
        self.draft, self.proposer = draft, proposer

    # -- helpers

    def target_cache(self, slots: int) -> Any:
        """An empty target cache of the configured kind, for up to ``slots`` positions (a static one is
        the decoder's own, emptied: one generation at a time)."""
        if self._static is None:
            from transformers import DynamicCache

            return DynamicCache()
        return self._static.start(slots)

    def _target(self, ids: list[int], cache: Any, positions: list[int] | None = None,
                mask: Tensor | None = None) -> Any:
        if isinstance(cache, StaticKV):  # the next slots (a tree: its positions, its mask over every slot)
            return cache.forward(ids, positions, mask)
        x = torch.tensor([ids], device=self.device)
        if positions is None:
            return self.target(x, past_key_values=cache, use_cache=True)
        return self.target(x, attention_mask=mask, past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([positions], device=self.device))

    # -- generation

    def cost_lookup(self, verify: Sequence[float]) -> None:
        """Price the lookup's extra verified tokens from a measured cost model's verify times (seconds
        over 1, 2, .. tokens, fitted linear: :class:`serve_eval.adaptive.CostModel`): the cost of one
        more verified token over one plain step's."""
        slope = (verify[-1] - verify[0]) / max(len(verify) - 1, 1)
        self.lookup_policy.token_cost = max(slope, 0.0) / verify[0]

    @property
    def max_depth(self) -> int:
        """The deepest node a round can propose (per-position acceptance is counted up to it)."""
        k = self.config.k if self.proposer is not None else 0
        return max(k, self.config.lookup_k) if self.config.uses_lookup else k

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids: set[int] | frozenset[int] = frozenset(),
                 params: SamplingConfig = SamplingConfig(), seed: int = 0, speculate: bool = True,
                 policy: DepthPolicy | None = None,
                 on_tokens: Callable[[list[int]], bool] | None = None,
                 shared: SharedLookup | None = None, capture: bool = False) -> Generation:
        """Generate up to ``max_new_tokens`` after ``prompt`` (stopping after a stop id).

        ``policy`` (chains only) picks each round's draft depth, 0..K (0: no draft tokens, the draft
        still catching up) and is told what was accepted. ``on_tokens`` is called with each round's
        new tokens; returning False ends the generation there (a stop string, a client gone).
        ``shared``: recent replies of other requests the lookup may continue from where this
        request's own context has no match (the server's). ``capture``: keep the target states of
        every fed token (:attr:`Generation.states`), from the forwards the generation runs anyway."""
        if not prompt:
            raise ValueError("empty prompt")
        if policy is not None and self.config.mode != "chain":
            raise ConfigError("an adaptive depth policy needs mode=chain")
        cfg = self.config
        proposer = self.proposer if speculate else None
        lookup = LookupIndex(cfg.lookup_min, cfg.lookup_max) if speculate and cfg.uses_lookup else None
        g = torch.Generator(device=self.device).manual_seed(seed)  # sampling happens where the logits are
        stats = DecodeStats(proposed=self.max_depth if speculate else 0)
        synchronize(self.device)
        start = time.perf_counter()
        cache = self.target_cache(len(prompt) + max_new_tokens + self._extra_slots(target=True))
        out = self._target(prompt, cache)
        tape = StateTape() if capture else None
        if tape is not None:
            tape.add(out.aux, out.last)
        emitted = [self._pick(out.logits[0, -1], params, g)]
        stats.seconds_prefill = time.perf_counter() - start
        going = on_tokens is None or on_tokens(list(emitted)) is not False
        n = len(prompt)  # tokens in the target's cache (the newest emitted one is not)
        if proposer is not None:
            proposer.start(len(prompt) + max_new_tokens + self._extra_slots(target=False))
        if lookup is not None:
            lookup.extend(prompt + emitted)
        # rows the target verified, not yet run through the draft: (aux [1, R, A, H], the token after
        # each); run right before the next proposal, so a round at depth 0 costs no draft step
        pending: list[tuple[Tensor, list[int]]] = [(out.aux, prompt[1:] + emitted)] if proposer else []
        while going and len(emitted) < max_new_tokens and emitted[-1] not in stop_ids:
            if proposer is None and lookup is None:
                new = self._plain_step(emitted[-1], cache, params, g, stats, tape)
                n += len(new)
            else:
                t0 = time.perf_counter()
                k = cfg.k if policy is None else min(max(policy.choose(), 0), cfg.k)
                proposal = Proposal([], [])
                if proposer is not None and k > 0:  # draft: catch up on the pending rows, then propose
                    aux, tokens = torch.cat([a for a, _ in pending], dim=1), [t for _, ts in pending for t in ts]
                    pending.clear()
                    proposal = proposer.propose(aux, tokens, n - len(tokens), k, params, g)
                tree, found = self._round_tree(proposal, lookup, shared, max_new_tokens - len(emitted) - 1)
                synchronize(self.device)
                stats.seconds_draft += time.perf_counter() - t0
                out, acc = self._verify(emitted[-1], tree, proposal.qs, n, cache, params, g, stats)  # verify, accept
                path = acc.path if acc.path is not None else list(range(acc.accepted))
                depth = max(tree_depths(tree.parents), default=0)
                # the tokens this forward gives the reply: accepted ones past a stop token or the token
                # limit are dropped, so they are not counted (the bonus's place goes to the last kept)
                kept_tokens = _until_stop(acc.tokens[:max_new_tokens - len(emitted)], stop_ids)
                counted = len(kept_tokens) - 1
                cut = counted < acc.accepted  # then the round is reported as one that proposed what was kept
                stats.accepted.append(counted if cut else acc.accepted)
                stats.contexts.append(n + 1)  # the prompt and every emitted token, the newest not yet cached
                stats.depths.append(counted if cut else depth)
                branch = sum(1 for s in tree.sources if s & LOOKUP)
                stats.lookup.append(branch)
                stats.lookup_match.append(found.match if found is not None else 0)
                if found is not None:
                    taken = next((i for i, node in enumerate(path) if not tree.sources[node] & LOOKUP), len(path))
                    self.lookup_policy.observe(found.match, acc.tokens[0] == found.tokens[0], branch, taken)
                stats.first.append((proposal.first_p,
                                    acc.tokens[0] == proposal.tokens[0] if proposal.tokens else None,
                                    acc.tokens[0] == found.tokens[0] if found is not None else None))
                by = [tree.sources[i] for i in path[:counted]]
                stats.sources.append((by.count(DRAFT), by.count(LOOKUP), by.count(DRAFT | LOOKUP)))
                if policy is not None:
                    policy.observe(depth, acc.accepted, stats.depths[-1], stats.accepted[-1])
                if tape is not None:
                    kept = [0, *(1 + p for p in path)]
                    tape.add(out.aux[:, kept], out.last[:, kept])
                keep_accepted(cache, n + 1, path)  # roll back the target and the draft
                if proposer is not None:
                    proposer.rollback(n - sum(len(ts) for _, ts in pending))
                    pending.append((out.aux[:, [0, *(1 + p for p in path)]], acc.tokens))  # x and the accepted nodes
                n += len(acc.tokens)  # x and the accepted nodes are cached now; the last new token is not
                new = kept_tokens  # a plain step's one token needs no cut: the loop runs while there is room
            emitted += new
            if lookup is not None:
                lookup.extend(new)
            going = on_tokens is None or on_tokens(new) is not False
        stats.new_tokens = len(emitted)
        synchronize(self.device)
        stats.seconds_total = time.perf_counter() - start
        states = tape.rows(len(prompt) + len(emitted) - 1) if tape is not None else None
        return Generation(emitted, stats, states)

    def _round_tree(self, proposal: Proposal, lookup: LookupIndex | None, shared: SharedLookup | None,
                    room: int) -> tuple[Merged, Continuation | None]:
        """The round's verification tree: the draft's proposal, with the lookup's continuation (its own
        context first, then ``shared``) merged in, at most ``room`` tokens deep on the lookup's side and
        within a tree's budget; and that continuation (None: no match)."""
        cfg = self.config
        found = None
        if lookup is not None and room > 0:
            limit = min(cfg.lookup_k, room)
            found = lookup.propose(limit, cfg.lookup_scale)
            if found is None and shared is not None:
                found = shared.propose(lookup.tokens[-MATCH_CAP:], limit, cfg.lookup_scale)
        branch = found.tokens[:self.lookup_policy.length(found.match, len(found.tokens))] if found is not None else []
        merged = merge_branch(proposal.tokens, proposal.parents, branch)
        if cfg.mode == "tree" and self.proposer is not None:
            merged = fit_budget(merged, cfg.budget)
        return merged, found

    def _extra_slots(self, target: bool) -> int:
        """Cache rows beyond prompt + new tokens: a round's proposal (a tree's nodes in the target's
        cache; a tree's expansions, topk rows per depth, in the draft's), and one more."""
        cfg = self.config
        k, tree = cfg.k, cfg.mode == "tree"
        lookup = cfg.lookup_k if cfg.uses_lookup else 0
        if not tree:
            return k + lookup + 1
        return max(cfg.budget if target else (k - 1) * cfg.topk, k, lookup) + 1

    def _plain_step(self, x: int, cache: Any, params: SamplingConfig, g: torch.Generator | None,
                    stats: DecodeStats, tape: StateTape | None = None) -> list[int]:
        """One target step without a draft (the baseline)."""
        t0 = time.perf_counter()
        out = self._target([x], cache)
        if tape is not None:
            tape.add(out.aux, out.last)
        synchronize(self.device)
        stats.seconds_verify += time.perf_counter() - t0
        stats.target_forwards += 1
        return [self._pick(out.logits[0, -1], params, g)]

    def _verify(self, x: int, tree: Merged, qs: Tensor | None, n: int, cache: Any, params: SamplingConfig,
                g: torch.Generator | None, stats: DecodeStats) -> tuple[Any, Acceptance]:
        """One target forward over ``x`` and the round's nodes (a chain, or a tree under its mask),
        then acceptance: greedy, or speculative sampling against the draft's distributions ``qs``
        where the round is the draft's own sampled chain (else each node's token is tried against
        the target's residual distribution, which is exact for any candidates)."""
        tokens, parents = tree.tokens, tree.parents
        chain = tree.is_chain
        t0 = time.perf_counter()
        if not chain:  # each node sees the prefix, x and its ancestors, at position n + depth
            m = len(tokens) + 1
            width = cache.slots if isinstance(cache, StaticKV) else n + m  # a static cache: every slot
            mask = torch.zeros(m, width, dtype=torch.bool)  # built on the host, moved once
            mask[:, : n + 1] = True
            mask[1:, n + 1:n + m] = tree_attention_mask(parents)  # [N, N]
            mask = mask.to(self.device)
            positions = [n, *(n + depth for depth in tree_depths(parents))]
            out = self._target([x, *tokens], cache, positions, mask[None, None])
        else:  # a chain is plain causal attention
            out = self._target([x, *tokens], cache)
        synchronize(self.device)
        stats.seconds_verify += time.perf_counter() - t0
        stats.target_forwards += 1
        logits = out.logits[0]  # [1 + N, V]
        if params.greedy:
            acc = greedy_chain(tokens, logits) if chain else greedy_tree(tokens, parents, logits)
        else:
            probs = target_probs(logits, params)
            if chain and tree.added == 0 and (qs is not None or not tokens):
                acc = sample_chain(tokens, qs, probs, g)
            else:
                acc = sample_tree(tokens, parents, probs, g)
        return out, acc

    @staticmethod
    def _pick(logits: Tensor, params: SamplingConfig, g: torch.Generator | None) -> int:
        if params.greedy:
            return int(logits.argmax())
        return int(torch.multinomial(target_probs(logits, params), 1, generator=g))


def _until_stop(tokens: list[int], stop_ids: set[int] | frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first stop id."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens


__all__ = ["DecodeStats", "DepthPolicy", "Generation", "SpeculativeDecoder", "StateTape", "crop_cache",
           "keep_accepted"]
