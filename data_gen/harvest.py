"""Harvest (library; the stage CLI is ``python -m data_gen.harvest``): the target's hidden states for
regenerated conversations into a shard store.

    python -m data_gen.harvest --data runs/regen/dataset/regenerated.jsonl --out runs/harvest \\
        [--target smollm2-135m] [--dtype bfloat16|float8_e4m3fn|float32] [--shard i/n] [--backend hf|vllm]
    python -m data_gen.harvest verify runs/harvest
    python -m data_gen.harvest compare runs/harvest-hf runs/harvest-vllm     # max relative error per state

Every conversation is tokenised with the target's chat template and loss-masked on exactly
the assistant tokens, each reply as the target saw and wrote it (:func:`tokenize_records`); over-long ones
are truncated, ones left without an assistant token skipped (both counted). The samples are
cut into shards of bounded size by a plan that depends only on the token counts, so every
worker (``--shard i/n`` takes shards ``j % n == i``) and every rerun agrees on it. Each shard
is written atomically when complete; a rerun skips finished shards, and whoever finishes
the last shard writes ``manifest.json`` (sha256 per shard). Killed at any moment and rerun,
the store equals an uninterrupted run's, byte for byte. ``plan.json`` pins the settings; a
rerun with other settings fails naming the key.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout

from data_gen.config import HarvestConfig
from data_gen.kept_states import KeptStates, kept_backend
from eagle3.atomic import atomic_write_text, remove_leftovers
from eagle3.cli import add_dataclass_arguments, dataclass_from_args
from eagle3.config import TargetConfig, add_target_arguments
from eagle3.conversations import ConversationError, check_tools, read_pool
from eagle3.errors import Eagle3Error, run_cli
from eagle3.fingerprint import UNKNOWN_WEIGHTS, sha256_file, tokenizer_fingerprint, weights_fingerprint
from eagle3.store.capture import HFCapture, capture_shard
from eagle3.store.planned import PLAN
from eagle3.store.shards import (
    HarvestSpec,
    StoreError,
    bytes_per_token,
    compare_stores,
    projected_bytes,
    read_manifest,
    shard_entry,
    shard_name,
    shard_plan,
    verify_store,
    write_manifest,
    write_shard,
)
from eagle3.target.chat import ChatFormat, ChatFormatError
from eagle3.target.model import Target, load_target
from eagle3.target.positions import context_length
from eagle3.target.source import target_identity


class HarvestError(Eagle3Error, RuntimeError):
    """The harvest cannot proceed; the message names the file, sample or setting."""


class NothingToHarvestError(HarvestError):
    """No record of the data gives a sample with a loss (none has a reply, or every reply was cut off)."""


def tokenize_records(records: Sequence[dict[str, Any]], base_chat: ChatFormat, max_seq_len: int,
                     counts: Counter[str], cut: list[tuple[str, int]] | None = None,
                     ) -> list[tuple[str, list[int], list[int]]]:
    """(id, input_ids, loss_mask) per usable sample, in order; truncations and skips counted.

    A one-reply record is the reply as the target saw and wrote it (:meth:`ChatFormat.tokenize_reply`:
    its generation prompt, its generated ids, its stop). A multi-turn record is one sample when the
    template renders its history as the target saw it (:meth:`ChatFormat.tokenize_conversation`),
    else one sample per reply, ``<id>-t<k>``, each built like a one-reply record (so too where the
    regeneration kept each turn's prompt ids: the template writes the date). User turns after
    the last reply are dropped (nothing in them is trained). A per-turn sample that an earlier
    version's regeneration wrote (``generation.turn_index``) is its last reply's sample. A record
    regenerated with the template's thinking switch set (``generation.thinking``) is rendered with it,
    one with ``tools`` with its function schemas (:meth:`ChatFormat.with_tools`)."""
    out, seen = [], set()
    for record in records:
        messages, generation = record["messages"], record.get("generation") or {}
        if str(record["id"]) in seen:  # samples are looked up by id (sample weights, mining)
            raise HarvestError(f"record id {record['id']!r} appears twice in the data; make the ids unique")
        seen.add(str(record["id"]))
        ends = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        given = generation.get("turns") or []
        turns = given if len(given) == len(ends) else [{}] * len(ends)  # regenerated: one entry per reply
        if ends:
            messages = messages[: ends[-1] + 1]
        sample_id = str(record["id"])
        mode = generation.get("thinking")
        if mode is not None and not isinstance(mode, bool):
            raise HarvestError(f"sample {sample_id}: generation.thinking={mode!r}: expected true or false")
        try:
            chat = base_chat if mode is None else base_chat.with_thinking(mode)  # as the regeneration rendered it
            chat = chat.with_tools(check_tools(record["tools"]) if record.get("tools") is not None else None)
            if "turn_index" in generation:  # a per-turn sample: its one entry is its last reply's
                samples = [(sample_id, *chat.tokenize_reply(messages, given[-1] if given else None))]
            elif len(ends) == 1:
                samples = [(sample_id, *chat.tokenize_reply(messages, turns[0]))]
            elif ends and not (chat.history_is_context(messages) and not any("prompt_ids" in t for t in turns)
                               and all(_as_written(chat, messages[end]["content"], turn)
                                       for end, turn in zip(ends, turns, strict=True))):
                samples = [(f"{sample_id}-t{k}", *chat.tokenize_reply(messages[: end + 1], turns[k]))
                           for k, end in enumerate(ends)]
            else:
                ended = [turn.get("finish_reason") != "length" for turn in turns]
                samples = [(sample_id, *chat.tokenize_conversation(messages, ended))]
        except (ChatFormatError, ConversationError) as err:
            raise HarvestError(f"sample {sample_id}: {err}") from err
        for name, ids, mask in samples:
            if len(ids) > max_seq_len:
                if cut is not None:
                    cut.append((name, len(ids)))
                ids, mask = ids[:max_seq_len], mask[:max_seq_len]
                counts["truncated"] += 1
            if not any(mask):
                counts["skipped_empty_loss_mask"] += 1
                continue
            out.append((name, ids, mask))
    return out


def _as_written(chat: ChatFormat, content: str, turn: dict[str, Any]) -> bool:
    """Whether re-tokenising a reply's text inside the whole conversation can give the ids the target
    wrote: not for an empty reply (only its stop was written), nor where the generated ids are not
    what the text tokenises to (a cut multi-byte character decoded to U+FFFD, a split the tokenizer
    would not make). Otherwise the conversation is harvested one reply at a time, from the ids."""
    if not content:
        return False
    ids = turn.get("token_ids")
    return not isinstance(ids, list) or chat.tokenizer(content, add_special_tokens=False)["input_ids"] == ids


class VllmRows:
    """:class:`data_gen.vllm_capture.VllmCapture` with rows shaped like :class:`HFCapture`'s."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def capture(self, sequences: Sequence[Sequence[int]]) -> list[dict[str, torch.Tensor]]:
        return [{"aux": aux, "last": last} for aux, last in self.inner.capture(sequences)]


def _spec_and_backend(cfg: HarvestConfig, target_cfg: TargetConfig,
                      target: Target | None) -> tuple[HarvestSpec, ChatFormat, Any]:
    if cfg.backend == "vllm" and (cfg.store == "topk" or target is not None):
        raise HarvestError("harvest.backend=vllm stores the pre-norm last state (store=last) and loads "
                           "the target itself")
    if cfg.backend == "hf":
        if target is None:
            target = load_target(target_cfg.name_or_path, dtype=target_cfg.dtype, device=target_cfg.device,
                                 aux_layer_ids=target_cfg.aux_layer_ids,
                                 attn_implementation=target_cfg.attn_implementation,
                                 trust_remote_code=target_cfg.trust_remote_code, nvfp4_mode=target_cfg.nvfp4_mode,
                                 architecture=target_cfg.architecture)
        tokenizer, layers = target.tokenizer, target.aux_layer_ids
        shape = (target.num_layers, target.hidden_size, target.vocab_size)
        folder, generation_config = target.model.name_or_path, target.model.generation_config
        backend: Any = HFCapture(target, cfg.topk)
    else:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        from data_gen.vllm_capture import VllmCapture
        from data_gen.vllm_generate import require_vllm
        from eagle3.target.model import check_architecture, check_aux_layer_ids, default_aux_layer_ids
        from eagle3.target.source import resolve_target

        require_vllm("harvest.backend")

        folder = resolve_target(target_cfg.name_or_path).location
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=target_cfg.trust_remote_code)
        config = AutoConfig.from_pretrained(folder, trust_remote_code=target_cfg.trust_remote_code)
        if target_cfg.architecture:
            check_architecture(config, target_cfg.architecture, str(folder))
        text = config.get_text_config()  # a multimodal checkpoint's language model
        shape = (text.num_hidden_layers, text.hidden_size, text.vocab_size)
        n = text.num_hidden_layers
        layers = (default_aux_layer_ids(n) if target_cfg.aux_layer_ids is None
                  else check_aux_layer_ids(target_cfg.aux_layer_ids, n))
        try:
            generation_config = GenerationConfig.from_pretrained(folder)
        except OSError:
            generation_config = None
        backend = VllmRows(VllmCapture(folder, layers, dtype="float32"))
    chat = ChatFormat.for_tokenizer(tokenizer, generation_config)
    context = context_length(target.model.config if target is not None else config)
    max_seq_len = min(cfg.max_seq_len, context) if context else cfg.max_seq_len
    if max_seq_len < cfg.max_seq_len:
        print(f"harvest.max_seq_len={cfg.max_seq_len}: the target attends over {context} positions; longer samples "
              f"are cut at {context}", file=sys.stderr)
    spec = HarvestSpec(
        target=target_identity(target_cfg.name_or_path), weights_fingerprint=weights_fingerprint(folder),
        tokenizer_sha256=tokenizer_fingerprint(tokenizer), chat_template_sha256=chat.template_sha256,
        num_layers=shape[0], hidden_size=shape[1], vocab_size=shape[2],
        aux_layer_ids=tuple(layers), dtype=cfg.dtype, store=cfg.store, topk=cfg.topk, max_seq_len=max_seq_len,
    )
    if cfg.backend == "hf":  # the states the regeneration kept, where they fit this harvest
        assert target is not None
        backend = kept_backend(cfg.fused, Path(cfg.data), spec, str(target.dtype).removeprefix("torch."), backend)
    return spec, chat, backend


