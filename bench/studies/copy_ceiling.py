"""How much of a reply any lookup could have proposed, by context bucket: the ceiling of lookup decoding.

    .venv/bin/python bench/studies/copy_ceiling.py --pools <pools with the long sets> \\
        --sets long_code long_docs long_chat long_edit --per-set 16 --max-new-tokens 64

Each prompt is decoded greedily with the lookup alone (equal to plain decoding, so the reply is the
target's own) and its rounds are counted by the bucket of the tokens before them. The reply is then
walked again, round by round (K tokens at most per round, as the lookup's branch), by an oracle that,
at each round, takes whichever earlier position of the prompt and reply so far has the longest
continuation equal to the reply's next tokens, among those whose previous token equals the current
one (a match of one token: every continuation a lookup could pick from, with as many branches as it
likes). Prints one JSON line per set and bucket, then one over all sets:

* ``lookup_tau``: tokens per target forward the served lookup gave (its own rounds);
* ``oracle_tau``: the same for the oracle's walk: no context lookup gets more from these replies;
* ``walk_1_tau``, ``walk_4_tau``: the same walk by the served lookup's rule with one branch (its
  own figure without the served policy's pricing) and with the continuations of its four best-ranked
  occurrences verified together (what a lookup tree of four branches would get);
* ``copied``: the share of reply tokens whose 4-gram (it and the three before it) occurred earlier in
  the prompt or reply, i.e. the part of the reply that is a copy of its context.

If a bucket's oracle falls as the lookup does, the reply, not the lookup, is what changed.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch


def oracle_accept(context: np.ndarray, reply: Sequence[int], k: int) -> int:
    """The most of ``reply[:k]`` any earlier position of ``context`` continues with, where the token
    before that position equals the context's last one (a one-token match)."""
    last = context[-1]
    starts = np.nonzero(context[:-1] == last)[0] + 1  # positions right after an earlier occurrence
    want = np.asarray(reply[:k])
    best = 0
    for s in starts:
        got = context[s:s + len(want)]
        n = 0
        while n < len(got) and got[n] == want[n]:
            n += 1
        best = max(best, n)
        if best == len(want):
            break
    return best


def oracle_walk(prompt: Sequence[int], reply: Sequence[int], k: int) -> list[tuple[int, int]]:
    """(context tokens before the round's first proposed token, tokens the round emitted) per round."""
    from itertools import chain

    seq = np.fromiter(chain(prompt, reply), dtype=np.int64)
    rounds, pos = [], 1  # the first reply token comes from the prefill
    while pos < len(reply):
        # the round's proposals come after the last emitted token; a round emits its accepted tokens
        # and the target's own next one, none past the reply's end (its stop token, or the token limit)
        left = len(reply) - pos
        got = oracle_accept(seq[:len(prompt) + pos], reply[pos:pos + min(k, left)], k)
        emitted = min(got + 1, left)
        rounds.append((len(prompt) + pos, emitted))
        pos += emitted
    return rounds


def lookup_walk(prompt: Sequence[int], reply: Sequence[int], k: int, branches: int, scale: int = 2,
                max_match: int = 8, per_key: int = 16) -> list[tuple[int, int]]:
    """:func:`oracle_walk` for a lookup verifying the continuations of up to ``branches`` earlier
    occurrences at once: those of the longest n-gram (at most ``max_match`` tokens) ending the context
    that occurred before, its ``per_key`` most recent occurrences ranked as :class:`LookupIndex` ranks
    them (the match running back furthest, then the most recent), one branch per distinct
    continuation, each ``scale`` tokens per matched token long (at most ``k``)."""
    from serve_eval.lookup import MATCH_CAP, LookupIndex

    seq = [*prompt, *reply]
    index = LookupIndex(1, max_match, per_key)
    index.extend(seq[:len(prompt) + 1])
    rounds, pos = [], 1
    while pos < len(reply):
        end = len(prompt) + pos  # the context: seq[:end], all of it indexed
        left = len(reply) - pos
        want = seq[end:end + min(k, left)]
        got = 0
        for n in range(min(max_match, end - 1), 0, -1):
            after = [j for j in index.index.get(tuple(seq[end - n:end]), ()) if j < end]
            if not after:
                continue
            ranked = []
            for j in after:
                length = n
                while length < min(MATCH_CAP, j) and seq[j - length - 1] == seq[end - length - 1]:
                    length += 1
                ranked.append((length, j))
            ranked.sort(reverse=True)
            seen: set[tuple[int, ...]] = set()
            for length, j in ranked:
                cont = tuple(seq[j:min(j + max(0, min(k, scale * length)), end)])
                if not cont or cont in seen:
                    continue
                seen.add(cont)
                m = 0
                while m < min(len(cont), len(want)) and cont[m] == want[m]:
                    m += 1
                got = max(got, m)
                if len(seen) == branches:
                    break
            break
        emitted = min(got + 1, left)
        rounds.append((end, emitted))
        index.extend(seq[end:end + emitted])
        pos += emitted
    return rounds


