"""The live trainer: the server's captured requests train the draft that serves them, and a
candidate that serves them better is promoted (``python -m hard_mining.live``).

A server started with ``--live DIR`` captures every finished request as a training sample (its ids
and the target states its forwards computed: :mod:`serve_eval.capture`) and serves the draft
``DIR/serving.json`` names (:mod:`serve_eval.promoted`). This loop, beside it, runs rounds::

    wait     until ``round_requests`` new requests are captured
    plan     the latest ``holdout`` requests are held out; the ``window`` before them are trained on
             (``rounds/r<NNNN>/plan.json``, written first: a round killed and rerun trains the same)
    train    continued training, ``steps`` steps, on the window (mixed with the draft's original
             store at ``mix`` of its weight, so it does not forget), from the previous round's
             candidate (promoted or not: training accumulates) or, first and after a rollback, from
             the draft that serves
    judge    both drafts teacher-forced on the held-out requests (their captured states: no target
             forward): the served tau of each request as the loop would serve it greedily at depth
             ``k`` (:func:`hard_mining.replay.served_rounds`); the paired difference per request
    promote  where the candidate's mean beats the serving draft's by more than ``margin`` and the 95%
             interval of the difference lies above 0: published as the next version; else refused.
             Both are logged in ``events.jsonl`` with their figures.

Resumable: a round's plan, training (its checkpoints) and verdict are files; after a kill the loop
goes on at the first round without a verdict, and a candidate already published is not published
again. Bounded: requests older than the window are released from the capture folder
(``release``), a round's folder holds links to its requests, not copies, and is deleted once the
next round has its verdict.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eagle3.atomic import atomic_write_text
from eagle3.cli import add_dataclass_arguments, dataclass_from_args
from eagle3.config import TargetConfig, add_target_arguments
from eagle3.errors import ConfigError, run_cli
from eagle3.store.shards import HarvestSpec, HarvestStore, shard_entry, shard_name, write_manifest
from eagle3.train.config import TrainConfig, updated
from hard_mining.config import LiveConfig
from hard_mining.replay import reply_spans, served_rounds
from hard_mining.score import score_store, target_head
from serve_eval.capture import Captured, committed, read_spec, release_below, writer_of
from serve_eval.promoted import PromotionError, log_event, publish, published_from, read_serving

CAPTURE = "capture"
ROUNDS = "rounds"


def link_store(dest: Path, items: Sequence[Captured], spec: HarvestSpec) -> HarvestStore:
    """A harvest store of captured requests: their shards hard-linked (copied where links fail),
    each checked against its commit's sha256, the manifest last."""
    if (dest / "manifest.json").is_file():
        return HarvestStore(dest)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    entries = []
    for i, item in enumerate(items):
        path = dest / shard_name(i)
        try:
            os.link(item.path, path)
        except OSError:
            shutil.copyfile(item.path, path)
        entry = shard_entry(path, 1, item.tokens, int(item.record["loss_tokens"]))
        if entry["sha256"] != item.record["sha256"]:
            raise ConfigError(f"{item.path}: sha256 {entry['sha256'][:12]} differs from its commit's "
                              f"{item.record['sha256'][:12]} (a damaged capture)")
        entries.append(entry)
    write_manifest(dest, spec, entries, {"captured": len(items)}, {"source": "live capture"})
    return HarvestStore(dest)


def replay_token_weights(items: Sequence[Captured], weight: float) -> dict[str, list[list[float]]]:
    """On-policy replay: per captured request, the token each of its served rounds rejected (a round
    at context c that accepted a < depth draft tokens rejected token c + a), at ``weight``."""
    out: dict[str, list[list[float]]] = {}
    for item in items:
        rejected = [[ctx + accepted, weight] for ctx, depth, accepted, *_ in item.record.get("rounds", [])
                    if accepted < depth and ctx + accepted < item.tokens]
        if rejected:
            out[item.sample_id] = rejected
    return out


def mix_weights(captured: int, original: HarvestStore, mix: float) -> dict[str, float]:
    """Sampling weights giving the original store's samples ``mix`` of the captured ones' total (1 each)."""
    each = mix * captured / max(len(original), 1)
    return {sample_id: each for sample_id in original.sample_ids}