_CAUSES = ("target", "weights_fingerprint", "tokenizer_sha256", "chat_template_sha256", "num_layers", "hidden_size",
           "vocab_size")


class HarvestMismatchError(HarvestError):
    """The store was harvested with other settings: ``key`` (``spec.dtype``, ``settings.batch_size``,
    ``data_sha256``...), ``old`` and ``new`` say which, ``folder`` where."""

    def __init__(self, message: str, folder: Path, key: str, old: Any = None, new: Any = None) -> None:
        super().__init__(message)
        self.folder, self.key, self.old, self.new = folder, key, old, new


def _check_plan(out_dir: Path, plan: dict[str, Any]) -> None:
    path = out_dir / PLAN
    with FileLock(str(out_dir / ".manifest.lock")):  # workers starting together: one writes, none meets a temporary
        remove_leftovers(out_dir, [PLAN])  # of a run killed while writing it
        if not path.is_file():
            atomic_write_text(path, json.dumps(plan, indent=2) + "\n")
            return
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise HarvestError(f"{path}: not readable JSON ({err}); it records the settings this store was "
                               "harvested with: restore it, or harvest into another --out") from None
    if not isinstance(saved, dict):
        raise HarvestError(f"{path}: expected a JSON object (the settings this store was harvested with)")
    spec = saved.get("spec")
    if isinstance(spec, dict) and isinstance(spec.get("target"), str):
        spec["target"] = target_identity(spec["target"])  # earlier versions: a path as typed
        known = spec.get("weights_fingerprint") not in (None, *UNKNOWN_WEIGHTS)
        if known and spec.get("weights_fingerprint") == plan["spec"].get("weights_fingerprint"):
            spec["target"] = plan["spec"]["target"]  # the same weights, wherever the folder is now
    for section in ("spec", "settings", "data_sha256"):
        old, new = saved.get(section), plan[section]
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            differ = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
            key = next((k for k in _CAUSES if k in differ), differ[0])  # another target before its shapes
            raise HarvestMismatchError(f"{out_dir} was harvested with {section}.{key}={old.get(key)!r}, this run has "
                                       f"{new.get(key)!r}; use the same settings to resume, or another --out",
                                       out_dir, f"{section}.{key}", old.get(key), new.get(key))
        raise HarvestMismatchError(f"{out_dir} was harvested from other data ({section} differs); use another --out",
                                   out_dir, section)


