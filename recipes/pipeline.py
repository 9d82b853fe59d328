"""The pipeline: runs the configured stages in order on one typed config.

Stages are added here as the project grows (pools -> regenerate -> harvest -> train ->
mine -> eval); each writes its outputs under ``out_dir`` atomically.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from eagle3.atomic import atomic_write_text
from eagle3.device import cpu_native_bf16, synchronize
from eagle3.errors import Eagle3Error
from eagle3.fingerprint import sha256_file
from eagle3.target.model import check_capture, load_target
from recipes.config import PipelineConfig
from recipes.handoff import PipelineError, StageFolder, made_otherwise, redo, shaping

log = logging.getLogger(__name__)


def _regenerate(cfg: PipelineConfig, regen: Any, text: str, stage: str) -> dict[str, Any]:
    """Regenerate ``text`` (the chosen prompts, written to ``regen.pool``) into ``regen.out_dir``; a
    folder regenerated from other prompts fails before the prompts file is rewritten."""
    import hashlib

    from data_gen.regenerate import ManifestMismatchError, check_manifest, run

    try:  # a folder without a record: its manifest decides (the record names a recipe key first)
        check_manifest(Path(regen.out_dir), {"pool_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()})
        prompts = Path(regen.pool)
        if not prompts.is_file() or prompts.read_text(encoding="utf-8") != text:
            atomic_write_text(prompts, text)
        return run(regen, cfg.target)
    except ManifestMismatchError as err:
        what = (f"{err.folder} was regenerated from other prompts (the pools or the selection changed); set them "
                "back to resume" if err.key == "pool_sha256" else str(err))
        raise PipelineError(f"{stage}: {what}; or {redo(err.folder)}") from None


VAL_BATCH = "val regeneration batch (regenerate.batch_size, at most val.num_prompts / regenerate.workers)"


def quantized(cfg: PipelineConfig) -> dict[str, Any]:
    """With ``quantize`` in the stages, the target the later stages run is the converted one, whose
    folder keeps its name whatever ``quantize.*`` says: those settings shape every later stage too."""
    return shaping("quantize", cfg.quantize) if "quantize" in cfg.stages else {}


def stage_folder(cfg: PipelineConfig, stage: str, val_batch: int | None = None) -> StageFolder:
    """A stage's folder and the recipe settings that shape it, its upstream's included (``val_batch``: the
    val stage's regeneration batch, which its prompts and the workers cap)."""
    target = shaping("target", cfg.target) | quantized(cfg)
    regenerated = {**target, **shaping("select", cfg.select), **shaping("regenerate", cfg.regenerate)}
    if stage == "regenerate":
        return StageFolder(stage, Path(cfg.regenerate.out_dir), regenerated)
    if stage == "harvest":
        return StageFolder(stage, Path(cfg.harvest.out_dir), {**regenerated, **shaping("harvest", cfg.harvest)})
    if stage == "val":
        regen = {k: v for k, v in shaping("regenerate", cfg.regenerate).items() if k != "regenerate.batch_size"}
        return StageFolder(stage, Path(cfg.out_dir) / "val", {**target, **shaping("val", cfg.val), **regen,
                                                              VAL_BATCH: val_batch, **shaping("harvest", cfg.harvest)})
    raise ValueError(f"{stage}: not a stage whose folder resumes")


_PROBE_MESSAGES = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


def stage_target(cfg: PipelineConfig) -> dict[str, Any]:
    """Fetch/convert and load the target; check the aux-layer capture against HF; time a forward."""
    t0 = time.perf_counter()
    target = load_target(**asdict(cfg.target))
    load_s = time.perf_counter() - t0
    tok = target.tokenizer
    if tok.chat_template:
        text = tok.apply_chat_template(_PROBE_MESSAGES, tokenize=False, add_generation_prompt=True)
    else:
        text = _PROBE_MESSAGES[0]["content"]
    ids = torch.tensor([tok(text, add_special_tokens=tok.chat_template is None)["input_ids"]], device=target.device)
    errors = check_capture(target, ids)
    synchronize(target.device)
    t0 = time.perf_counter()
    repeats = 3
    for _ in range(repeats):
        target(ids, return_logits=False)
    synchronize(target.device)
    forward_tok_s = repeats * ids.shape[1] / (time.perf_counter() - t0)
    return {
        "target": target.name,
        "architecture": type(target.model).__name__,
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "aux_layer_ids": list(target.aux_layer_ids),
        "dtype": str(target.dtype).removeprefix("torch."),
        "dtype_chosen_by": (f"target.dtype={cfg.target.dtype}" if cfg.target.dtype != "auto" else
                            "auto: " + ("an accelerator" if target.device.type != "cpu" else
                                        "a CPU with native bf16 (AVX512-BF16/AMX)" if cpu_native_bf16()
                                        else "a CPU without native bf16")),
        "device": str(target.device),
        "has_chat_template": bool(tok.chat_template),
        "load_seconds": round(load_s, 2),
        "probe_tokens": ids.shape[1],
        "capture_max_rel_error_vs_hf": errors,
        "prefill_tokens_per_s": round(forward_tok_s, 1),
    }


def stage_pools(cfg: PipelineConfig) -> dict[str, Any]:
    """Prompt pools and held-out eval sets; reused when already built with the same config (wherever
    the folder is now); a pool built with another fails naming the key, before anything is rewritten."""
    from data_gen.pools import build_pools, format_counts, pools_config_of

    folder = Path(cfg.pools.out_dir)
    existing, wanted = pools_config_of(folder), pools_config_of(cfg.pools)
    if existing is None:
        manifest = build_pools(cfg.pools)
    else:
        missing = [spec["path"] for spec in wanted["user_files"] if spec["sha256"] is None]
        if missing:
            raise PipelineError(f"pools.user_files: {missing[0]} does not exist")
        changed = [key for key in wanted if key != "out_dir" and existing.get(key) != wanted[key]]
        if changed and changed[0] not in existing:
            raise PipelineError(f"pools: {folder} was built by an earlier version (its manifest has no "
                                f"pools.{changed[0]}); delete {folder} to rebuild it (the stages after it then "
                                "redo their part too)")
        if changed:
            key = changed[0]
            shown = (None, None) if key == "user_files" else (existing.get(key), wanted[key])  # a file's sha256
            raise made_otherwise("pools", folder, f"pools.{key}", *shown)
        manifest = json.loads((folder / "manifest.json").read_text())
        print(f"pools: up to date in {folder}")
    print(format_counts(manifest))
    return {"out_dir": cfg.pools.out_dir, **manifest["counts"]}


def stage_regenerate(cfg: PipelineConfig) -> dict[str, Any]:
    """A domain-balanced subset of the pool, every assistant turn regenerated by the target (resumable)."""
    from data_gen.pools import read_jsonl, select_balanced

    pool = Path(cfg.pools.out_dir) / f"{cfg.select.split}.jsonl"
    if not pool.is_file():
        raise PipelineError(f"{pool}: no prompt pool; run the pools stage first")
    chosen = select_balanced(read_jsonl(pool), cfg.select.num_prompts, cfg.select.domains, cfg.select.seed)
    # Similar lengths side by side: less padding in each (fixed) batch.
    chosen.sort(key=lambda r: (sum(m["role"] == "user" for m in r["messages"]),
                               sum(len(m["content"]) for m in r["messages"] if m["role"] != "assistant"), r["id"]))
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chosen)
    with stage_folder(cfg, "regenerate").handed_off():
        return _regenerate(cfg, cfg.regenerate, text, "regenerate")