def copied_tokens(prompt: Sequence[int], reply: Sequence[int], n: int = 4) -> int:
    """Reply tokens whose n-gram ending at them occurred earlier in prompt + reply."""
    seq = [*prompt, *reply]
    seen = {tuple(seq[i - n:i]) for i in range(n, len(prompt) + 1)}
    out = 0
    for i in range(len(prompt), len(seq)):
        gram = tuple(seq[i - n + 1:i + 1])
        if len(gram) == n and gram in seen:
            out += 1
        seen.add(gram)
    return out


def main() -> None:
    from eagle3.config import SamplingConfig
    from eagle3.draft.metrics import CONTEXT_BUCKETS, context_bucket
    from eagle3.target.chat import ChatFormat
    from eagle3.target.model import load_target
    from serve_eval.config import SpecConfig
    from serve_eval.evaluate import read_prompts
    from serve_eval.spec_decode import SpeculativeDecoder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--pools", required=True)
    parser.add_argument("--sets", nargs="+", default=["long_code", "long_docs", "long_chat", "long_edit"])
    parser.add_argument("--per-set", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lookup-k", type=int, default=SpecConfig.lookup_k)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = load_target(args.target, dtype="float32", device="cpu")
    chat = ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)
    decoder = SpeculativeDecoder(target, None, SpecConfig("chain", proposer="lookup", lookup_k=args.lookup_k))
    stops = frozenset(chat.stop_ids)
    # per (set, bucket): served rounds and tokens, oracle rounds and tokens, reply tokens and copied ones
    tally: dict[tuple[str, str], np.ndarray] = defaultdict(lambda: np.zeros(10, dtype=np.int64))
    for name in args.sets:
        for prompt in read_prompts(Path(args.pools), name, args.per_set, chat):
            gen = decoder.generate(prompt, args.max_new_tokens, stops, SamplingConfig())
            reply, stats = gen.tokens, gen.stats
            walk = oracle_walk(prompt, reply, args.lookup_k)
            one, four = (lookup_walk(prompt, reply, args.lookup_k, b) for b in (1, 4))
            for set_name in (name, "all"):
                for context, accepted in zip(stats.contexts, stats.accepted, strict=True):
                    t = tally[set_name, context_bucket(context)]
                    t[0] += 1
                    t[1] += accepted + 1
                for context, emitted in walk:
                    t = tally[set_name, context_bucket(context)]
                    t[2] += 1
                    t[3] += emitted
                for col, walked in ((6, one), (8, four)):
                    for context, emitted in walked:
                        t = tally[set_name, context_bucket(context)]
                        t[col] += 1
                        t[col + 1] += emitted
                t = tally[set_name, context_bucket(len(prompt))]  # a prompt's variants differ by thousands
                t[4] += len(reply)
                t[5] += copied_tokens(prompt, reply)
    for (name, bucket), t in sorted(tally.items(), key=lambda kv: (kv[0][0] == "all", kv[0][0],
                                                                    CONTEXT_BUCKETS.index(kv[0][1]))):
        print(json.dumps({"figure": "copy_ceiling", "set": name, "bucket": bucket, "target": args.target,
                          "rounds": int(t[0]), "lookup_tau": round(t[1] / max(t[0], 1), 3),
                          "oracle_rounds": int(t[2]), "oracle_tau": round(t[3] / max(t[2], 1), 3),
                          "walk_1_tau": round(t[7] / max(t[6], 1), 3), "walk_4_tau": round(t[9] / max(t[8], 1), 3),
                          "reply_tokens": int(t[4]), "copied": round(t[5] / max(t[4], 1), 3)}))


if __name__ == "__main__":
    main()
