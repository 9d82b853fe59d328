"""Lookup proposals: the continuation of the current suffix where it occurred before.

Agent and long-context replies copy their context: a file rewritten, a document quoted, a tool
result echoed. Where the last few tokens already appeared earlier (in the prompt, in the reply so
far, or, in the server, in a recent reply to another request), what followed them there is a
cheap guess at what comes next, no draft forward needed (prompt-lookup / n-gram decoding; the
suffix-tree variant of the same idea is SuffixDecoding's).

:class:`LookupIndex` keeps, for every n-gram of ``min_match..max_match`` tokens of one token
sequence, the positions right after its most recent ``per_key`` occurrences. A query takes the
longest n-gram ending the sequence that occurred before; among its occurrences the one whose match
runs back furthest (compared token by token, up to ``MATCH_CAP``) wins, the most recent among
equals; the proposal is what followed it, as long as :func:`branch_length` allows for that match.
Memory: at most ``(max_match - min_match + 1)`` keys per token and ``per_key`` positions per key.

:class:`SharedLookup` is the server's cross-request part: recent replies (each with its prompt's
tail), one index each, the oldest dropped once ``max_tokens`` are held; it is asked only where the
request's own context has no match.

:func:`merge_branch` puts a lookup continuation into a draft's proposal: down the draft's nodes as
long as they hold the same tokens (those nodes then count for both), then a chain of its own. The
result is one tree for one target forward; :data:`DRAFT` and :data:`LOOKUP` mark each node's source.
:class:`LookupPolicy` cuts a continuation to the tokens worth verifying on the machine at hand.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

DRAFT, LOOKUP = 1, 2
"""Source bits of a proposed node (3: proposed by both)."""
MATCH_CAP = 64
"""The furthest back a match is compared when ranking occurrences."""


@dataclass(frozen=True)
class Continuation:
    """A lookup's proposal: ``tokens`` after the current position; ``match`` tokens of context ended
    by the current one matched where they came from; ``shared``: found in another request's reply."""

    tokens: list[int]
    match: int
    shared: bool = False


def branch_length(match: int, limit: int, scale: int) -> int:
    """Tokens a match of ``match`` tokens may propose: ``scale`` per matched token, at most ``limit``
    (a one-token match is a weak hint; a long one usually means a copy)."""
    return max(0, min(limit, scale * match))


