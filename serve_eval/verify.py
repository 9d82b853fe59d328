"""Verification and acceptance for speculative decoding: pure functions over logits.

Lossless means the emitted tokens are distributed exactly as the target would sample them
alone (greedy: equal to its argmax). Everything here works on the target's logits for the
positions the verify forward computed, so it is tested with stub logits.

Chain (K draft tokens d_1..d_K after the last emitted token x)::

    verify input   x    d_1   d_2  ...  d_K
    target logits  L_0  L_1   L_2  ...  L_K      L_i is the distribution of the token after input i

    greedy: accept d_i while d_i == argmax L_{i-1}; then emit argmax L_a (the bonus) -> a + 1 tokens.
    sampling: accept d_i with probability min(1, p_{i-1}(d_i) / q_i(d_i)); at the first rejection
    emit a sample of norm(max(p - q, 0)); if all K are accepted, emit a sample of p_K.

Tree (EAGLE-2 style; node i has a parent, -1 is the root = the last emitted token)::

    verify input   root  n_0  n_1 ... n_{N-1}    (tree attention: each node sees its ancestors)
    target logits  L_r   L_0  L_1 ... L_{N-1}

    greedy: from the root, move to the child whose token is the argmax of the current node's
    logits, as long as one exists; emit the argmax at the node where the walk stops (bonus).
    sampling (deterministic candidates, e.g. top-k children): try the children in order, each
    accepted with probability p(token) under the current residual distribution p; a rejected
    token is removed from p (p <- norm(p with it zeroed)). Emitting child c thus has probability
    p(c) exactly, whatever the candidate list, so the output is the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from eagle3.config import SamplingConfig


def target_probs(logits: Tensor, params: SamplingConfig) -> Tensor:
    """[..., V] logits -> the distribution plain sampling draws from (temperature, top-k, top-p)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = scores.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        keep_sorted = before < params.top_p  # the smallest set reaching top_p (always the top token)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _sample(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


# ---------------------------------------------------------------- chain


@dataclass(frozen=True)
class Acceptance:
    accepted: int
    """Draft tokens accepted (chain: a prefix length; tree: the depth of the accepted path)."""
    tokens: list[int]
    """Tokens to emit: the accepted draft tokens, then the bonus/correction token."""
    path: list[int] | None = None
    """Tree only: the accepted node indices, root's child first."""


def greedy_chain(draft_tokens: Sequence[int], logits: Tensor) -> Acceptance:
    """draft_tokens [K], logits [K+1, V] of the verify forward -> accepted prefix + bonus."""
    best = logits.argmax(-1).tolist()  # [K+1]
    a = 0
    while a < len(draft_tokens) and draft_tokens[a] == best[a]:
        a += 1
    return Acceptance(a, [*draft_tokens[:a], best[a]])


def sample_chain(draft_tokens: Sequence[int], draft_probs: Tensor, probs: Tensor,
                 generator: torch.Generator | None = None) -> Acceptance:
    """Speculative sampling over a chain.

    draft_tokens [K] drawn from draft_probs [K, V] (the proposal q_i, over the target vocab);
    probs [K+1, V]: the target's processed distributions (:func:`target_probs`).
    """
    for i, token in enumerate(draft_tokens):
        p, q = probs[i], draft_probs[i]
        ratio = (p[token] / q[token]).item() if q[token] > 0 else float("inf")
        if torch.rand((), generator=generator, device=p.device).item() < min(1.0, ratio):
            continue
        residual = (p - q).clamp_min(0)
        total = residual.sum()
        # p == q on the support: a rejection has probability 0; numerically fall back to p
        return Acceptance(i, [*draft_tokens[:i], _sample(residual / total if total > 0 else p, generator)])
    k = len(draft_tokens)
    return Acceptance(k, [*draft_tokens, _sample(probs[k], generator)])


# ---------------------------------------------------------------- tree


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """{node or -1 (root): child indices in order}."""
    out: dict[int, list[int]] = {-1: []}
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree node {i} has parent {parent}: parents must come earlier (or be -1)")
        out.setdefault(parent, []).append(i)
        out.setdefault(i, [])
    return out


def tree_attention_mask(parents: Sequence[int]) -> Tensor:
    """[N, N] bool: node i may attend to node j iff j is i or one of its ancestors."""
    children_of(parents)  # validates the order
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (a root child has depth 1)."""
    depth: list[int] = []
    for parent in parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return depth


def greedy_tree(tokens: Sequence[int], parents: Sequence[int], logits: Tensor) -> Acceptance:
    """tokens/parents [N]; logits [N+1, V]: row 0 at the root, row i+1 at node i."""
    kids = children_of(parents)
    best = logits.argmax(-1).tolist()
    node, path = -1, []
    while True:
        want = best[node + 1]
        nxt = next((c for c in kids[node] if tokens[c] == want), None)
        if nxt is None:
            return Acceptance(len(path), [*(tokens[i] for i in path), want], path)
        path.append(nxt)
        node = nxt


def sample_tree(tokens: Sequence[int], parents: Sequence[int], probs: Tensor,
                generator: torch.Generator | None = None) -> Acceptance:
    """Recursive rejection over deterministic candidates; probs [N+1, V] as in :func:`greedy_tree`."""
    kids = children_of(parents)
    node, path = -1, []
    while True:
        p = probs[node + 1].clone()
        nxt = None
        for child in kids[node]:
            token = tokens[child]
            mass = p[token].item()
            if mass > 0 and torch.rand((), generator=generator, device=p.device).item() < mass:
                nxt = child
                break
            rest = p.clone()
            rest[token] = 0.0  # rejected (or impossible): never emitted from this node
            total = rest.sum()
            if total <= 0:  # only rounding can reject a token holding all the mass: keep p as it was
                break
            p = rest / total
        if nxt is None:
            return Acceptance(len(path), [*(tokens[i] for i in path), _sample(p, generator)], path)
        path.append(nxt)
        node = nxt


__all__ = [
    "Acceptance", "children_of", "greedy_chain", "greedy_tree", "sample_chain", "sample_tree",
    "target_probs", "tree_attention_mask", "tree_depths",
]
