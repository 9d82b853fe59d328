"""Stage: serve the eval sets with the bundled speculative loop and report acceptance and speed.

    python -m serve_eval.evaluate --draft runs/train/best --pools runs/pools --out runs/serve \\
        [--target smollm2-135m] [--sets mtbench,humaneval,gsm8k,multilingual] [--per-set 10] \\
        [--max-new-tokens 96] [--mode chain|tree] [--k 3] [--topk 4] [--budget 16] [--temperature 0]

For every prompt (its first user turn, or its turns up to the request; the target's chat template) it
runs plain decoding and speculative decoding in the same loop
(:class:`serve_eval.spec_decode.SpeculativeDecoder`, batch 1), and writes to ``--out``:

* ``report.json``: per eval set and overall: tau (tokens per target forward, the bonus token
  included), acceptance per position, tokens/s of both, speedup (plain time / speculative time for
  the same prompts), time to first token, and the draft / verify / other split; greedy runs also
  count prompts whose output equals plain decoding and report each divergence with the target's
  top-2 logit margin at the first differing token (a near-tie below 1e-4 may flip under batched
  verification; anything else is a failure);
* the machine's cost model (``overall.cost_model``: t(1), the verify forward, a draft step, the
  break-even tau, the ceiling, the prediction at the measured tau and what that tau gives where a
  verify costs what one token does), so a speedup below 1 on a CPU reads with its cause;
* ``report.md`` (a table) and ``acceptance_by_position.png``, ``tau_by_set.png``, ``speedup.png``;
* a wandb run under ``wandb/`` (offline by default) with the same figures and a per-prompt table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3.atomic import atomic_write_text
from eagle3.cli import add_dataclass_arguments, dataclass_from_args
from eagle3.config import SamplingConfig, add_target_arguments
from eagle3.draft.metrics import (
    CONTEXT_BUCKETS,
    REPLY_PARTS,
    acceptance_by_context,
    acceptance_by_part,
    acceptance_per_position,
    accepted_by_source,
    served_tau,
)
from eagle3.errors import ConfigError, InputError, MissingInputError, run_cli
from serve_eval.config import EvalConfig, SpecConfig
from serve_eval.eval_runs import (
    PairSource,
    Served,
    Workers,
    eval_workers,
    load_pair,
    make_decoders,
    serve,
)
from serve_eval.spec_decode import DecodeStats


def prompt_end(turns: list[Any]) -> int | None:
    """Where an eval record's prompt ends: its last user turn or tool result before the first reply left
    to write (an assistant turn without text or calls, as MT-Bench's second turn waits for the first's
    reply, or none). A reference answer after the request is not part of it; a history of written
    replies (long_chat) and calls with their results (the agent set) is."""
    end = None
    for i, m in enumerate(turns):
        if not isinstance(m, dict):
            break
        if m.get("role") in ("user", "tool"):
            end = i
        elif m.get("role") == "assistant" and not m.get("content") and not m.get("tool_calls"):
            break
    return end


def read_prompts(pools: Path, name: str, per_set: int, chat: Any) -> list[list[int]]:
    """The prompts of ``per_set`` records of ``pools/eval/<name>.jsonl`` (the first user turn, or the
    turns up to the request: :func:`prompt_end`), as prompt ids.

    A set whose records name several languages (the multilingual one: 20 per language, one
    language after another) is taken round-robin over its languages in file order, so that its
    first prompts span them all instead of being the first language's.
    """
    from eagle3.conversations import ConversationError, check_messages, check_tools, iter_jsonl, take_in_turn

    path = pools / "eval" / f"{name}.jsonl"
    if not path.is_file():
        raise MissingInputError(f"{path}: missing (build the pools: python -m data_gen.pools --out {pools})")
    by_language: dict[Any, list[tuple[str, dict]]] = {}
    for where, record in iter_jsonl(path):
        if isinstance(record, Exception):
            raise InputError(f"{where}: {record}")
        if not isinstance(record, dict):
            raise InputError(f"{where}: not a JSON object")
        by_language.setdefault(record.get("language"), []).append((where, record))
    out = []
    for where, record in take_in_turn(by_language.values(), per_set):
        messages = record.get("messages")
        turns = messages if isinstance(messages, list) else []
        last = prompt_end(turns)
        if last is None:
            raise InputError(f"{where}: no user message in 'messages'")
        try:
            tools = check_tools(record["tools"]) if record.get("tools") is not None else None
            prompt = check_messages(messages[: last + 1])
        except ConversationError as err:
            raise InputError(f"{where}: {err}") from None
        out.append(chat.with_tools(tools).prompt_ids(prompt))
    if not out:
        raise InputError(f"{path}: no prompts in it (an eval set needs at least one record)")
    return out


def summarise(spec: list[DecodeStats], plain: list[DecodeStats],
              parts: list[list[bool]] | None = None) -> dict[str, Any]:
    """One eval set (or all of them): pooled over prompts; ``parts``: :func:`round_parts` per prompt."""
    accepted = [a for s in spec for a in s.accepted]
    depths = [d for s in spec for d in (s.depths or [s.proposed] * len(s.accepted))]
    contexts = [c for s in spec for c in s.contexts]
    sources = [r for s in spec for r in (s.sources or [(a, 0, 0) for a in s.accepted])]
    thinking = [t for p in parts for t in p] if parts is not None else [False] * len(accepted)
    k = max((s.proposed for s in spec), default=0)
    spec_s = sum(s.seconds_total for s in spec)
    plain_s = sum(s.seconds_total for s in plain)
    spec_tokens = sum(s.new_tokens for s in spec)
    plain_tokens = sum(s.new_tokens for s in plain)
    decode_s = sum(s.seconds_total - s.seconds_prefill for s in spec)
    return {
        "prompts": len(spec),
        "tau": round(served_tau(accepted), 4),
        "rounds": len(accepted),
        "accept_per_pos": [round(a, 4) for a in acceptance_per_position(accepted, depths, k)],
        "accepted_by": {**accepted_by_source(sources), "lookup_rounds": sum(1 for s in spec for n in s.lookup if n)},
        "by_context": acceptance_by_context(accepted, depths, contexts, k, sources),
        "by_part": acceptance_by_part(accepted, depths, thinking, k),
        "spec_tokens_per_s": round(spec_tokens / spec_s, 2) if spec_s else None,
        "plain_tokens_per_s": round(plain_tokens / plain_s, 2) if plain_s else None,
        "speedup": round((plain_s / max(plain_tokens, 1)) / (spec_s / max(spec_tokens, 1)), 3) if spec_s else None,
        "ttft_s": round(sum(s.seconds_prefill for s in spec) / max(len(spec), 1), 4),
        "time_split": {"draft": round(sum(s.seconds_draft for s in spec) / max(decode_s, 1e-9), 3),
                       "verify": round(sum(s.seconds_verify for s in spec) / max(decode_s, 1e-9), 3)},
    }


def evaluate(target: Any, draft: Any, prompts: dict[str, list[list[int]]], *, config: SpecConfig,
             params: SamplingConfig, max_new_tokens: int, stop_ids: Sequence[int], seed: int = 0,
             progress: bool = True, compare: Sequence[str] = (), workers: int = 1,
             source: PairSource | None = None) -> dict[str, Any]:
    """Plain and speculative generation of every prompt, with ``config``'s proposer and each of
    ``compare`` (the same settings, another proposer) on the same prompts; the report's data.

    ``workers`` > 1 serves the prompts from that many processes in turn (this one and ``workers - 1``
    that load the pair from ``source``, with this process's torch threads), each prompt's plain and
    speculative runs in the same process: the same tokens and draft tau as one process, in about
    1 / ``workers`` of the time (capped by :func:`eval_workers` at the cores or GPUs). A lookup's
    policy learns from the prompts its process serves and prices its branches with that process's
    timed verify, so the lookup's and the hybrid's figures move with the split, as they move with
    the machine's load.
    """
    from tqdm import tqdm

    if workers > 1 and source is None:
        raise ValueError("evaluate: workers > 1 needs the pair's source, to load it in each worker")
    items = [(name, i, prompt) for name, ps in prompts.items() for i, prompt in enumerate(ps)]
    workers = max(1, min(eval_workers(workers, str(target.device), torch.get_num_threads()), len(items)))
    stops = frozenset(stop_ids)
    pool = Workers(workers, source, (config, tuple(compare), params, max_new_tokens, stops, seed))
    served: list[Served] = []
    bar = tqdm(total=len(items), desc="serve_eval", disable=not progress)

    def done(one: Served) -> None:
        others = pool.collect(False)
        served.extend([one, *others])
        bar.update(1 + len(others))

    try:
        pool.start(items)  # the workers load while this process measures its cost model
        decoders, cost = make_decoders(target, draft, config, compare)
        serve(target, decoders, items[::workers], params, max_new_tokens, stops, seed, done)
        others = pool.collect(True)
        served += others
        bar.update(len(others))
    finally:
        pool.stop()
        bar.close()
    order = {(name, i): n for n, (name, i, _) in enumerate(items)}
    served.sort(key=lambda s: order[(s.set, s.index)])
    results = {}
    for proposer in decoders:
        sets = {}
        for name in prompts:
            mine = [s for s in served if s.set == name]
            stats = [s.runs[proposer][0] for s in mine]
            sets[name] = summarise(stats, [s.plain for s in mine], [s.runs[proposer][1] for s in mine])
            if params.greedy:
                divergences = [d for s in mine if (d := s.runs[proposer][2]) is not None]
                sets[name].update(equal=len(mine) - len(divergences), divergences=divergences,
                                  lossless=all(d["tie"] for d in divergences))
        overall = summarise([s.runs[proposer][0] for s in served], [s.plain for s in served],
                            [s.runs[proposer][1] for s in served])
        if params.greedy:
            overall["equal"] = sum(s["equal"] for s in sets.values())
            overall["lossless"] = all(s["lossless"] for s in sets.values())
        results[proposer] = {"sets": sets, "overall": overall}
    rows = [{"set": s.set, "prompt": s.index, **s.runs[config.proposer][0].as_dict(),
             "plain_tokens_per_s": s.plain.as_dict()["tokens_per_s"]} for s in served]
    sets, overall = results[config.proposer]["sets"], results[config.proposer]["overall"]
    if cost is not None:
        width = config.budget if config.mode == "tree" else config.k
        overall["cost_model"] = cost.explain(config.k, overall["tau"], width)
    return {"config": {"mode": config.mode, "k": config.k, "topk": config.topk, "budget": config.budget,
                       "target_cache": config.target_cache, "proposer": config.proposer,
                       "lookup": {"k": config.lookup_k, "min": config.lookup_min, "max": config.lookup_max,
                                  "scale": config.lookup_scale},
                       "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                       "max_new_tokens": max_new_tokens, "device": str(target.device),
                       "dtype": str(target.dtype).removeprefix("torch."), "workers": workers},
            "sets": sets, "overall": overall,
            "compare": {p: r for p, r in results.items() if p != config.proposer},
            "prompts": rows}


# ---------------------------------------------------------------- report


def markdown(report: dict[str, Any]) -> str:
    c = report["config"]
    lookup = c.get("lookup") or {}
    lines = [f"# Speculative decoding report ({c.get('proposer', 'draft')}, {c['mode']}, K={c['k']}"
             + (f", top-k {c['topk']}, budget {c['budget']}" if c["mode"] == "tree" else "")
             + (f", lookup up to {lookup.get('k')} tokens" if c.get("proposer", "draft") != "draft" else "")
             + f", temperature {c['temperature']}, {c['max_new_tokens']} new tokens)", "",
             "| set | prompts | tau | acceptance by position | tokens/s (spec) | tokens/s (plain) | speedup | "
             "TTFT s | draft / verify share | greedy equal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in [*report["sets"].items(), ("overall", report["overall"])]:
        eq = f"{s['equal']}/{s['prompts']}" if "equal" in s else "-"
        accept = " / ".join(f"{x:.2f}" for x in s["accept_per_pos"])
        lines.append(f"| {name} | {s['prompts']} | {s['tau']:.3f} | {accept}"
                     f" | {s['spec_tokens_per_s']} | {s['plain_tokens_per_s']} | {s['speedup']} | {s['ttft_s']} | "
                     f"{s['time_split']['draft']:.2f} / {s['time_split']['verify']:.2f} | {eq} |")
    lines += proposer_table(report)
    lines += context_table(report)
    lines += part_table(report)
    if cost := report["overall"].get("cost_model"):
        lines += ["", f"Cost model on this machine ({c.get('device', '?')}, {c.get('dtype', '?')}): one target "
                  f"forward t(1) = {cost['t1_ms']} ms, verifying {cost['verified']} tokens "
                  f"{cost['t_verify_ms']} ms, one draft step {cost['draft_step_ms']} ms. A round costs "
                  f"{cost['break_even_tau']} plain steps, so speculation pays above tau = {cost['break_even_tau']}; "
                  f"the ceiling (every draft token accepted) is {cost['ceiling']}x, and the measured tau "
                  f"{report['overall']['tau']:.3f} predicts {cost['predicted_speedup']}x. Where verifying "
                  f"{cost['verified']} tokens costs about what one does (batch-1 decoding on a GPU, bound by "
                  f"reading the weights), the same tau would give about {cost['speedup_if_verify_is_flat']}x."]
    divergences = [(n, d) for n, s in report["sets"].items() for d in s.get("divergences", [])]
    if divergences:
        lines += ["", "Divergences from plain greedy decoding (target top-2 logit margin at the first difference):", ""]
        lines += [f"- {n} prompt {d['prompt']}, token {d['position']}: margin {d['margin']}"
                  + (" (near-tie)" if d["tie"] else " (NOT a near-tie)") for n, d in divergences]
    return "\n".join(lines) + "\n"


def runs_of(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every proposer the report ran, the main one first: {proposer: {"sets", "overall"}}."""
    main = report["config"].get("proposer", "draft")
    return {main: {"sets": report["sets"], "overall": report["overall"]}, **report.get("compare", {})}


def proposer_table(report: dict[str, Any]) -> list[str]:
    """Per set, each proposer's tokens per target forward (tau) and speedup side by side, and where the
    accepted tokens of a round that had both came from; nothing when only one proposer ran."""
    runs = runs_of(report)
    if len(runs) < 2:
        return []
    names = list(runs)
    lines = ["", "By proposer: tokens per target forward (tau) and speedup over plain decoding, the same prompts; "
             "accepted tokens from the draft / the lookup / both (rounds with a lookup branch):", "",
             "| set | " + " | ".join(f"{n} tau | {n} speedup" for n in names)
             + " | accepted by (draft / lookup / both) |",
             "| --- |" + " --- | --- |" * len(names) + " --- |"]
    for name in [*report["sets"], "overall"]:
        cells = []
        for n in names:
            s = runs[n]["overall"] if name == "overall" else runs[n]["sets"].get(name)
            cells += [f"{s['tau']:.3f}", f"{s['speedup']}"] if s else ["-", "-"]
        split = []
        for n in names:
            s = runs[n]["overall"] if name == "overall" else runs[n]["sets"].get(name)
            by = (s or {}).get("accepted_by")
            if by and n != "draft":
                split.append(f"{n}: {by['draft']} / {by['lookup']} / {by['both']} ({by['lookup_rounds']})")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'; '.join(split) or '-'} |")
    return lines