def stage_harvest(cfg: PipelineConfig) -> dict[str, Any]:
    """Hidden states of the regenerated conversations into a shard store (resumable, verified);
    with ``train.data.mode=online`` (or hybrid) nothing: the train stage's producers make the states;
    colocated, only the plan and the tokens."""
    from eagle3.store.shards import verify_store

    if cfg.train.data.mode == "colocated":
        return plan_only(cfg)
    if cfg.train.data.mode != "offline":
        return {"skipped": f"train.data.mode={cfg.train.data.mode}: the train stage's producers fill the spool "
                           "harvest.out_dir"}

    with stage_folder(cfg, "harvest").handed_off():
        summary = _harvest(cfg, cfg.harvest, "harvest")
        if summary["complete"]:
            verify_store(cfg.harvest.out_dir)
    return summary


def plan_only(cfg: PipelineConfig) -> dict[str, Any]:
    """``train.data.mode=colocated``: the harvest's plan and every sample's tokens in harvest.out_dir, no
    state (the trainer's own target computes them)."""
    from data_gen.produce import produce

    return produce(cfg.harvest, cfg.target, seed=cfg.train.seed, max_epochs=0, progress=False)


def _harvest(cfg: PipelineConfig, harvest_cfg: Any, stage: str) -> dict[str, Any]:
    """Harvest; a store without a record made with other settings fails as its plan says."""
    from data_gen.harvest import HarvestMismatchError, run

    try:
        return run(harvest_cfg, cfg.target)
    except HarvestMismatchError as err:
        raise PipelineError(f"{stage}: {err}; or {redo(err.folder)}") from None