def served_taus(draft: Any, head: Any, store: HarvestStore, k: int) -> list[float]:
    """Per sample: the tau the loop serves greedily at depth ``k`` on its replies, teacher-forced."""
    out = []
    for i, score in enumerate(score_store(draft, head, store, {}, ttt_steps=k)):
        _, mask = store.token_columns(i)
        rounds = served_rounds(score, reply_spans(mask), k)
        out.append(1.0 + sum(a for _, a, _ in rounds) / len(rounds) if rounds else float("nan"))
    return out


def paired(candidate: Sequence[float], serving: Sequence[float]) -> dict[str, float]:
    """Mean of the per-request differences and its 95% interval (normal approximation; the requests
    where a tau is undefined left out)."""
    diffs = [c - s for c, s in zip(candidate, serving, strict=True) if not (math.isnan(c) or math.isnan(s))]
    n = len(diffs)
    if n < 2:
        return {"n": n, "mean": 0.0, "low": -math.inf, "high": math.inf}
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = 1.96 * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "low": mean - half, "high": mean + half}


def _mean(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else float("nan")


class LiveTrainer:
    """The rounds of :mod:`hard_mining.live` over one live folder."""

    def __init__(self, cfg: LiveConfig, train_cfg: TrainConfig, target_cfg: TargetConfig, target: Any = None,
                 progress: bool = False) -> None:
        self.cfg, self.train_cfg, self.target_cfg, self.progress = cfg, train_cfg, target_cfg, progress
        self.live = Path(cfg.live)
        self.capture = self.live / CAPTURE
        if not (self.capture / "capture.json").is_file():
            raise ConfigError(f"live.live={cfg.live}: no {self.capture}/capture.json (start the server with "
                              f"--live {cfg.live} first)")
        self.spec = read_spec(self.capture)
        writer = writer_of(self.capture) or {}
        budget = writer.get("max_bytes")
        if isinstance(budget, int) and cfg.window_mb * 2**20 > 0.75 * budget:
            raise ConfigError(f"live.window_mb={cfg.window_mb:g}: the server captures at most {budget / 2**20:g} MB "
                              f"(--capture-max-mb, {self.capture}/writer.lock); a window over 3/4 of it leaves too "
                              "little room for new requests (capture would pause before a round): lower --window-mb "
                              "or raise --capture-max-mb")
        self.original = HarvestStore(Path(cfg.store)) if cfg.store else None
        if self.original is not None and self.original.spec.aux_layer_ids != self.spec.aux_layer_ids:
            raise ConfigError(f"live.store={cfg.store}: aux_layer_ids {list(self.original.spec.aux_layer_ids)}, the "
                              f"captured requests have {list(self.spec.aux_layer_ids)}")
        if target is None:
            from eagle3.target.model import load_target

            target = load_target(target_cfg.name_or_path, dtype="float32", device=target_cfg.device,
                                 aux_layer_ids=self.spec.aux_layer_ids)
        if tuple(target.aux_layer_ids) != self.spec.aux_layer_ids or target.hidden_size != self.spec.hidden_size \
                or target.vocab_size != self.spec.vocab_size:
            raise ConfigError(f"--target {target_cfg.name_or_path}: not the target whose requests {self.capture} holds "
                              f"(hidden {self.spec.hidden_size}, vocab {self.spec.vocab_size}, aux layers "
                              f"{list(self.spec.aux_layer_ids)})")
        self.target, self.head = target, target_head(target)

    # -- the draft that serves

    def serving(self) -> tuple[int, Path]:
        pointer = read_serving(self.live)
        if pointer is None or "path" not in pointer:
            return (int(pointer["version"]) if pointer else 0), Path(self.cfg.draft)
        return int(pointer["version"]), self.live / pointer["path"]

    def load(self, folder: Path) -> Any:
        from hard_mining.rounds import load_scoring_draft

        return load_scoring_draft(folder, self.target)

    # -- rounds

    def run(self) -> list[dict[str, Any]]:
        """Every round's verdict, until ``max_rounds`` or ``idle_exit_s`` (never, without either)."""
        return list(self.rounds())

    def rounds(self) -> Iterator[dict[str, Any]]:
        """Each round's verdict as it is made."""
        r = self._first_open_round()
        last_new = time.monotonic()
        seen = -1
        while not self.cfg.max_rounds or r <= self.cfg.max_rounds:
            items = committed(self.capture)
            newest = items[-1].seq if items else -1
            if newest != seen:
                seen, last_new = newest, time.monotonic()
            self.watch(items)
            plan = self._plan(r, items)
            if plan is None:
                if self.cfg.idle_exit_s and time.monotonic() - last_new > self.cfg.idle_exit_s:
                    break
                time.sleep(self.cfg.poll_s)
                continue
            yield self.round(r, plan)
            r += 1

    def watch(self, items: Sequence[Captured]) -> dict[str, Any] | None:
        """The check after a promotion: once the serving version has served ``rollback_requests``
        requests, its served tau on them against the version it replaced, teacher-forced on the same
        requests; rolled back where worse at 95%. The verdict (``rounds/watch-v<N>.json``), or None."""
        from serve_eval.promoted import rollback

        n = self.cfg.rollback_requests
        pointer = read_serving(self.live)
        if not n or not pointer or not pointer.get("history"):
            return None
        version, before = int(pointer["version"]), pointer["history"][-1]
        path = self.live / ROUNDS / f"watch-v{version:04d}.json"
        served = [c for c in items if int(c.record.get("draft_version", -1)) == version][:n]
        if path.is_file() or len(served) < n:
            return None
        store = link_store(self.live / ROUNDS / f"watch-v{version:04d}", served, self.spec)
        older = self.live / before["path"] if "path" in before else Path(self.cfg.draft)
        old_taus = served_taus(self.load(older), self.head, store, self.cfg.k)
        # the tau the server measured where it is the one the judge computes (greedy, a chain of k draft
        # tokens, no lookup: the teacher-forced figure equals it); otherwise both versions teacher-forced
        same = [self._comparable(c.record) for c in served]
        forced = served_taus(self.load(self.live / pointer["path"]), self.head, store, self.cfg.k) \
            if not all(same) else [math.nan] * len(served)
        live_taus = [1.0 + sum(r[2] for r in c.record["rounds"]) / len(c.record["rounds"]) if ok else tau
                     for c, ok, tau in zip(served, same, forced, strict=True)]
        diff = paired(live_taus, old_taus)
        figures = {"against": int(before["version"]), "requests": n,
                   "served_tau": round(_mean(live_taus), 4), "previous_tau": round(_mean(old_taus), 4),
                   "difference": round(diff["mean"], 4), "interval": [round(diff["low"], 4), round(diff["high"], 4)]}
        verdict = {"version": version, **figures, "rolled_back": diff["high"] < 0}
        if verdict["rolled_back"]:
            rollback(self.live, version, int(before["version"]), **figures)
        else:
            log_event(self.live, "kept", version=version, **figures)
        atomic_write_text(path, json.dumps(verdict, indent=2))
        shutil.rmtree(self.live / ROUNDS / f"watch-v{version:04d}", ignore_errors=True)
        return verdict

    def _comparable(self, record: dict[str, Any]) -> bool:
        rounds = record.get("rounds") or []
        return bool(rounds) and record.get("greedy", True) and record.get("k") == self.cfg.k \
            and all(r[1] == self.cfg.k and not any(r[4:]) for r in rounds)

    def _round_dir(self, r: int) -> Path:
        return self.live / ROUNDS / f"r{r:04d}"

    def _first_open_round(self) -> int:
        r = 1
        while (self._round_dir(r) / "verdict.json").is_file():
            r += 1
        return r

    def _plan(self, r: int, items: list[Captured]) -> dict[str, Any] | None:
        """Round ``r``'s plan (read back where written), or None while too few new requests came."""
        path = self._round_dir(r) / "plan.json"
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
        previous = self._round_dir(r - 1) / "plan.json"
        since = json.loads(previous.read_text(encoding="utf-8"))["newest"] if r > 1 and previous.is_file() else -1
        fresh = [c for c in items if c.seq > since]
        if len(fresh) < self.cfg.round_requests or len(items) < self.cfg.holdout + 1:
            return None
        holdout, rest = items[-self.cfg.holdout:], items[:-self.cfg.holdout]
        train, size = [], 0
        for item in reversed(rest[-self.cfg.window:]):  # the latest, within window requests and window_mb
            size += int(item.record["bytes"])
            if train and size > self.cfg.window_mb * 2**20:
                break
            train.insert(0, item)
        version, folder = self.serving()
        plan = {"round": r, "newest": items[-1].seq, "train": [c.seq for c in train],
                "holdout": [c.seq for c in holdout], "serving": version, "serving_path": str(folder),
                "start": str(self._start(r, version) or folder)}
        atomic_write_text(path, json.dumps(plan, indent=2))
        return plan

    def _start(self, r: int, version: int) -> Path | None:
        """The previous round's candidate, where training goes on from it: it serves now (promoted), or
        it was refused while the version it was judged against still serves (no rollback since)."""
        verdict = self._round_dir(r - 1) / "verdict.json"
        candidate = self._round_dir(r - 1) / "train" / "final"
        if r == 1 or not verdict.is_file() or not candidate.is_dir():
            return None
        judged = json.loads(verdict.read_text(encoding="utf-8"))
        lineage = judged["promoted"] if judged["promoted"] is not None else judged["serving"]
        return candidate if version == lineage else None  # else rolled back since: from what serves

    def round(self, r: int, plan: dict[str, Any]) -> dict[str, Any]:
        from eagle3.train.loop import train

        cfg, rdir = self.cfg, self._round_dir(r)
        version, folder = self.serving()
        if version != plan["serving"]:  # a round rerun after a promotion or rollback: judged against what serves
            plan = {**plan, "serving": version, "serving_path": str(folder)}
            atomic_write_text(rdir / "plan.json", json.dumps(plan, indent=2))
        t0 = time.perf_counter()
        by_seq = {c.seq: c for c in committed(self.capture)}
        stores = []
        for name in ("train", "holdout"):
            dest = rdir / f"{name}-store"
            if not (dest / "manifest.json").is_file():
                missing = [s for s in plan[name] if s not in by_seq]
                if missing:  # released by hand meanwhile: the round is planned again
                    shutil.rmtree(rdir)
                    raise ConfigError(f"round {r}: captured request {missing[0]} is gone; rerun to plan it again")
            stores.append(link_store(dest, [by_seq[s] for s in plan[name]] if not (dest / "manifest.json").is_file()
                                     else [], self.spec))
        train_store, held = stores
        weights_file = tokens_file = None
        extra: list[str] = []
        if self.original is not None and cfg.mix > 0:
            extra = [cfg.store or ""]
            weights_file = rdir / "sample_weights.json"
            atomic_write_text(weights_file, json.dumps(mix_weights(len(train_store), self.original, cfg.mix)))
        if cfg.replay_weight > 0:
            tokens_file = rdir / "token_weights.json"
            items = [by_seq[s] for s in plan["train"] if s in by_seq]
            atomic_write_text(tokens_file, json.dumps(replay_token_weights(items, cfg.replay_weight)))
        serving = Path(plan["serving_path"])
        train(updated(self.train_cfg, {
            "data.mode": "offline", "data.store": str(rdir / "train-store"), "data.extra_stores": extra,
            "data.sample_weights": str(weights_file) if weights_file else None,
            "loss.token_weights": str(tokens_file) if tokens_file else None, "init.draft": plan["start"],
            "steps": cfg.steps, "optim.lr": cfg.lr, "out_dir": str(rdir / "train"), "data.eval_store": None,
            "data.eval_fraction": 0.0, "seed": cfg.seed + r, "resume": True, "log.wandb_mode": "disabled",
            "log.progress": self.progress}), self.target_cfg, target=self.target)
        t_train = time.perf_counter() - t0
        candidate = rdir / "train" / "final"
        cand = served_taus(self.load(candidate), self.head, held, cfg.k)
        serv = served_taus(self.load(serving), self.head, held, cfg.k)
        diff = paired(cand, serv)
        promote = diff["mean"] > cfg.margin and diff["low"] > 0
        figures = {"round": r, "serving": plan["serving"], "trained_on": len(plan["train"]),
                   "held_out": len(plan["holdout"]), "candidate_tau": round(_mean(cand), 4),
                   "serving_tau": round(_mean(serv), 4), "difference": round(diff["mean"], 4),
                   "interval": [round(diff["low"], 4), round(diff["high"], 4)], "train_s": round(t_train, 1),
                   "judge_s": round(time.perf_counter() - t0 - t_train, 1)}
        verdict = {**figures, "promoted": None}
        if promote:
            verdict["promoted"] = self._publish(candidate, figures)
        else:
            log_event(self.live, "refused", why=f"difference {diff['mean']:+.4f}, 95% interval low {diff['low']:+.4f}"
                      f" (margin {cfg.margin})", **figures)
        atomic_write_text(rdir / "verdict.json", json.dumps(verdict, indent=2))
        self._tidy(r, plan)
        return verdict

    def _publish(self, candidate: Path, figures: dict[str, Any]) -> int | None:
        """Publish ``candidate`` unless an earlier run of this round already did (after a kill; even
        where it was rolled back since)."""
        done = published_from(self.live, candidate)
        if done is not None:
            return done
        try:
            return publish(self.live, candidate, figures)
        except PromotionError as err:
            log_event(self.live, "refused", why=str(err), **figures)
            return None

    def _tidy(self, r: int, plan: dict[str, Any]) -> None:
        """The previous round's folder (its links and checkpoints) and, with ``release``, the captured
        requests older than every later round's window."""
        for old in range(1, r):  # earlier rounds: their links and drafts (a kill may have left some)
            for part in ("train-store", "holdout-store", "train"):
                shutil.rmtree(self._round_dir(old) / part, ignore_errors=True)
        # this round's checkpoints; its final draft stays: the next round may go on from it
        shutil.rmtree(self._round_dir(r) / "train" / "checkpoints", ignore_errors=True)
        if self.cfg.release and plan["train"]:  # no later round trains on what came before this window
            release_below(self.capture, plan["train"][0])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hard_mining.live", description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    add_dataclass_arguments(parser, LiveConfig, required=("live", "draft"))
    parser.add_argument("--recipe", default="target-head",
                        help="recipes/draft/NAME.yaml for the continued training (default the pipeline's), or none")
    parser.add_argument("--ttt-steps", type=int, default=TrainConfig.ttt_steps)
    parser.add_argument("--loss-positions", default="all", help="assistant or all (prompts too, as the pipeline)")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--serve", action="store_true",
                        help="one command: start the server (serve_eval.server --live LIVE --draft DRAFT, same target) "
                             "as a child process first, and stop it when the trainer stops")
    parser.add_argument("--server-args", default="", help="with --serve: more server flags, one string "
                        "(e.g. '--port 8000 --k 3 --threads 1')")
    return parser