def part_table(report: dict[str, Any]) -> list[str]:
    """tau on the target's answer tokens and, where it writes one, its thinking block, per set (by
    where a round's first drafted token lies; rounds in brackets)."""
    return group_table(report, "by_part", REPLY_PARTS, "tau by part of the reply (where a round's first drafted "
                       "token lies; rounds in brackets):")


def context_table(report: dict[str, Any]) -> list[str]:
    """tau per context-length bucket (the context before a round's first drafted token), per set:
    where a long context costs acceptance. Rounds in brackets."""
    return group_table(report, "by_context", CONTEXT_BUCKETS, "tau by context length (tokens before the round's "
                       "first drafted token; rounds in brackets):")


def group_table(report: dict[str, Any], key: str, order: Sequence[str], title: str) -> list[str]:
    """A markdown table of tau (rounds) per set and per group of ``report[...][key]``, the groups any
    set has, in ``order``; nothing when none has one."""
    named = [*report["sets"].items(), ("overall", report["overall"])]
    groups = [g for g in order if any(g in s.get(key, {}) for _, s in named)]
    if not groups:
        return []
    lines = ["", title, "", "| set | " + " | ".join(groups) + " |", "| --- |" + " --- |" * len(groups)]
    for name, s in named:
        cells = [f"{g['tau']:.3f} ({g['rounds']})" if (g := s.get(key, {}).get(b)) else "-" for b in groups]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def plots(report: dict[str, Any], out: Path) -> list[str]:
    try:
        import matplotlib
    except ImportError:  # the [serve] extra brings it; the report stands without its pictures
        print(f"serve_eval: no plots in {out} (matplotlib is in the [serve] extra)", file=sys.stderr)
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["sets"])
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in [*names, "overall"]:
        s = report["sets"].get(name, report["overall"])
        ax.plot(range(1, len(s["accept_per_pos"]) + 1), s["accept_per_pos"], marker="o", label=name,
                linewidth=2.5 if name == "overall" else 1.2)
    ax.set(xlabel="draft position", ylabel="acceptance", title="Acceptance by position", ylim=(0, 1))
    ax.legend()
    for fname, key, title in (("tau_by_set.png", "tau", "tau (tokens per target forward)"),
                              ("speedup.png", "speedup", "speedup over plain decoding")):
        fig2, ax2 = plt.subplots(figsize=(6, 4))
        values = [report["sets"][n][key] or 0 for n in names] + [report["overall"][key] or 0]
        ax2.bar([*names, "overall"], values, color=["tab:blue"] * len(names) + ["tab:orange"])
        ax2.axhline(1.0, color="gray", linewidth=0.8)
        ax2.set(title=title)
        fig2.tight_layout()
        fig2.savefig(out / fname, dpi=100)
        plt.close(fig2)
        written.append(fname)
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=100)
    plt.close(fig)
    overall = report["overall"].get("by_context", {})
    if len(overall) > 1:  # one bucket says nothing about length
        fig3, ax3 = plt.subplots(figsize=(6, 4))
        for name in [*names, "overall"]:
            groups = report["sets"].get(name, report["overall"]).get("by_context", {})
            labels = [b for b in overall if b in groups]
            ax3.plot(labels, [groups[b]["tau"] for b in labels], marker="o", label=name,
                     linewidth=2.5 if name == "overall" else 1.2)
            if name == "overall":  # a point stands on its rounds: 61 say less than 2,599
                for b in labels:
                    ax3.annotate(f"{groups[b]['rounds']} rounds", (b, groups[b]["tau"]), textcoords="offset points",
                                 xytext=(0, 6), ha="center", fontsize=7)
        ax3.set(xlabel="context before the round (tokens; overall's rounds noted)", ylabel="tau",
                title="tau by context length")
        ax3.legend()
        fig3.tight_layout()
        fig3.savefig(out / "tau_by_context.png", dpi=100)
        plt.close(fig3)
        written.append("tau_by_context.png")
    runs = runs_of(report)
    if len(runs) > 1:
        fig4, ax4 = plt.subplots(figsize=(max(6, 1.2 * (len(names) + 1)), 4))
        width = 0.8 / len(runs)
        for j, (proposer, run) in enumerate(runs.items()):
            values = [run["sets"].get(n, {}).get("tau", 0) for n in names] + [run["overall"]["tau"]]
            ax4.bar([i + j * width for i in range(len(values))], values, width=width, label=proposer)
        ax4.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(names) + 1)], [*names, "overall"],
                       rotation=30, ha="right")
        ax4.axhline(1.0, color="gray", linewidth=0.8)
        ax4.set(title="tokens per target forward by proposer", ylabel="tau")
        ax4.legend()
        fig4.tight_layout()
        fig4.savefig(out / "tau_by_proposer.png", dpi=100)
        plt.close(fig4)
        written.append("tau_by_proposer.png")
    return ["acceptance_by_position.png", *written]