def stage_train(cfg: PipelineConfig) -> dict[str, Any]:
    """Train the draft head on the harvest store (DeepSpeed, one process here; resumable); online,
    with ``launcher.harvest_shards`` producer processes filling the spool beside it."""
    from eagle3.train.loop import train

    if cfg.train.data.mode in ("offline", "colocated"):
        return train(cfg.train, cfg.target)
    with producers(cfg, cfg.launcher.harvest_shards):
        return train(cfg.train, cfg.target)


def producer_epochs(cfg: PipelineConfig) -> int | None:
    """How many epochs the producers make: hybrid training reads only the first from them."""
    return 1 if cfg.train.data.mode == "hybrid" else None


@contextlib.contextmanager
def producers(cfg: PipelineConfig, n: int) -> Iterator[None]:
    """``n`` producer processes (``data_gen.produce``, worker i of n) for the body's online training;
    afterwards they stop (the trainer writes ``done``; a failed run is marked done for them too)."""
    import multiprocessing

    from eagle3.store.spool import DONE

    done = Path(cfg.harvest.out_dir) / DONE
    done.unlink(missing_ok=True)  # an earlier run's: this one trains again
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_producer, args=(replace(cfg.harvest, shard=f"{i}/{n}"), cfg.target),
                         kwargs={"seed": cfg.train.seed, "progress": False, "max_epochs": producer_epochs(cfg)},
                         daemon=True) for i in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        if not done.is_file():
            done.parent.mkdir(parents=True, exist_ok=True)
            done.touch()
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.terminate()


def _producer(*args: Any, **kwargs: Any) -> None:
    """A producer process of :func:`producers`: ``data_gen.produce``, ending with the run that started it."""
    from data_gen.produce import produce
    from eagle3.processes import exit_with_parent

    exit_with_parent()
    produce(*args, **kwargs)


