"""Build the prompt pools and the held-out eval sets, offline, from the registered sources.

    python -m data_gen.pools --out runs/pools

writes, atomically (the folder is complete or absent)::

    train.jsonl  val.jsonl          training prompts (coding, science, multilingual, general)
    eval/<set>.jsonl                held-out: mtbench, humaneval, gsm8k, math, multilingual, alpaca
    manifest.json                   counts by domain/source/language, skips, sources, config

Eval prompts never reach training: the training pool is filtered against every eval set
by normalised text, and MMATH is split by problem ``gid`` (its ten files are translations
of the same problems), never by row.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import data_gen.reuse  # noqa: F401  (registers the long_reuse source)
from data_gen.agents import code_agent_eval, eval_cut  # also registers bfcl, bfcl_agent and code_agent
from data_gen.config import PoolsConfig, UserFileConfig
from data_gen.language import detect_language
from data_gen.sources import SOURCES, Prompt, read_source, wheel_of
from eagle3.atomic import atomic_dir, check_replaceable, holds_only
from eagle3.conversations import (
    ConversationError,
    LoadReport,
    iter_user_conversations,
    make_record,
    prompt_key,
    take_in_turn,
    user_turns,
)
from eagle3.errors import MissingInputError, run_cli
from eagle3.fingerprint import sha256_file

EVAL_SETS = ("mtbench", "humaneval", "gsm8k", "math", "multilingual", "alpaca", "tool_use", "agent")


def _rank(seed: int, key: str) -> str:
    """A seeded, stable order: sort by this to shuffle reproducibly across runs and machines."""
    return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()


def _record(p: Prompt, **extra: Any) -> dict[str, Any]:
    language = p.language or "und"
    if p.tools is not None:
        extra["tools"] = p.tools
    record = make_record(p.messages, domain=p.domain, source=p.source, language=language, **extra)
    if p.meta:
        record["meta"] = p.meta
    return record


def build_eval_sets(cfg: PoolsConfig, sharegpt: list[Prompt]) -> tuple[dict[str, list[dict]], set[str]]:
    """The held-out sets, and the MMATH gid groups they use (kept out of training)."""
    sets: dict[str, list[dict]] = {
        "mtbench": [_record(p) for p in read_source("mtbench")],
        "humaneval": [_record(p) for p in read_source("humaneval")],
        "gsm8k": [_record(p) for p in read_source("gsm_symbolic")][: cfg.eval_gsm8k],
    }
    mmath = list(read_source("mmath"))
    gids = sorted({p.meta["gid"] for p in mmath}, key=lambda g: _rank(cfg.seed, f"mmath:{g}"))
    math_gids = set(gids[: cfg.eval_math])
    multi_gids = set(gids[cfg.eval_math : cfg.eval_math + cfg.eval_multilingual])
    sets["math"] = [_record(p) for p in mmath if p.language == "en" and p.meta["gid"] in math_gids]
    sets["multilingual"] = [_record(p) for p in mmath if p.language != "en" and p.meta["gid"] in multi_gids]
    single_general = [p for p in sharegpt if p.domain == "general" and p.language == "en"
                      and len(user_turns(p.messages)) == 1 and len(p.messages[0]["content"]) <= 1000]
    single_general.sort(key=lambda p: _rank(cfg.seed, "alpaca:" + prompt_key(p.messages)))
    sets["alpaca"] = [_record(p) for p in single_general[: cfg.eval_alpaca]]
    held_groups = {f"mmath:{g}" for g in math_gids | multi_gids}
    tool_use = sorted(read_source("bfcl"), key=lambda p: _rank(cfg.seed, f"tool_use:{p.group}"))[: cfg.eval_tool_use]
    sets["tool_use"] = [_record(p) for p in tool_use]
    bfcl_agent = sorted(read_source("bfcl_agent", max_user_turns=1), key=lambda p: _rank(cfg.seed, f"agent:{p.group}"))
    cut = random.Random(f"{cfg.seed}:agent")
    agent = [eval_cut(p, cut) for p in bfcl_agent[: cfg.eval_agent // 2]]
    agent += [eval_cut(p, cut) for p in code_agent_eval(cfg.eval_agent - len(agent), seed=cfg.seed)]
    sets["agent"] = [_record(p) for p in agent]
    held_groups |= {p.group for p in [*tool_use, *agent] if p.group}  # BFCL ids: every turn count, every cut
    return sets, held_groups


def assign_language(p: Prompt) -> None:
    """Detect the language where the source does not say it; non-English prompts that are not
    about code, tool use or agent work count as multilingual."""
    if p.language is None:
        p.language = detect_language(" ".join(user_turns(p.messages)))
        if p.language not in ("en", "und") and p.domain not in ("coding", "tool_use", "agent"):
            p.domain = "multilingual"


def _user_file_prompts(cfg: PoolsConfig, skips: Counter[str]) -> Iterable[Prompt]:
    for spec in cfg.user_files:
        report = LoadReport()
        for _, messages in iter_user_conversations(spec.path, strict=cfg.strict_user_files, report=report):
            yield Prompt(f"user:{Path(spec.path).name}", spec.domain, messages, language=spec.language)
        if not report.kept and not report.skipped:  # nothing but blank lines (or an empty dataset)
            if cfg.strict_user_files:
                raise ConversationError(f"{spec.path}: no prompts in it (empty, or blank lines only)")
            skips[f"user file {spec.path}: empty (no prompts)"] += 1
            print(f"skipped {spec.path}: no prompts in it (empty, or blank lines only)")
        for reason, n in report.skipped.items():
            skips[f"user file {spec.path}: {reason}"] += n
        for line in report.first_errors:
            print(f"skipped {line}")


def _is_earlier_pool(folder: Path) -> bool:
    """Only a pool's files, and its manifest among them (a user's data folder may hold a train.jsonl)."""
    if not holds_only("train.jsonl", "val.jsonl", "eval", "manifest.json")(folder):
        return False
    try:
        return isinstance(json.loads((folder / "manifest.json").read_text())["config"], dict)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def build_pools(cfg: PoolsConfig) -> dict[str, Any]:
    started = time.perf_counter()
    check_replaceable(cfg.out_dir, _is_earlier_pool)
    skips: Counter[str] = Counter()
    options: dict[str, dict[str, Any]] = {
        "sharegpt": {"max_user_turns": cfg.max_user_turns},
        "chatterbot": {"max_user_turns": cfg.max_user_turns},
        "reasoning_gym": {"per_generator": cfg.per_generator, "seed": cfg.seed},
        "dataset_build": {"per_language": cfg.paragraphs_per_language},
        "bfcl_agent": {"max_user_turns": cfg.max_user_turns},
        "long_reuse": {"per_language": cfg.paragraphs_per_language, "seed": cfg.seed, "tasks": cfg.long_reuse.tasks,
                       "context_chars": list(cfg.long_reuse.context_chars),
                       "turns_every": cfg.long_reuse.turns_every},
    }
    sharegpt = list(read_source("sharegpt", **options["sharegpt"]))
    for p in sharegpt:
        assign_language(p)
    eval_sets, held_groups = build_eval_sets(cfg, sharegpt)
    held_keys = {prompt_key(r["messages"]) for records in eval_sets.values() for r in records}

    candidates: list[Prompt] = []
    for name in cfg.sources:
        if name == "sharegpt":
            candidates.extend(sharegpt)
            continue
        candidates.extend(read_source(name, **options.get(name, {})))
    candidates.extend(_user_file_prompts(cfg, skips))

    seen: set[str] = set()
    kept: list[Prompt] = []
    for p in candidates:
        turns = user_turns(p.messages)
        if p.group in held_groups:
            skips[f"held-out {'MMATH problem (gid)' if p.group.startswith('mmath:') else 'BFCL entry (id)'}"] += 1
            continue
        if any(len(t.strip()) < cfg.min_chars for t in turns):
            skips["too short"] += 1
            continue
        if any(len(t) > cfg.max_chars for t in turns) and not (p.source in SOURCES and SOURCES[p.source].long):
            skips["too long"] += 1
            continue
        key = prompt_key(p.messages)
        if key in held_keys:
            skips["in an eval set"] += 1
            continue
        if key in seen:
            skips["duplicate"] += 1
            continue
        seen.add(key)
        assign_language(p)
        kept.append(p)

    train: list[dict] = []
    val: list[dict] = []
    for p in kept:
        try:
            record = _record(p)
        except ConversationError as err:
            skips[f"malformed ({err})"] += 1
            continue
        # Translations (one group) land on the same side of the split.
        unit = p.group or record["id"]
        u = int(_rank(cfg.seed, "split:" + unit)[:8], 16) / 16**8
        (val if u < cfg.val_fraction else train).append(record)

    manifest = {
        "config": pools_config_of(cfg),
        "counts": {
            "train": len(train), "val": len(val),
            "train_by_domain": dict(sorted(Counter(r["domain"] for r in train).items())),
            "train_by_source": dict(sorted(Counter(r["source"] for r in train).items())),
            "train_by_language": dict(Counter(r["language"] for r in train).most_common()),
            "eval": {name: len(records) for name, records in eval_sets.items()},
        },
        "skipped": dict(skips.most_common()),
        "sources": _source_versions(),
        "seconds": round(time.perf_counter() - started, 1),
    }
    out = Path(cfg.out_dir)
    with atomic_dir(out, replaces=_is_earlier_pool) as tmp:
        _write_jsonl(tmp / "train.jsonl", train)
        _write_jsonl(tmp / "val.jsonl", val)
        for name, records in eval_sets.items():
            _write_jsonl(tmp / "eval" / f"{name}.jsonl", records)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest


def pools_config_of(where: PoolsConfig | str | Path) -> dict[str, Any] | None:
    """The config a pool is built from, as plain data: of a config, or of a built pool folder
    (None when the folder holds no complete pool)."""
    if isinstance(where, PoolsConfig):
        config = json.loads(json.dumps(dataclasses.asdict(where)))
        for spec in config["user_files"]:  # an edited user file makes another pool
            spec["sha256"] = sha256_file(spec["path"]) if Path(spec["path"]).is_file() else None
        if "long_reuse" not in where.sources:  # its settings shape no pool without it
            del config["long_reuse"]
        return config
    manifest = Path(where) / "manifest.json"
    return json.loads(manifest.read_text())["config"] if manifest.is_file() else None


def _source_versions() -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name, source in SOURCES.items():
        wheel = wheel_of(source)
        if wheel is None:
            import sys

            out[name] = {"python": sys.version.split()[0]}
        else:
            out[name] = {"package": f"{source.package}=={source.version}", "wheel_sha256": sha256_file(wheel)}
    return out


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def format_counts(manifest: dict[str, Any]) -> str:
    c = manifest["counts"]
    lines = [f"train {c['train']}  val {c['val']}  ({manifest['seconds']} s)"]
    lines.append("train by domain:   " + "  ".join(f"{k} {v}" for k, v in c["train_by_domain"].items()))
    lines.append("train by source:   " + "  ".join(f"{k} {v}" for k, v in c["train_by_source"].items()))
    top = list(c["train_by_language"].items())[:15]
    lines.append(f"train by language: {len(c['train_by_language'])} languages; "
                 + "  ".join(f"{k} {v}" for k, v in top))
    lines.append("eval sets:         " + "  ".join(f"{k} {v}" for k, v in c["eval"].items()))
    lines.append("skipped:           " + "  ".join(f"{k}: {v}" for k, v in manifest["skipped"].items()))
    return "\n".join(lines)


def select_balanced(records: list[dict[str, Any]], n: int, domains: list[str], seed: int) -> list[dict[str, Any]]:
    """``n`` records taken in turn from each domain (seeded order within a domain); a domain
    that runs out leaves its turns to the others."""
    return take_in_turn([sorted((r for r in records if r["domain"] == d),
                                key=lambda r: _rank(seed, "select:" + r["id"])) for d in domains], n)


def check_no_overlap(pool_dir: str | Path) -> dict[str, int]:
    """Overlaps between the training pool (train + val) and each eval set: normalised text and MMATH gid."""
    pool_dir = Path(pool_dir)
    train = read_jsonl(pool_dir / "train.jsonl") + read_jsonl(pool_dir / "val.jsonl")
    keys = {prompt_key(r["messages"]) for r in train}
    gids = {r["meta"]["gid"] for r in train if r["source"] == "mmath"}
    overlaps: dict[str, int] = defaultdict(int)
    for name in EVAL_SETS:
        for r in read_jsonl(pool_dir / "eval" / f"{name}.jsonl"):
            overlaps[name] += prompt_key(r["messages"]) in keys
            overlaps[name] += r["source"] == "mmath" and r["meta"]["gid"] in gids
    return dict(overlaps)


def main(argv: list[str] | None = None) -> int:
    return run_cli("pools", _main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description="Build the prompt pools and held-out eval sets offline.")
    parser.add_argument("--out", default=PoolsConfig.out_dir)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-generator", type=int, default=PoolsConfig.per_generator)
    parser.add_argument("--user-file", action="append", default=[], metavar="PATH",
                        help="your prompts, jsonl (ShareGPT or OpenAI messages) or an HF datasets folder; repeatable")
    parser.add_argument("--user-domain", default=UserFileConfig.domain,
                        help="the domain of the user files' prompts: coding, science, multilingual or general")
    parser.add_argument("--user-language", default=None, help="their ISO 639 code (default: detected per prompt)")
    parser.add_argument("--strict-user-files", action="store_true",
                        help="stop at the first bad row of a user file (naming file:line) instead of skipping it")
    args = parser.parse_args(argv)
    if args.per_generator < 1:
        parser.error(f"--per-generator must be >= 1, got {args.per_generator}")
    try:
        files = [UserFileConfig(path=p, domain=args.user_domain, language=args.user_language) for p in args.user_file]
        cfg = PoolsConfig(out_dir=args.out, seed=args.seed, per_generator=args.per_generator, user_files=files,
                          strict_user_files=args.strict_user_files)
    except ValueError as err:  # names the setting; the flags spell it --user-domain / --user-language
        parser.error(str(err).replace("pools.user_files.domain", "--user-domain")
                     .replace("pools.user_files.language", "--user-language"))
    missing = [p for p in args.user_file if not Path(p).exists()]
    if missing:
        raise MissingInputError(f"--user-file {missing[0]}: no such file or folder")
    manifest = build_pools(cfg)
    print(format_counts(manifest))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