def log_wandb(report: dict[str, Any], out: Path, mode: str, project: str) -> None:
    if mode == "disabled":
        return
    import wandb

    (out / "wandb").mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=project, name=out.name, dir=str(out), mode=mode, job_type="serve_eval",
                     config=report["config"], settings=wandb.Settings(console="off", silent=True))
    from eagle3.dashboards import define_metrics

    define_metrics(run, "serve")
    for name, s in [*report["sets"].items(), ("overall", report["overall"])]:
        run.summary[f"serve/{name}/tau"] = s["tau"]
        run.summary[f"serve/{name}/speedup"] = s["speedup"]
        run.summary[f"serve/{name}/tokens_per_s"] = s["spec_tokens_per_s"]
        for i, a in enumerate(s["accept_per_pos"], start=1):
            run.summary[f"serve/{name}/accept_pos{i}"] = a
        for bucket, g in s.get("by_context", {}).items():
            run.summary[f"serve/{name}/tau_context_{bucket}"] = g["tau"]
        for source, tokens in s.get("accepted_by", {}).items():
            run.summary[f"serve/{name}/accepted_{source}"] = tokens
    for proposer, other in report.get("compare", {}).items():
        for name, s in [*other["sets"].items(), ("overall", other["overall"])]:
            run.summary[f"serve/{proposer}/{name}/tau"] = s["tau"]
            run.summary[f"serve/{proposer}/{name}/speedup"] = s["speedup"]
    columns = ["set", "prompt", "tau", "tokens_per_s", "plain_tokens_per_s", "new_tokens"]
    run.log({"serve/prompts": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in report["prompts"]]),
             **{f"serve/{png.removesuffix('.png')}": wandb.Image(str(out / png)) for png in report["plots"]}})
    run.finish()