class LookupIndex:
    """n-gram occurrences of one growing token sequence."""

    def __init__(self, min_match: int = 1, max_match: int = 8, per_key: int = 16) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"lookup match lengths {min_match}..{max_match}: need 1 <= min <= max")
        self.min_match, self.max_match, self.per_key = min_match, max_match, per_key
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], deque[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def keys(self) -> int:
        return len(self.index)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; every n-gram that now has a token after it is indexed."""
        seq = self.tokens
        for token in tokens:
            seq.append(int(token))
            after = len(seq) - 1  # the new token follows the n-grams ending just before it
            for n in range(self.min_match, min(self.max_match, after) + 1):
                key = tuple(seq[after - n:after])
                where = self.index.get(key)
                if where is None:
                    self.index[key] = where = deque(maxlen=self.per_key)
                where.append(after)

    def find(self, suffix: Sequence[int] | None = None) -> tuple[int, int] | None:
        """(position after the best earlier occurrence, match length) for ``suffix`` (default: the
        end of this sequence), or None. Within this sequence the current end itself never counts."""
        seq = self.tokens
        tail = list(seq[-MATCH_CAP:]) if suffix is None else list(suffix[-MATCH_CAP:])
        for n in range(min(self.max_match, len(tail)), self.min_match - 1, -1):
            where = self.index.get(tuple(tail[-n:]))
            if not where:
                continue
            best: tuple[int, int] | None = None
            for after in reversed(where):  # most recent first: it wins ties
                if suffix is None and after >= len(seq):
                    continue
                length = n
                while (length < len(tail) and length < after
                       and seq[after - length - 1] == tail[-length - 1]):
                    length += 1
                if best is None or length > best[1]:
                    best = (after, length)
            if best is not None:
                return best
        return None

    def propose(self, limit: int, scale: int, suffix: Sequence[int] | None = None) -> Continuation | None:
        """The continuation of the best match, :func:`branch_length` tokens at most; None without one."""
        found = self.find(suffix)
        if found is None:
            return None
        after, match = found
        tokens = self.tokens[after:after + branch_length(match, limit, scale)]
        return Continuation(tokens, match) if tokens else None


class SharedLookup:
    """Recent replies across requests (each with the tail of its prompt), capped at ``max_tokens``."""

    def __init__(self, max_tokens: int, min_match: int = 1, max_match: int = 8, context: int = 256) -> None:
        if max_tokens < 0:
            raise ValueError(f"shared lookup: max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens, self.min_match, self.max_match, self.context = max_tokens, min_match, max_match, context
        self.docs: OrderedDict[int, LookupIndex] = OrderedDict()
        self.tokens = 0
        self.added = 0
        self.evicted = 0
        self._next = 0

    def add(self, prompt: Sequence[int], reply: Sequence[int]) -> None:
        """One finished request: its reply, after the last ``context`` prompt tokens (a reply's first
        tokens then match where another request's prompt ends alike)."""
        if self.max_tokens == 0 or not reply:
            return
        tokens = [*prompt[-self.context:], *reply][-self.max_tokens:]
        index = LookupIndex(self.min_match, self.max_match)
        index.extend(tokens)
        self.docs[self._next] = index
        self._next += 1
        self.tokens += len(tokens)
        self.added += 1
        while self.tokens > self.max_tokens:
            _, old = self.docs.popitem(last=False)
            self.tokens -= len(old)
            self.evicted += 1

    def propose(self, suffix: Sequence[int], limit: int, scale: int) -> Continuation | None:
        """The longest match of ``suffix``'s end in any held reply (the newest among equals)."""
        best: Continuation | None = None
        for index in reversed(self.docs.values()):
            got = index.propose(limit, scale, suffix)
            if got is not None and (best is None or got.match > best.match):
                best = got
        return None if best is None else Continuation(best.tokens, best.match, shared=True)


MATCH_BUCKETS = 8
"""Match lengths the policy keeps apart (1..7, then 8 and longer together)."""


@dataclass
class LookupPolicy:
    """How long each round's lookup branch is: the tokens whose expected worth beats their cost.

    The j-th token of a branch (j = 0, 1, ..) is accepted with probability about ``p(m) c^j``: ``p(m)``
    the share of rounds with a match of m tokens whose first lookup token the target took, ``c`` the
    share of later branch tokens taken once the one before was; both counted over the rounds so far
    (Beta-smoothed over a prior: ``m / (m + 2)`` and 0.8). Verifying one more token costs
    ``token_cost`` of a plain decoding step, i.e. that many tokens of plain output (the cost model's
    slope over t(1): ~0.2 on a 2-core CPU, ~0 for batch-1 decoding on a GPU), so a branch keeps the
    tokens with ``p(m) c^j > token_cost``, none where the match is weak and verifying is dear. The
    draft's confidence is not weighed: its first token's probability does not tell when the lookup
    is right (``bench/studies/lookup_rounds.py``)."""

    token_cost: float = 0.0
    prior_weight: float = 4.0
    first: list[list[float]] = field(default_factory=lambda: [[0.0, 0.0] for _ in range(MATCH_BUCKETS)])
    later: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [hits, trials] after a taken token

    def __post_init__(self) -> None:
        if self.token_cost < 0:
            raise ValueError(f"lookup token cost must be >= 0, got {self.token_cost}")

    def p_first(self, match: int) -> float:
        m = min(max(match, 1), MATCH_BUCKETS)
        hits, trials = self.first[m - 1]
        return (hits + self.prior_weight * m / (m + 2)) / (trials + self.prior_weight)

    def p_later(self) -> float:
        hits, trials = self.later
        return (hits + self.prior_weight * 0.8) / (trials + self.prior_weight)

    def length(self, match: int, proposed: int) -> int:
        """Tokens of a ``proposed``-token continuation worth verifying after a match of ``match``."""
        p, c, n = self.p_first(match), self.p_later(), 0
        while n < proposed and p > self.token_cost:
            n += 1
            p *= c
        return n

    def observe(self, match: int, first_right: bool, branch: int, taken: int) -> None:
        """A round's outcome after a match of ``match``: whether the target's next token was the
        continuation's first (known whether or not it was proposed, so a weak match's estimate keeps
        learning while none is verified), and of a ``branch``-token branch verified, the first
        ``taken`` tokens the target took."""
        m = min(max(match, 1), MATCH_BUCKETS)
        self.first[m - 1][1] += 1
        self.first[m - 1][0] += bool(first_right)
        if branch > 1 and taken > 0:  # later tokens tried: each after a taken one
            self.later[1] += min(taken + 1, branch) - 1
            self.later[0] += min(taken, branch) - 1


@dataclass
class Merged:
    """One round's verification tree: ``tokens`` and ``parents`` (-1: the root), each node's source
    bits (:data:`DRAFT`, :data:`LOOKUP`), and whether the lookup added nodes of its own."""

    tokens: list[int]
    parents: list[int]
    sources: list[int]
    added: int = 0

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.parents) - 1))