def start_server(cfg: LiveConfig, args: argparse.Namespace) -> subprocess.Popen:
    """The server of ``--serve``, started and ready to capture (its capture folder written), or an
    error naming its exit code."""
    command = [sys.executable, "-m", "serve_eval.server", "--live", cfg.live, "--draft", cfg.draft,
               "--target", args.target, *shlex.split(args.server_args)]
    server = subprocess.Popen(command)
    spec = Path(cfg.live) / CAPTURE / "capture.json"
    while not spec.is_file():
        if server.poll() is not None:
            raise ConfigError(f"--serve: the server exited ({server.returncode}) before it captured anything: "
                              f"{shlex.join(command)}")
        time.sleep(0.5)
    return server


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hard_mining.live", _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    from hard_mining.rounds import continued_training

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = dataclass_from_args(LiveConfig, args)
    train_cfg = continued_training(args.recipe, **{
        "ttt_steps": args.ttt_steps, "loss.positions": args.loss_positions,
        "optim.warmup_steps": max(1, cfg.steps // 20), "data.micro_batch_tokens": args.micro_batch_tokens,
        "data.batching": "buckets", "eval_every": 0, "save_every": max(cfg.steps // 2, 1),
        "log.progress": not args.no_progress, "threads": args.threads})
    target_cfg = TargetConfig(name_or_path=args.target, dtype="float32", device=args.device)
    print(json.dumps({"live": "start", **asdict(cfg)}), file=sys.stderr)
    server = start_server(cfg, args) if args.serve else None
    try:
        for verdict in LiveTrainer(cfg, train_cfg, target_cfg, progress=not args.no_progress).rounds():
            print(json.dumps({"live": "round", **verdict}), flush=True)
    finally:
        if server is not None and server.poll() is None:
            server.terminate()
            server.wait(timeout=60)
    return 0


__all__ = ["LiveTrainer", "link_store", "mix_weights", "paired", "replay_token_weights", "served_taus"]


if __name__ == "__main__":
    sys.exit(main())