def write_report(report: dict[str, Any], out: Path, wandb_mode: str = "offline", project: str = "eagle3") -> None:
    out.mkdir(parents=True, exist_ok=True)
    report["plots"] = plots(report, out)
    atomic_write_text(out / "report.json", json.dumps(report, indent=1) + "\n")
    atomic_write_text(out / "report.md", markdown(report))
    log_wandb(report, out, wandb_mode, project)


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """Every EvalConfig field a flag (its docstring the help), the target's, and the run's own."""
    parser = argparse.ArgumentParser(prog="python -m serve_eval.evaluate", description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    add_dataclass_arguments(parser, EvalConfig, required=("draft", "out_dir"), aliases={"out_dir": "--out"})
    parser.add_argument("--pools", default="runs/pools", help="the pools folder whose eval/ holds the sets")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("serve_eval", _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads < 1:
        print(f"serve_eval: error: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)

    from eagle3.target.chat import ChatFormat

    # sets also as one comma-separated word, as earlier versions took them
    cfg = dataclass_from_args(EvalConfig, args, sets=[s for word in args.sets for s in word.split(",") if s],
                              compare=[s for word in args.compare for s in word.split(",") if s])
    if Path(cfg.out_dir).exists() and not Path(cfg.out_dir).is_dir():
        raise ConfigError(f"--out {cfg.out_dir}: exists and is not a folder")
    target, draft = load_pair(cfg.draft, args.target, args.target_dtype, args.device)
    chat = ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)
    served = chat.in_mode(cfg.thinking)
    prompts = {name: read_prompts(Path(args.pools), name, cfg.per_set, served) for name in cfg.sets}
    report = evaluate(target, draft, prompts, config=cfg.spec, params=cfg.sampling, max_new_tokens=cfg.max_new_tokens,
                      stop_ids=sorted(chat.stop_ids), seed=args.seed, progress=not args.no_progress,
                      compare=cfg.compare, workers=cfg.workers, source=PairSource.of(cfg.draft, args.target, target))
    report["draft"], report["target"] = str(cfg.draft), args.target
    write_report(report, Path(cfg.out_dir), cfg.wandb_mode)
    print(json.dumps({"stage": "serve_eval", "out": cfg.out_dir, "overall": report["overall"],
                      "sets": {n: {k: s[k] for k in ("tau", "speedup", "spec_tokens_per_s", "plain_tokens_per_s")}
                               for n, s in report["sets"].items()},
                      "compare": {p: {n: {k: s[k] for k in ("tau", "speedup")} for n, s in r["sets"].items()}
                                  for p, r in report["compare"].items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