def stage_val(cfg: PipelineConfig) -> dict[str, Any]:
    """Held-out conversations: a balanced subset of the val pool, regenerated and harvested like
    the training data (what mining scores the draft on)."""
    from data_gen.pools import read_jsonl, select_balanced

    pool = Path(cfg.pools.out_dir) / f"{cfg.val.split}.jsonl"
    if not pool.is_file():
        raise PipelineError(f"{pool}: no prompt pool; run the pools stage first")
    chosen = select_balanced(read_jsonl(pool), cfg.val.num_prompts, cfg.val.domains, cfg.val.seed)
    root = Path(cfg.out_dir) / "val"
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chosen)
    # a few prompts: split over the workers rather than one batch on one of them
    size = min(cfg.regenerate.batch_size, -(-len(chosen) // cfg.regenerate.workers))
    val_regen = replace(cfg.regenerate, pool=str(root / "prompts.jsonl"), out_dir=str(root / "regenerate"),
                        batch_size=size)
    with stage_folder(cfg, "val", size).handed_off():
        regen = _regenerate(cfg, val_regen, text, "val")
        data = root / "regenerate" / "dataset" / "regenerated.jsonl"
        summary = _harvest(cfg, replace(cfg.harvest, data=str(data), out_dir=str(root / "harvest")), "val")
    return {"prompts": len(chosen), "regenerate": regen, "harvest": summary}


def stage_mine(cfg: PipelineConfig) -> dict[str, Any]:
    """Hard-example mining rounds from the trained draft (hard_mining; resumable)."""
    from hard_mining.rounds import run_rounds

    manifest = run_rounds(cfg.mine, cfg.train, cfg.target)
    return {"rounds": [{"round": e["round"], "draft": e["draft"], "added_prompts": len(e["added_ids"]),
                        "tau_before": e["before"]["all"]["all"]["tau_sim"],
                        "tau_after": e["after"]["all"]["all"]["tau_sim"],
                        "domain_before": {k: v["tau_sim"] for k, v in e["before"]["domain"].items()},
                        "domain_after": {k: v["tau_sim"] for k, v in e["after"]["domain"].items()}}
                       for e in manifest["rounds"]]}


def eval_draft(cfg: PipelineConfig) -> str:
    """The draft the eval stage serves: ``eval.draft``, else the last mining round's, else training's final."""
    if cfg.eval.draft:
        return cfg.eval.draft
    manifest = Path(cfg.mine.out_dir) / "manifest.json"
    if "mine" in cfg.stages and manifest.is_file():
        rounds = json.loads(manifest.read_text())["rounds"]
        if rounds:
            return str(rounds[-1]["draft"])
    return str(Path(cfg.train.out_dir) / "final")


def stage_eval(cfg: PipelineConfig) -> dict[str, Any]:
    """The bundled speculative loop vs plain decoding on the eval sets: report.md, PNG plots, wandb."""
    from eagle3.target.chat import ChatFormat
    from serve_eval.eval_runs import PairSource, load_pair
    from serve_eval.evaluate import evaluate, read_prompts, write_report

    e = cfg.eval
    draft_path = eval_draft(cfg)
    out = Path(e.out_dir)
    weights = Path(draft_path) / "model.safetensors"  # the draft's contents: a retrained one at the same path
    settings = {**shaping("target", cfg.target), **quantized(cfg), "target.device": cfg.target.device,
                **shaping("pools", cfg.pools), **shaping("eval", e), "eval.draft": draft_path, "seed": cfg.seed,
                "draft_sha256": sha256_file(weights) if weights.is_file() else None}
    done = out / "report.json"  # it keeps the settings it was made with: other settings, evaluated again
    if done.is_file() and json.loads(done.read_text()).get("settings") == settings:
        print(f"eval: up to date in {out}")
        report = json.loads(done.read_text())
    else:
        target, draft = load_pair(draft_path, cfg.target.name_or_path, cfg.target.dtype, cfg.target.device)
        chat = ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)
        try:
            served = chat.in_mode(e.thinking)
        except Eagle3Error as err:  # a template without a thinking switch, named
            raise PipelineError(f"eval.thinking={e.thinking}: {err}") from None
        try:
            prompts = {name: read_prompts(Path(cfg.pools.out_dir), name, e.per_set, served) for name in e.sets}
        except Eagle3Error as err:  # a missing, empty or malformed eval set, named
            raise PipelineError(f"eval.sets: {err}") from None
        report = evaluate(target, draft, prompts, config=e.spec, params=e.sampling, max_new_tokens=e.max_new_tokens,
                          stop_ids=sorted(chat.stop_ids), seed=cfg.seed, compare=e.compare, workers=e.workers,
                          source=PairSource.of(draft_path, cfg.target.name_or_path, target))
        report.update(draft=draft_path, target=cfg.target.name_or_path, settings=settings)
        write_report(report, out, e.wandb_mode)
    return {"out_dir": str(out), "draft": draft_path, "overall": report["overall"],
            "sets": {n: {k: s[k] for k in ("tau", "speedup", "accept_per_pos")} for n, s in report["sets"].items()},
            "compare": {p: {"overall": {k: r["overall"][k] for k in ("tau", "speedup")},
                            "sets": {n: {k: s[k] for k in ("tau", "speedup")} for n, s in r["sets"].items()}}
                        for p, r in report.get("compare", {}).items()}}


def stage_report(cfg: PipelineConfig) -> dict[str, Any]:
    """``out_dir/report.md``: data, training, mining per domain and the serving evaluation, with the plots."""
    out = Path(cfg.out_dir)

    def result(name: str) -> dict[str, Any] | None:
        path = out / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    lines = [f"# EAGLE-3 pipeline report: {cfg.target.name_or_path}", ""]
    target, regen, train, mine, ev = (result(n) for n in ("target", "regenerate", "train", "mine", "eval"))
    aux_ids, num_layers = _aux_layers(cfg, target)
    if aux_ids:
        lines += [f"Target: {cfg.target.name_or_path}; the draft reads the inputs of decoder layers "
                  f"{aux_ids}" + (f" of {num_layers}" if num_layers else "") + ".", ""]
    if regen:
        lines += [f"Data: {regen.get('records', '?')} regenerated conversations ({regen.get('turns', '?')} "
                  f"assistant turns, {regen.get('new_tokens', '?')} generated tokens).", ""]
    if train:
        first, last = train.get("eval_first") or {}, train.get("eval_last") or {}
        speed = f"{train['tokens_per_s']} tokens/s" if train.get("tokens_per_s") else "(resumed: finished earlier)"
        lines += [f"Training: {train['steps']} steps at {speed}; held-out tau_sim "
                  f"{first.get('eval/tau_sim', float('nan')):.3f} -> {last.get('eval/tau_sim', float('nan')):.3f}.", ""]
    if mine and mine["rounds"]:
        domains = sorted(mine["rounds"][0]["domain_before"])
        lines += ["## Mining rounds (held-out tau_sim per domain, before -> after)", "",
                  "| round | added prompts | overall | " + " | ".join(domains) + " |",
                  "| --- | --- | --- | " + " | ".join("---" for _ in domains) + " |"]
        for r in mine["rounds"]:
            cells = [f"{r['domain_before'][d]:.3f} -> {r['domain_after'][d]:.3f}" for d in domains]
            lines.append(f"| {r['round']} | {r['added_prompts']} | {r['tau_before']:.3f} -> {r['tau_after']:.3f} | "
                         + " | ".join(cells) + " |")
        lines.append("")
    if ev:
        eval_md = Path(ev["out_dir"]) / "report.md"
        lines += [f"## Serving evaluation (draft {ev['draft']})", ""]
        if eval_md.is_file():
            lines += eval_md.read_text().splitlines()[2:] + [""]
        for png in ("tau_by_set.png", "acceptance_by_position.png", "speedup.png"):
            if (Path(ev["out_dir"]) / png).is_file():
                rel = os.path.relpath(Path(ev["out_dir"]) / png, out)
                lines.append(f"![{png}]({rel})")
    times = {n: r["stage_seconds"] for n in cfg.stages if n != "report" and (r := result(n)) and "stage_seconds" in r}
    if times:
        lines += ["", "Stage times (s; a stage reused from an earlier run takes seconds): "
                  + ", ".join(f"{n} {t:g}" for n, t in times.items()) + "."]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    from eagle3.dashboards import spec

    atomic_write_text(out / "wandb_dashboard.json", json.dumps(spec(), indent=1) + "\n")
    runs = sorted(str(p) for p in out.glob("**/wandb/offline-run-*"))
    return {"report": str(out / "report.md"), "target": cfg.target.name_or_path, "aux_layer_ids": aux_ids,
            "wandb_dashboard": str(out / "wandb_dashboard.json"), "wandb_offline_runs": runs}


def _aux_layers(cfg: PipelineConfig, target: dict[str, Any] | None) -> tuple[list[int] | None, int | None]:
    """The aux layer ids this run used and the target's layer count: as the harvest store records
    them, else as the target stage did."""
    manifest = Path(cfg.harvest.out_dir) / "manifest.json"
    found = json.loads(manifest.read_text())["spec"] if manifest.is_file() else target or {}
    ids = found.get("aux_layer_ids")
    return (list(ids) if ids else None), found.get("num_layers")


def quantized_target_dir(cfg: PipelineConfig) -> Path:
    return Path(cfg.quantize.out_dir or Path(cfg.out_dir) / "nvfp4-target")


def on_quantized_target(cfg: PipelineConfig) -> PipelineConfig:
    """``cfg`` for the stages after ``quantize``: the target is the NVFP4 checkpoint, run emulated."""
    return replace(cfg, target=replace(cfg.target, name_or_path=str(quantized_target_dir(cfg))))


def stage_quantize(cfg: PipelineConfig) -> dict[str, Any]:
    """Convert the target to NVFP4 (compressed-tensors, what vLLM loads), calibrated on the pools;
    reused when already converted from the same target with the same settings."""
    from transformers import AutoTokenizer

    from data_gen.nvfp4 import REPORT_FILE, calibration_sequences, convert
    from eagle3.target.source import resolve_target

    q = cfg.quantize
    out = quantized_target_dir(cfg)
    source = resolve_target(cfg.target.name_or_path).location
    calib_path = q.calibration or str(Path(cfg.pools.out_dir) / "train.jsonl")
    settings = {"source": str(source), "mode": q.mode, "ignore": list(q.ignore), "calibration_file": calib_path,
                "samples": q.samples, "max_tokens": q.max_tokens, "seed": cfg.seed}
    report_path = out / REPORT_FILE  # it keeps the settings it was made with: other settings, converted again
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    if report.get("settings") == settings:
        print(f"quantize: up to date in {out}")
    else:
        calib: list[list[int]] = []
        if q.mode == "w4a4":
            tokenizer = AutoTokenizer.from_pretrained(source)
            calib = calibration_sequences(calib_path, tokenizer, samples=q.samples, max_tokens=q.max_tokens,
                                          seed=cfg.seed)
        report = convert(cfg.target.name_or_path, out, mode=q.mode, calibration=calib, ignore=q.ignore,
                         extra={"settings": settings})
    return {"out_dir": str(out), "mode": report["mode"], "quantized_linears": report["quantized_linears"],
            "calibration_tokens": report["calibration_tokens"],
            "weight_relative_error_mean": round(report["weight_relative_error"]["mean"], 5)}


def stage_size(cfg: PipelineConfig) -> dict[str, Any]:
    """The draft's shape and trainable parameters, from the target's config alone (no weights), and
    the data the run will regenerate: domains, thinking mode, tool-use and agent sources."""
    from eagle3.train.size import size_draft

    r = cfg.regenerate
    data = {"domains": list(cfg.select.domains), "num_prompts": cfg.select.num_prompts,
            "thinking": r.thinking if r.thinking != "mix" else f"mix ({r.thinking_on_fraction:.0%} on)",
            "tool_sources": [s for s in cfg.pools.sources if s in ("bfcl", "bfcl_agent", "code_agent")],
            "max_new_tokens": r.max_new_tokens, "backend": r.backend}
    return {**size_draft(cfg.target, cfg.train), "data": data}


STAGES: dict[str, Callable[[PipelineConfig], dict[str, Any]]] = {
    "size": stage_size, "target": stage_target, "pools": stage_pools, "quantize": stage_quantize,
    "regenerate": stage_regenerate, "harvest": stage_harvest, "train": stage_train, "val": stage_val,
    "mine": stage_mine, "eval": stage_eval, "report": stage_report,
}


def run_pipeline(cfg: PipelineConfig) -> dict[str, dict[str, Any]]:
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown:
        raise PipelineError(f"stages: unknown {unknown}; known stages are {list(STAGES)}")
    torch.manual_seed(cfg.seed)
    if not torch.cuda.is_available():
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    results: dict[str, dict[str, Any]] = {}
    at = cfg.stages.index("quantize") if "quantize" in cfg.stages else None
    if at is not None and "pools" in cfg.stages[at:] and not cfg.quantize.calibration:
        raise PipelineError("stages: quantize calibrates on the pools: put it after pools, or set quantize.calibration")
    for i, name in enumerate(cfg.stages):
        log.info("stage %s", name)
        if at is not None and i == at + 1:
            cfg = on_quantized_target(cfg)  # every stage after quantize runs on the NVFP4 checkpoint
        started = time.perf_counter()
        results[name] = STAGES[name](cfg)
        results[name]["stage_seconds"] = round(time.perf_counter() - started, 1)  # a reused stage: seconds
        atomic_write_text(out / f"{name}.json", json.dumps(results[name], indent=2) + "\n")
        print(json.dumps({"stage": name, **results[name]}), flush=True)
    times = {name: r["stage_seconds"] for name, r in results.items()}
    print(json.dumps({"stage": "summary", "stage_seconds": times, "seconds": round(sum(times.values()), 1)}),
          flush=True)
    return results