def merge_branch(tokens: Sequence[int], parents: Sequence[int], branch: Sequence[int]) -> Merged:
    """The draft's nodes (``tokens``/``parents``, parents before children) with the lookup's ``branch``
    hung from the root: shared prefixes merged, the rest appended as a chain."""
    sources = [DRAFT] * len(tokens)
    out_tokens, out_parents = list(tokens), list(parents)
    kids: dict[int, dict[int, int]] = {}
    for i, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
        kids.setdefault(parent, {}).setdefault(token, i)
    node, added = -1, 0
    for token in branch:
        child = kids.get(node, {}).get(token)
        if child is None:
            out_tokens.append(token)
            out_parents.append(node)
            sources.append(LOOKUP)
            child = len(out_tokens) - 1
            kids.setdefault(node, {})[token] = child
            added += 1
        else:
            sources[child] |= LOOKUP
        node = child
    return Merged(out_tokens, out_parents, sources, added)


def fit_budget(merged: Merged, budget: int) -> Merged:
    """At most ``budget`` nodes: the draft's own leaves dropped, last first (a draft tree lists its nodes
    depth by depth, so its deepest go first); nodes the lookup proposed are kept."""
    n = len(merged.tokens)
    if n <= budget:
        return merged
    children = [0] * n
    for parent in merged.parents:
        if parent >= 0:
            children[parent] += 1
    dropped = [False] * n
    excess = n - budget
    changed = True
    while excess and changed:
        changed = False
        for i in range(n - 1, -1, -1):
            if excess and not dropped[i] and merged.sources[i] == DRAFT and children[i] == 0:
                dropped[i] = True
                excess -= 1
                changed = True
                if merged.parents[i] >= 0:
                    children[merged.parents[i]] -= 1
    keep = [i for i in range(n) if not dropped[i]]
    index = {old: new for new, old in enumerate(keep)}
    return Merged([merged.tokens[i] for i in keep], [index.get(merged.parents[i], -1) for i in keep],
                  [merged.sources[i] for i in keep], merged.added)


__all__ = ["DRAFT", "LOOKUP", "MATCH_BUCKETS", "MATCH_CAP", "Continuation", "LookupIndex", "LookupPolicy", "Merged",
           "SharedLookup", "branch_length", "fit_budget", "merge_branch"]
