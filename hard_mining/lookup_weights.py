"""Loss weights away from what the lookup proposes (``train.loss.token_weights``).

Served beside the lookup (``--proposer hybrid``), a draft need not learn the tokens the lookup
already gets right: a reply token that continues an earlier match of the context is proposed by
the lookup for free. This writes, for every sample of a harvest store, the reply tokens the lookup
(:class:`serve_eval.lookup.LookupIndex` over the tokens before them) would propose first after a
match of at least ``min_match`` tokens, at ``weight``, so that the draft's capacity goes where the
lookup cannot help. The trainer reads the file as any other token weights; tau_sim and the eval
loss still count every position.

    python -m hard_mining.lookup_weights --store runs/quickstart/harvest --out runs/lookup_weights.json \\
        [--weight 0.25] [--min-match 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from eagle3.atomic import atomic_write_text
from eagle3.errors import ConfigError, run_cli
from serve_eval.lookup import LookupIndex


def lookup_tokens(ids: Sequence[int], mask: Sequence[bool], min_match: int = 2, max_match: int = 8) -> list[int]:
    """Indices j of the reply tokens (``mask[j]``) that the lookup over ``ids[:j]`` proposes first after
    a match of at least ``min_match`` tokens."""
    index = LookupIndex(1, max_match)
    out = []
    for j, token in enumerate(ids):
        if j and mask[j]:
            found = index.find()
            if found is not None and found[1] >= min_match and index.tokens[found[0]] == token:
                out.append(j)
        index.extend([token])
    return out


def lookup_weights(store: object, weight: float, min_match: int, max_match: int = 8,
                   ) -> tuple[dict[str, list[list[int | float]]], dict[str, int]]:
    """``train.loss.token_weights`` entries for every sample of ``store`` (a harvest store) and counts."""
    out: dict[str, list[list[int | float]]] = {}
    replies = listed = 0
    for i, sample_id in enumerate(store.sample_ids):
        ids, mask = store.token_columns(i)
        mask_list = mask.tolist()
        found = lookup_tokens(ids.tolist(), mask_list, min_match, max_match)
        replies += sum(mask_list)
        listed += len(found)
        if found:
            out[sample_id] = [[j, weight] for j in found]
    return out, {"samples": len(store.sample_ids), "reply_tokens": replies, "weighted_tokens": listed}


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("lookup_weights", _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    from eagle3.store.shards import open_stores

    parser = argparse.ArgumentParser(prog="python -m hard_mining.lookup_weights", description=__doc__.splitlines()[0])
    parser.add_argument("--store", nargs="+", required=True, help="harvest store folder(s), as training reads them")
    parser.add_argument("--out", required=True, help="the token weights file (train.loss.token_weights)")
    parser.add_argument("--weight", type=float, default=0.25, help="the weight of a token the lookup proposes")
    parser.add_argument("--min-match", type=int, default=2, help="the shortest match that counts")
    parser.add_argument("--max-match", type=int, default=8, help="the longest n-gram indexed")
    args = parser.parse_args(argv)
    if not 0 <= args.weight <= 1:
        raise ConfigError(f"--weight {args.weight}: expected 0..1 (1 changes nothing)")
    if not 1 <= args.min_match or args.max_match < 1:
        raise ConfigError(f"--min-match {args.min_match} / --max-match {args.max_match}: expected >= 1")
    store = open_stores(args.store)
    weights, counts = lookup_weights(store, args.weight, args.min_match, args.max_match)
    atomic_write_text(Path(args.out), json.dumps(weights) + "\n")
    share = counts["weighted_tokens"] / max(counts["reply_tokens"], 1)
    print(json.dumps({"stage": "lookup_weights", "out": args.out, **counts, "weighted_share": round(share, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