@dataclass
class HarvestPlan:
    """What a harvest (or an online producer) works from: the spec, the capture backend, the
    tokenised samples, their shard plan, and the record ``plan.json`` pins in the output folder."""

    spec: HarvestSpec
    backend: Any
    samples: list[tuple[str, list[int], list[int]]]
    lengths: list[int]
    plan: list[tuple[int, int]]
    counts: Counter[str]
    settings: dict[str, Any]
    record: dict[str, Any]


def plan_harvest(cfg: HarvestConfig, target_cfg: TargetConfig, target: Target | None = None) -> HarvestPlan:
    """Read and tokenise ``cfg.data``, load the target (or use ``target``), plan the shards, and pin the
    plan in ``cfg.out_dir`` (a rerun with other settings or data fails naming the key)."""
    if target is None and cfg.backend == "hf":
        torch.set_num_threads(cfg.threads)
    out_dir, data = Path(cfg.out_dir), Path(cfg.data)
    if not data.is_file():
        raise HarvestError(f"{data}: no such file (regenerate first)")
    try:
        records = read_pool(data)
    except ConversationError as err:  # a bad row, named file:line
        raise HarvestError(str(err)) from None
    spec, chat, backend = _spec_and_backend(cfg, target_cfg, target)
    counts: Counter[str] = Counter(records=len(records))
    cut: list[tuple[str, int]] = []
    samples = tokenize_records(records, chat, spec.max_seq_len, counts, cut)
    if cut:  # named, not silent: the store keeps their first max_seq_len tokens
        named = ", ".join(f"{name} ({n} tokens)" for name, n in cut[:5]) + (f" and {len(cut) - 5} more" if len(cut) > 5
                                                                           else "")
        print(f"harvest: {len(cut)} sample(s) longer than max_seq_len={spec.max_seq_len} are cut to it: {named} "
              f"(all of them: {out_dir / PLAN}, key \"cut\")", file=sys.stderr)
    if not samples:
        raise NothingToHarvestError(f"{data}: no sample to harvest ({len(records)} records, {dict(counts)}); a "
                                    "record needs an assistant reply to train on (regenerate the pool first)")
    lengths = [len(ids) for _, ids, _ in samples]
    plan = shard_plan(lengths, bytes_per_token(spec), int(cfg.max_shard_mb * 2**20))
    settings = {k: v for k, v in asdict(cfg).items() if k not in HarvestConfig.RUN_ONLY}
    record = {"spec": spec.to_json(), "settings": settings, "data_sha256": sha256_file(data), "shards": plan,
              "counts": dict(counts), "cut": [{"sample": name, "tokens": n} for name, n in cut]}
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_plan(out_dir, record)
    return HarvestPlan(spec, backend, samples, lengths, plan, counts, settings, record)


