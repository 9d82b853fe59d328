"""Mining strategies: small functions from scores to more (or more heavily weighted) training data.

* :func:`domain_weights` + :func:`sample_weights` — oversample the weak domains of what is
  already harvested (no new data); :func:`split_by_weight` + :func:`weak_pick` — spend a budget of
  new pool prompts on the domains by the same weights;
* :func:`pick_hardest` — of a larger pool of candidate prompts scored cheaply (a short
  regenerated and harvested prefix, run through the draft), keep the top fraction by loss;
* :func:`variation_requests` / :func:`parse_variation` — the target writes new prompts near
  the hard ones (same domain and language); :func:`math_problems` and :func:`code_tasks` are
  procedural generators for two domains;
* :func:`dedupe` — every new prompt is checked against every eval set (exact normalised match,
  or a share of its word 8-grams seen in them) and against the others.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from typing import Any

from eagle3.conversations import normalize_text, prompt_key, record_id
from hard_mining.score import GroupScore, SampleScore, rank_key, record_of

# ---------------------------------------------------------------- (a) reweight weak domains


def domain_weights(groups: dict[str, GroupScore], power: float = 4.0, low: float = 0.25,
                   high: float = 4.0, counts: dict[str, int] | None = None) -> dict[str, float]:
    """Oversampling weight per domain: ``(tau_best / tau_d) ** power`` clipped to [low, high] and
    scaled so that the weights average 1 over the samples they will apply to (``counts`` per
    domain, e.g. the training set's; default the groups' own sample counts), so the epoch keeps
    its size. A domain of ``counts`` without a score gets the raw weight 1 before scaling."""
    if not groups:
        return {}
    best = max(g.tau_sim for g in groups.values())
    raw = {name: min(max((best / g.tau_sim) ** power, low), high) for name, g in groups.items()}
    counts = counts if counts is not None else {n: g.samples for n, g in groups.items()}
    for name in counts:
        raw.setdefault(name, 1.0)
    total = sum(counts.values())
    mean = sum(raw[n] * c for n, c in counts.items()) / total if total else 1.0
    return {name: w / mean for name, w in raw.items()}


def sample_weights(scores: Sequence[SampleScore], weights: dict[str, float]) -> dict[str, float]:
    """Per sample id: its domain's weight (for ``train.data.sample_weights``)."""
    return {s.sample_id: round(weights.get(s.domain, 1.0), 6) for s in scores}


def split_by_weight(n: int, weights: dict[str, float], available: dict[str, int]) -> dict[str, int]:
    """``n`` items split over the domains of ``available`` in proportion to ``weights`` (Sainte-Lague:
    each item goes to the domain with the largest weight / (2 * given + 1); a domain without a weight
    counts 1), none given more than it has; what a full domain cannot take goes to the others."""
    out = dict.fromkeys(available, 0)
    for _ in range(min(n, sum(available.values()))):
        open_ = [d for d in sorted(available) if out[d] < available[d]]
        best = max(open_, key=lambda d: weights.get(d, 1.0) / (2 * out[d] + 1))
        out[best] += 1
    return out


