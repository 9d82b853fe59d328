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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from eagle3.config import SamplingConfig
from eagle3.device import synchronize
from eagle3.draft import Eagle3Draft, KVCache
from eagle3.metrics import acceptance_per_position, served_tau
from eagle3.target import Target
from serve_eval.config import SpecConfig
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

    def observe(self, depth: int, accepted: int) -> None: ...


@dataclass
class DecodeStats:
    """What one generation measured."""

    new_tokens: int = 0
    target_forwards: int = 0  # verify (or plain decode) forwards, prefill excluded
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per round
    proposed: int = 0  # the deepest proposal of any round (K), for acceptance per position
    depths: list[int] = field(default_factory=list)  # depth proposed per round (K, or the adaptive choice)
    seconds_prefill: float = 0.0
    seconds_draft: float = 0.0
    seconds_verify: float = 0.0
    seconds_total: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per verify forward, the bonus token included (1.0 for plain decoding)."""
        return served_tau(self.accepted)

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
        }


@dataclass
class Generation:
    tokens: list[int]
    stats: DecodeStats


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

    def __init__(self, target: Target, draft: Eagle3Draft | None, config: SpecConfig = SpecConfig()) -> None:
        self.target, self.draft, self.config = target, draft, config
        if draft is not None:
            c = draft.config
            if c.target_hidden_size != target.hidden_size or c.vocab_size != target.vocab_size:
                raise ValueError(f"draft (target_hidden_size {c.target_hidden_size}, vocab {c.vocab_size}) does "
                                 f"not fit the target (hidden {target.hidden_size}, vocab {target.vocab_size})")
            if c.family != "eagle3" and config.mode != "chain":
                raise ValueError(f"a {c.family} draft proposes a chain in one forward: mode=tree is not supported")
            if c.family == "dflash" and config.k > c.block_size - 1:
                raise ValueError(f"k={config.k}: the DFlash draft's block proposes at most {c.block_size - 1} tokens")
            if c.num_aux_layers != len(target.aux_layer_ids):
                raise ValueError(f"draft reads {c.num_aux_layers} aux states, the target captures "
                                 f"{len(target.aux_layer_ids)} layers {list(target.aux_layer_ids)}")
        self.device = target.device
        self._static: StaticKV | None = None  # the target's static cache, kept between generations
        if config.target_cache != "dynamic":
            check_static_target(target, config.target_cache)
            self._static = StaticKV(target, graphs=config.target_cache == "graphs")
        # an EAGLE-3 draft's steps (a chain's, a tree's expansions) replayed as well (a parallel family
        # drafts in one forward)
        self._draft_static = (StaticDraftKV(draft) if config.target_cache == "graphs" and draft is not None
                              and draft.config.family == "eagle3" else None)

    # -- helpers

    def target_cache(self, slots: int) -> Any:
        """An empty target cache of the configured kind, for up to ``slots`` positions (a static one is
        the decoder's own, emptied: one generation at a time)."""
        if self._static is None:
            from transformers import DynamicCache

            return DynamicCache()
        return self._static.start(slots)

    def draft_cache(self, slots: int) -> KVCache | StaticDraftKV:
        """An empty draft cache for up to ``slots`` positions: static (the decoder's own) under graphs."""
        return KVCache() if self._draft_static is None else self._draft_static.start(slots)

    def _draft_step(self, token: int, state: Tensor, position: int, cache: Any) -> tuple[Tensor, Tensor]:
        """One EAGLE-3 draft step -> (state [1, 1, H], logits [1, Vd])."""
        ids, pos = torch.tensor([[token]], device=self.device), torch.tensor([[position]], device=self.device)
        if isinstance(cache, StaticDraftKV):
            return cache.step(ids, state, pos)
        state, logits = self.draft(ids, state, pos, cache)
        return state, logits[:, -1]

    def _target(self, ids: list[int], cache: Any, positions: list[int] | None = None,
                mask: Tensor | None = None) -> Any:
        if isinstance(cache, StaticKV):  # the next slots (a tree: its positions, its mask over every slot)
            return cache.forward(ids, positions, mask)
        x = torch.tensor([ids], device=self.device)
        if positions is None:
            return self.target(x, past_key_values=cache, use_cache=True)
        return self.target(x, attention_mask=mask, past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([positions], device=self.device))

    def _draft_rows(self, aux: Tensor, tokens: list[int], start: int, cache: KVCache,
                    masks: int = 0) -> tuple[Tensor, Tensor]:
        """Catch-up rows start.. from target aux [1, R, A, H] and the token after each -> last (state,
        logits [1, Vd]). With ``masks`` (P-EAGLE) that many mask rows follow in the same forward (they
        stay in ``cache`` until the round's rollback) and the logits are the last row's and theirs,
        [1 + masks, Vd]: one per draft token. A DFlash draft adds the rows' context to ``cache`` and
        runs its whole trained block; logits of the first ``masks`` mask slots, [masks, Vd]."""
        d = self.draft
        assert d is not None
        if d.config.family == "dflash":  # context keys into the cache, then the trained block [bonus, masks]
            end, size = start + len(tokens), d.config.block_size
            d.add_context(aux, torch.arange(start, end, device=self.device)[None], cache)
            block = torch.tensor([[tokens[-1]] + [d.config.mask_token_id] * (size - 1)], device=self.device)
            logits = d.propose(block, torch.arange(end, end + size, device=self.device)[None], cache)
            return logits[:, :0], logits[0, 1:1 + masks]  # no state; [masks, Vd]: the first masks slots
        hidden = d.combine_aux(aux.to(d.fc.weight.dtype))  # [1, R, H]
        ids = torch.tensor([tokens], device=self.device)
        if masks:
            mask_ids, mask_states = d.mask_inputs((1, masks), hidden.dtype, self.device)
            hidden, ids = torch.cat([hidden, mask_states], dim=1), torch.cat([ids, mask_ids], dim=1)
        pos = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        state, logits = d(ids, hidden, pos, cache)
        return state[:, -1:], logits[0, -1 - masks:]  # [1, 1, H], [1 + masks, Vd]

    def _draft_target_logits(self, logits: Tensor) -> Tensor:
        """Draft-vocab logits [.., Vd] -> target-vocab logits [.., V] (-inf outside the draft vocab)."""
        d = self.draft
        assert d is not None
        out = logits.new_full((*logits.shape[:-1], d.config.vocab_size), float("-inf"))
        out[..., d.draft_to_target_ids(torch.arange(logits.shape[-1], device=logits.device))] = logits
        return out

    # -- proposals

    def _propose_chain(self, root_state: Tensor, root_logits: Tensor, n: int, cache: KVCache,
                       params: SamplingConfig, g: torch.Generator | None,
                       context: list[int], k: int) -> tuple[list[int], list[int], Tensor | None]:
        """k draft tokens (parents -1, 0, 1, ...) and, when sampling, their proposal
        distributions [k, V]. ``context``: prompt + emitted tokens (unused by the EAGLE draft)."""
        d = self.draft
        assert d is not None
        tokens, qs = [], []
        state, logits = root_state, root_logits
        for depth in range(1, k + 1):
            full = self._draft_target_logits(logits[0])  # [V]
            if params.greedy:
                token = int(full.argmax())
            else:
                q = torch.softmax(full.float() / params.temperature, dim=-1)
                qs.append(q)
                token = int(torch.multinomial(q, 1, generator=g))
            tokens.append(token)
            if depth < k:
                state, logits = self._draft_step(token, state, n - 1 + depth, cache)
        return tokens, list(range(-1, len(tokens) - 1)), (torch.stack(qs) if qs else None)

    def _propose_parallel(self, logits: Tensor, params: SamplingConfig, g: torch.Generator | None,
                          context: list[int]) -> tuple[list[int], list[int], Tensor | None]:
        """Parallel families: the draft tokens from one forward's rows, logits [k, Vd], each drawn on its own
        (a proposal need not depend on the earlier draft tokens to stay lossless: verification only
        needs the distribution each token was drawn from). ``context``: unused, as in the chain."""
        full = self._draft_target_logits(logits)  # [k, V]
        if params.greedy:
            tokens = full.argmax(-1).tolist()
            qs = None
        else:
            qs = torch.softmax(full.float() / params.temperature, dim=-1)  # [k, V]
            tokens = torch.multinomial(qs, 1, generator=g)[:, 0].tolist()
        return tokens, list(range(-1, len(tokens) - 1)), qs

    def _propose_tree(self, root_state: Tensor, root_logits: Tensor, n: int, cache: KVCache | StaticDraftKV,
                      context: list[int]) -> tuple[list[int], list[int]]:
        """EAGLE-2 dynamic tree: deterministic top-k children, expanded by cumulative log-prob."""
        d = self.draft
        assert d is not None
        topk, past = self.config.topk, len(cache)
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        cache_row: dict[int, int] = {}  # node -> its row in the draft cache (expanded nodes only)
        frontier = [(-1, root_state[0, 0], root_logits[0], 0.0)]  # (node, state [H], logits [Vd], score)
        for depth in range(1, self.config.k + 1):
            children = []
            # every frontier node's top-k in one pass (one read back to the host per depth)
            logp = torch.log_softmax(self._draft_target_logits(torch.stack([f[2] for f in frontier])).float(), dim=-1)
            best = logp.topk(topk, dim=-1)  # [F, topk]
            values, ids = torch.stack([best.values.double(), best.indices.double()]).tolist()  # exact in float64
            for (node, _state, _logits, score), lps, row_ids in zip(frontier, values, ids, strict=True):
                for lp, token in zip(lps, row_ids, strict=True):
                    tokens.append(int(token))
                    parents.append(node)
                    scores.append(score + lp)
                    children.append(len(tokens) - 1)
            if depth == self.config.k:
                break
            # expand the best `topk` of this depth's nodes in one draft forward (tree mask)
            chosen = sorted(children, key=lambda i: -scores[i])[:topk]
            rows = len(cache)
            width = cache.slots if isinstance(cache, StaticDraftKV) else rows + len(chosen)  # static: every slot
            mask = torch.zeros(len(chosen), width, dtype=torch.bool)  # built on the host, moved once
            mask[:, :past] = True
            for r, node in enumerate(chosen):
                mask[r, rows + r] = True
                ancestor = parents[node]
                while ancestor >= 0:
                    mask[r, cache_row[ancestor]] = True
                    ancestor = parents[ancestor]
            mask = mask.to(self.device)
            fed = {node: state for node, state, _, _ in frontier}  # a child is fed its parent's output state
            states = torch.stack([fed[parents[node]] for node in chosen])[None]  # [1, C, H]
            ids = torch.tensor([[tokens[i] for i in chosen]], device=self.device)
            pos = torch.full((1, len(chosen)), n - 1 + depth, device=self.device)
            if isinstance(cache, StaticDraftKV):
                new_states, new_logits = cache.tree_step(ids, states, pos, mask)
            else:
                new_states, new_logits = d(ids, states, pos, cache, attn_mask=mask)
            for r, node in enumerate(chosen):
                cache_row[node] = rows + r
            frontier = [(node, new_states[0, r], new_logits[0, r], scores[node]) for r, node in enumerate(chosen)]
        # keep the best `budget` nodes; a child never outscores its parent, so ancestors stay
        keep = sorted(sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[: self.config.budget])
        index = {old: new for new, old in enumerate(keep)}
        return [tokens[i] for i in keep], [index[parents[i]] if parents[i] >= 0 else -1 for i in keep]

    # -- generation

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids: set[int] | frozenset[int] = frozenset(),
                 params: SamplingConfig = SamplingConfig(), seed: int = 0, speculate: bool = True,
                 policy: DepthPolicy | None = None,
                 on_tokens: Callable[[list[int]], bool] | None = None) -> Generation:
        """Generate up to ``max_new_tokens`` after ``prompt`` (stopping after a stop id).

        ``policy`` (chains only) picks each round's depth, 0..K (0: a plain target step, the
        draft still catching up) and is told what was accepted. ``on_tokens`` is called with each
        round's new tokens; returning False ends the generation there (a stop string, a client
        gone)."""
        if not prompt:
            raise ValueError("empty prompt")
        if policy is not None and self.config.mode != "chain":
            raise ValueError("an adaptive depth policy needs mode=chain")
        speculate = speculate and self.draft is not None
        g = torch.Generator(device=self.device).manual_seed(seed)  # sampling happens where the logits are
        stats = DecodeStats(proposed=self.config.k if speculate else 0)
        synchronize(self.device)
        start = time.perf_counter()
        k, tree = self.config.k, self.config.mode == "tree"
        cache = self.target_cache(len(prompt) + max_new_tokens + max(self.config.budget if tree else 0, k) + 1)
        out = self._target(prompt, cache)
        first = self._pick(out.logits[0, -1], params, g)
        stats.seconds_prefill = time.perf_counter() - start
        emitted = [first]
        n = len(prompt)
        going = on_tokens is None or on_tokens([first]) is not False
        # a tree's expansions add topk rows per depth after the catch-up
        draft_cache = self.draft_cache(len(prompt) + max_new_tokens + max((k - 1) * self.config.topk if tree else 0,
                                                                           k) + 1)
        root = None
        # Catch-up rows not yet run through the draft: (aux [1, R, A, H], the token after each).
        # They are run in one draft forward right before the next proposal, so rounds that do
        # not speculate (depth 0) cost no draft step.
        pending: list[tuple[Tensor, list[int]]] = [(out.aux, prompt[1:] + [first])] if speculate else []
        caught_up = 0  # rows in the draft cache

        while going and len(emitted) < max_new_tokens and emitted[-1] not in stop_ids:
            x = emitted[-1]
            if not speculate:
                t0 = time.perf_counter()
                out = self._target([x], cache)
                synchronize(self.device)
                stats.seconds_verify += time.perf_counter() - t0
                stats.target_forwards += 1
                emitted.append(self._pick(out.logits[0, -1], params, g))
                n += 1
                going = on_tokens is None or on_tokens(emitted[-1:]) is not False
                continue
            t0 = time.perf_counter()
            tree = self.config.mode == "tree"
            k = self.config.k if policy is None else min(max(policy.choose(), 0), self.config.k)
            family = self.draft.config.family
            parallel = k > 0 and family != "eagle3"
            if k > 0 and pending:
                aux_rows = torch.cat([a for a, _ in pending], dim=1)  # [1, R, A, H]
                row_tokens = [t for _, ts in pending for t in ts]
                masks = k if family == "dflash" else k - 1 if parallel else 0
                root = self._draft_rows(aux_rows, row_tokens, caught_up, draft_cache, masks)
                caught_up += len(row_tokens)
                pending.clear()
            tokens, parents, qs = [], [], None
            if k > 0:
                assert root is not None and caught_up == n
                if parallel:  # every round catches up (pending is never empty then): root holds k rows
                    tokens, parents, qs = self._propose_parallel(root[1], params, g, prompt + emitted)
                elif tree:
                    tokens, parents = self._propose_tree(root[0], root[1], n, draft_cache, prompt + emitted)
                else:
                    tokens, parents, qs = self._propose_chain(root[0], root[1], n, draft_cache, params, g,
                                                              prompt + emitted, k)
            synchronize(self.device)
            stats.seconds_draft += time.perf_counter() - t0

            out, acc = self._verify(x, tokens, parents, qs, n, cache, params, g, stats)
            path = acc.path if acc.path is not None else list(range(acc.accepted))
            stats.accepted.append(acc.accepted)
            stats.depths.append(max(tree_depths(parents), default=0) if tree else len(tokens))
            if policy is not None:
                policy.observe(len(tokens), acc.accepted)
            room = max_new_tokens - len(emitted)
            new = acc.tokens[:room]
            for i, token in enumerate(new):
                if token in stop_ids:
                    new = new[: i + 1]
                    break
            emitted += new
            going = on_tokens is None or on_tokens(new) is not False

            keep_accepted(cache, n + 1, path)
            draft_cache.truncate(caught_up)  # the proposals' rows go
            pending.append((out.aux[:, [0, *(1 + p for p in path)]], acc.tokens))  # x and the accepted nodes
            n += 1 + len(path)
        stats.new_tokens = len(emitted)
        synchronize(self.device)
        stats.seconds_total = time.perf_counter() - start
        return Generation(emitted, stats)

    def _verify(self, x: int, tokens: list[int], parents: list[int], qs: Tensor | None, n: int, cache: Any,
                params: SamplingConfig, g: torch.Generator | None, stats: DecodeStats) -> tuple[Any, Acceptance]:
        """One target forward over ``x`` and the proposal (a chain, or a tree under its mask), then
        acceptance: greedy, or speculative sampling against the proposal's distributions ``qs``."""
        tree = self.config.mode == "tree"
        t0 = time.perf_counter()
        if tree:  # each node sees the prefix, x and its ancestors, at position n + depth
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
            acc = greedy_tree(tokens, parents, logits) if tree else greedy_chain(tokens, logits)
        else:
            probs = target_probs(logits, params)
            acc = sample_tree(tokens, parents, probs, g) if tree else sample_chain(tokens, qs, probs, g)
        return out, acc

    @staticmethod
    def _pick(logits: Tensor, params: SamplingConfig, g: torch.Generator | None) -> int:
        if params.greedy:
            return int(logits.argmax())
        return int(torch.multinomial(target_probs(logits, params), 1, generator=g))


__all__ = ["DecodeStats", "DepthPolicy", "Generation", "SpeculativeDecoder", "crop_cache",
           "keep_accepted"]