def run(cfg: HarvestConfig, target_cfg: TargetConfig, *, target: Target | None = None,
        progress: bool = True) -> dict[str, Any]:
    """Harvest this worker's shards of ``cfg.data`` into ``cfg.out_dir``; finalise the store if complete."""

    started = time.perf_counter()
    out_dir = Path(cfg.out_dir)
    hp = plan_harvest(cfg, target_cfg, target)
    spec, backend, samples, lengths, plan, counts, settings = (hp.spec, hp.backend, hp.samples, hp.lengths, hp.plan,
                                                               hp.counts, hp.settings)
    worker, workers = cfg.worker
    lock = FileLock(str(out_dir / f".worker-{worker}-of-{workers}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout as err:
        raise HarvestError(f"{out_dir}: worker {cfg.shard} is already running there") from err
    try:
        return _harvest_shards(cfg, out_dir, spec, backend, samples, lengths, plan, counts, settings, started, progress)
    finally:
        lock.release()


def _remove_stale_temps(out_dir: Path, worker: int, workers: int) -> None:
    """Temporary shard files of this worker's shards left by a killed run (never complete)."""
    for tmp in out_dir.glob(".shard-*.safetensors.*.tmp"):
        index = tmp.name.split(".")[1].removeprefix("shard-")
        if index.isdigit() and int(index) % workers == worker:
            tmp.unlink(missing_ok=True)


def _harvest_shards(cfg: HarvestConfig, out_dir: Path, spec: HarvestSpec, backend: Any,
                    samples: list[tuple[str, list[int], list[int]]], lengths: list[int], plan: list[tuple[int, int]],
                    counts: Counter[str], settings: dict[str, Any], started: float, progress: bool) -> dict[str, Any]:
    from tqdm import tqdm

    worker, workers = cfg.worker
    _remove_stale_temps(out_dir, worker, workers)
    mine = [j for j in range(len(plan)) if j % workers == worker and not (out_dir / shard_name(j)).is_file()]
    total_tokens = sum(sum(lengths[slice(*plan[j])]) for j in mine)
    projected = projected_bytes(lengths, spec)
    done_tokens, capture_s = 0, 0.0
    bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, desc=f"harvest {cfg.shard}", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    with bar:
        for j in mine:
            t0 = time.perf_counter()
            shard = capture_shard(backend, samples, plan[j], cfg.batch_size, on_batch=bar.update)
            capture_s += time.perf_counter() - t0
            done_tokens += sum(lengths[slice(*plan[j])])
            write_shard(out_dir / shard_name(j), shard, spec)
            used = sum(p.stat().st_size for p in out_dir.glob("shard-*.safetensors"))
            bar.set_postfix_str(f"{done_tokens / max(capture_s, 1e-9):.0f} tok/s, disk {used >> 20} MiB of "
                                f"~{projected >> 20} MiB")
    manifest = finalize(out_dir, spec, plan, lengths, samples, counts, settings)
    return {
        "stage": "harvest", "out": str(out_dir), "worker": cfg.shard, "shards_total": len(plan),
        "shards_run": len(mine), "complete": manifest is not None, **dict(counts),
        "samples": len(samples), "tokens_this_run": done_tokens,
        "capture_tokens_per_s": round(done_tokens / capture_s, 1) if capture_s else None,
        "bytes_per_token": round(bytes_per_token(spec), 1), "projected_bytes": projected,
        **({"kept_states_read": backend.found, "kept_states_missing": backend.computed}
           if isinstance(backend, KeptStates) else {}),
        "wall_seconds": round(time.perf_counter() - started, 2),
    }


def finalize(out_dir: Path, spec: HarvestSpec, plan: list[tuple[int, int]], lengths: list[int],
             samples: list[tuple[str, list[int], list[int]]], counts: Counter[str],
             settings: dict[str, Any]) -> dict[str, Any] | None:
    """Write the manifest once every shard exists (any worker may; the lock makes it once)."""
    if not all((out_dir / shard_name(j)).is_file() for j in range(len(plan))):
        return None
    with FileLock(str(out_dir / ".manifest.lock")):
        if (out_dir / "manifest.json").is_file():
            manifest = read_manifest(out_dir)
            for entry in manifest["shards"]:  # a cheap look; `harvest verify` checks every byte
                path = out_dir / entry["file"]
                if not path.is_file() or path.stat().st_size != entry["bytes"]:
                    raise HarvestError(f"{path}: missing or not the size the manifest records (changed since the "
                                       "harvest); delete it and manifest.json, then rerun to harvest it again")
            return manifest
        remove_leftovers(out_dir, ["manifest.json"])  # of a run killed while writing it
        shards = []
        for j, (a, b) in enumerate(plan):
            path = out_dir / shard_name(j)
            shards.append(shard_entry(path, b - a, sum(lengths[a:b]), sum(sum(samples[i][2]) for i in range(a, b))))
        return write_manifest(out_dir, spec, shards, dict(counts), settings)


def build_parser() -> argparse.ArgumentParser:
    """Every HarvestConfig field a flag (its docstring the help), and the target's."""
    parser = argparse.ArgumentParser(prog="python -m data_gen.harvest", description=__doc__.splitlines()[0])
    add_dataclass_arguments(parser, HarvestConfig, required=("data", "out_dir"), aliases={"out_dir": "--out"})
    add_target_arguments(parser)
    parser.add_argument("--aux-layer-ids", default=None, help="comma-separated; default 2,N//2,N-3")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def configs_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[HarvestConfig, TargetConfig]:
    """The harvest's and the target's settings from :func:`build_parser`'s flags (a bad one: the
    parser's one-line error, naming it)."""
    try:
        cfg = dataclass_from_args(HarvestConfig, args)
        try:
            layers = None if args.aux_layer_ids is None else [int(x) for x in args.aux_layer_ids.split(",")]
        except ValueError:
            parser.error(f"--aux-layer-ids={args.aux_layer_ids!r}: expected comma-separated integers")
        target_cfg = TargetConfig(name_or_path=args.target, dtype=args.target_dtype, device=args.device,
                                  aux_layer_ids=layers)
    except ValueError as err:
        parser.error(str(err))
    return cfg, target_cfg


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:
        if len(argv) != 3:
            print("usage: python -m data_gen.harvest compare REFERENCE_STORE OTHER_STORE", file=sys.stderr)
            return 2
        try:
            errors = compare_stores(argv[1], argv[2])
        except StoreError as err:
            print(f"compare: error: {err}", file=sys.stderr)
            return 1
        print(json.dumps({"max_relative_error": errors}))
        return 0
    if argv[:1] == ["verify"]:
        if len(argv) != 2:
            print("usage: python -m data_gen.harvest verify STORE_DIR", file=sys.stderr)
            return 2
        try:
            manifest = verify_store(argv[1])
        except StoreError as err:
            print(f"verify: error: {err}", file=sys.stderr)
            return 1
        print(json.dumps({"verified": argv[1], "shards": len(manifest["shards"]), "samples": manifest["samples"],
                          "tokens": manifest["tokens"], "bytes": manifest["bytes"]}))
        return 0
    return run_cli("harvest", _harvest, argv)


def _harvest(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg, target_cfg = configs_from_args(parser, args)
    print(json.dumps(run(cfg, target_cfg, progress=not args.no_progress)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