def weak_pick(pool: Sequence[dict[str, Any]], n: int, weights: dict[str, float],
              seed: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """``n`` pool prompts, the count per domain by :func:`split_by_weight`, random within each
    domain -> (the prompts, the count per domain)."""
    by_domain: dict[str, list[dict[str, Any]]] = {}
    for record in pool:
        by_domain.setdefault(str(record.get("domain")), []).append(record)
    counts = split_by_weight(n, weights, {d: len(items) for d, items in by_domain.items()})
    rng = random.Random(seed)
    picked = [x for d in sorted(by_domain) for x in rng.sample(by_domain[d], counts[d])]
    return picked, {d: c for d, c in counts.items() if c}


# ---------------------------------------------------------------- (b) the hardest candidates


def per_record(scores: Sequence[SampleScore]) -> list[SampleScore]:
    """One score per record: a conversation harvested one reply at a time (samples ``<id>-t<k>``)
    pooled over its samples (positions and hits added, loss averaged over the positions)."""
    groups: dict[str, list[SampleScore]] = {}
    for s in scores:
        groups.setdefault(record_of(s.sample_id), []).append(s)
    out = []
    for rid, items in groups.items():
        if len(items) == 1 and items[0].sample_id == rid:
            out.append(items[0])
            continue
        positions = sum(x.positions for x in items)
        loss = sum(x.loss * x.positions for x in items) / positions if positions else items[0].loss
        entropy = sum(x.entropy * x.positions for x in items) / positions if positions else items[0].entropy
        out.append(SampleScore(rid, items[0].domain, items[0].language, sum(x.tokens for x in items),
                               [a for x in items for a in x.accepted], loss,
                               [sum(v) for v in zip(*(x.step_hits for x in items), strict=True)],
                               [sum(v) for v in zip(*(x.step_counted for x in items), strict=True)],
                               [c for x in items for c in x.contexts], entropy,
                               [p for x in items for p in x.top1]))  # starts: rows of different samples, left out
    return out


def pick_hardest(scores: Sequence[SampleScore], fraction: float, per_domain: bool = True,
                 min_positions: int = 4, rank: str = "loss", confidence: float = 0.5) -> list[str]:
    """Ids of the top ``fraction`` of candidates, hardest first under ``rank`` (:data:`RANKS`; within
    each domain when ``per_domain``, so a domain that is hard everywhere cannot crowd out the
    others); candidates with fewer than ``min_positions`` scored positions are left out."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction={fraction}: must be in (0, 1]")
    pool = [s for s in scores if s.positions >= min_positions]
    groups: dict[str, list[SampleScore]] = {}
    for s in pool:
        groups.setdefault(s.domain if per_domain else "all", []).append(s)
    keep: list[str] = []
    for items in groups.values():
        n = max(1, round(fraction * len(items)))
        keep += [s.sample_id for s in sorted(items, key=rank_key(rank, confidence))[:n]]
    return sorted(keep)


# ---------------------------------------------------------------- (c) new prompts near the hard ones

VARIATION_INSTRUCTION = {
    "en": "Write one new question of the same kind as the one below: same topic, same difficulty, same "
          "language. Write only the new question.\n\nQuestion: {prompt}",
    "de": "Schreibe eine neue Frage derselben Art wie die folgende: gleiches Thema, gleiche Schwierigkeit, "
          "auf Deutsch. Schreibe nur die neue Frage.\n\nFrage: {prompt}",
    "fr": "Écris une nouvelle question du même type que celle-ci : même sujet, même difficulté, en français. "
          "Écris seulement la nouvelle question.\n\nQuestion : {prompt}",
    "es": "Escribe una nueva pregunta del mismo tipo que la siguiente: mismo tema, misma dificultad, en "
          "español. Escribe solo la nueva pregunta.\n\nPregunta: {prompt}",
}


def first_user_text(record: dict[str, Any]) -> str:
    return next(m["content"] for m in record["messages"] if m["role"] == "user")


def variation_requests(records: Sequence[dict[str, Any]], per_record: int = 1,
                       max_chars: int = 1500) -> list[dict[str, Any]]:
    """Generation requests (records whose single user turn asks the target for a new prompt like
    the record's first one), ``per_record`` each; ``meta.parent`` names the hard record."""
    out = []
    for rec in records:
        lang = rec.get("language", "en")
        text = first_user_text(rec)[:max_chars]
        instruction = VARIATION_INSTRUCTION.get(lang, VARIATION_INSTRUCTION["en"]).format(prompt=text)
        for k in range(per_record):
            messages = [{"role": "user", "content": instruction}]
            out.append({"id": f"{rec['id']}-var{k}", "domain": rec.get("domain"), "language": lang,
                        "source": "mined-variation-request", "messages": messages,
                        "meta": {"parent": rec["id"], "variant": k}})
    return out


_LEAD = re.compile(r"^\s*(?:new\s+)?(?:question|frage|pregunta)\s*[:：]\s*", re.IGNORECASE)


def parse_variation(text: str, min_chars: int = 12, max_chars: int = 2000) -> str | None:
    """The new prompt in a generated variation, or None if it is unusable (too short, too long,
    an echo of the instruction)."""
    text = _LEAD.sub("", text.strip()).strip().strip('"').strip()
    if not min_chars <= len(text) <= max_chars or "same topic" in text.lower():
        return None
    return text


def prompt_record(text: str, domain: str, language: str, source: str, meta: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    return {"id": record_id(messages), "domain": domain, "language": language, "source": source,
            "messages": messages, "meta": meta or {}}


_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun"]
_ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stamps", "tickets", "boxes"]


def math_problems(n: int, seed: int) -> list[dict[str, Any]]:
    """Procedural multi-step arithmetic word problems (domain ``science``, English)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.randint(3, 90), rng.randint(2, 12), rng.randint(2, 40)
        who, other, item = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_ITEMS)
        kind = rng.randrange(4)
        if kind == 0:
            text = (f"{who} has {a} {item}. {who} buys {b} packs with {c} {item} in each pack, then gives "
                    f"{other} half of all the {item}. How many {item} does {who} have left? Explain step by step.")
        elif kind == 1:
            text = (f"A train travels {a * b} km in {b} hours, then {c * 3} km in 3 hours. What is its average "
                    f"speed over the whole trip in km/h? Show your work.")
        elif kind == 2:
            text = (f"{who} saves {c} dollars a week and already has {a} dollars. How many weeks until {who} can "
                    f"buy something that costs {a + c * b + rng.randint(1, c)} dollars? Reason step by step.")
        else:
            text = (f"A rectangle is {a} cm long and {b + c} cm wide. A square has the same perimeter. What is "
                    f"the area of the square? Explain each step.")
        out.append(prompt_record(text, "science", "en", "mined-procedural-math", {"seed": seed}))
    return out


_TASKS = [
    ("returns the {k} largest values of a list of {t}", "list"),
    ("removes duplicates from a list of {t} while keeping the original order", "list"),
    ("parses a CSV line with quoted fields into a list of {t}", "parsing"),
    ("merges two sorted lists of {t} into one sorted list", "list"),
    ("counts how often each word occurs in a text and returns the {k} most common", "text"),
    ("checks whether a string of brackets is balanced", "text"),
    ("implements an LRU cache with a capacity of {k} entries", "design"),
    ("groups a list of {t} by a key function into a dictionary", "list"),
]
_LANGS = ["Python", "JavaScript", "Go", "Rust", "Java", "C++"]
_TYPES = ["integers", "strings", "floats", "records"]


def code_tasks(n: int, seed: int) -> list[dict[str, Any]]:
    """Procedural programming tasks (domain ``coding``, English)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        task, _ = rng.choice(_TASKS)
        lang = rng.choice(_LANGS)
        body = task.format(k=rng.randint(2, 10), t=rng.choice(_TYPES))
        extra = rng.choice(["", " Add a short docstring.", " Include two example calls.", " Explain its complexity."])
        out.append(prompt_record(f"Write a {lang} function that {body}.{extra}", "coding", "en",
                                 "mined-procedural-code", {"seed": seed}))
    return out


# ---------------------------------------------------------------- dedup


def word_ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = normalize_text(text).split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def dedupe(records: Iterable[dict[str, Any]], against: Iterable[dict[str, Any]], *, n: int = 8,
           max_overlap: float = 0.3) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Keep the records whose prompt is neither equal (normalised) to one in ``against`` (every
    eval set, and what is already harvested) nor shares more than ``max_overlap`` of its word
    ``n``-grams with them, and that do not repeat an earlier kept one. Returns kept, and counts
    of what was dropped and why."""
    keys, grams = set(), set()
    for rec in against:
        keys.add(prompt_key(rec["messages"]))
        for m in rec["messages"]:
            if m["role"] == "user":
                grams |= word_ngrams(m["content"], n)
    kept, dropped = [], {"exact": 0, "ngram": 0, "repeat": 0}
    seen: set[str] = set()
    for rec in records:
        key = prompt_key(rec["messages"])
        if key in keys:
            dropped["exact"] += 1
            continue
        if key in seen:
            dropped["repeat"] += 1
            continue
        mine = set().union(*(word_ngrams(m["content"], n) for m in rec["messages"] if m["role"] == "user"))
        if mine and len(mine & grams) / len(mine) > max_overlap:
            dropped["ngram"] += 1
            continue
        seen.add(key)
        kept.append(rec)
    return kept, dropped


__all__ = ["VARIATION_INSTRUCTION", "code_tasks", "dedupe", "domain_weights", "first_user_text", "math_problems",
           "parse_variation", "per_record",
           "pick_hardest", "prompt_record", "sample_weights", "variation_requests", "word_ngrams"]
