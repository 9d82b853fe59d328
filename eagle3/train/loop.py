"""The trainer: an EAGLE-3 draft head on a harvest store, with the DeepSpeed engine.

    python -m eagle3.train --store runs/harvest --target smollm2-135m --out runs/train \\
        [--data.eval-store DIR | --data.eval-fraction 0.1] [--steps N] [--zero-stage 0..3] [--optim.lr LR] ...
    torchrun --nproc_per_node 2 -m eagle3.train ...          # or: deepspeed --num_gpus 2 --module eagle3.train ...

What it wraps around the library (the draft and TTT code know nothing of this):

* **Distribution**: ``deepspeed.initialize(model, optimizer, lr_scheduler, config)`` with a
  torch ``AdamW`` (never a JIT-compiled fused optimiser), ZeRO 0-3, fp32 or bf16, gradient
  accumulation and clipping, linear warmup + cosine decay. One process, or several under
  ``torchrun`` / the ``deepspeed`` launcher; gloo on CPU, nccl on CUDA; the device is chosen
  once in :func:`eagle3.distributed.init_runtime` (:mod:`eagle3.train.optim`: schedule, precision,
  Muon). On CPU DeepSpeed JIT-builds its ``shm_comm`` op on the first
  start (~50-90 s); ``TORCH_EXTENSIONS_DIR`` defaults to ``$EAGLE3_HOME/torch_extensions`` so
  it is built once per machine.
* **Data** (:mod:`eagle3.store.batches`, :mod:`eagle3.train.data`): the training store (checked
  against the target), an optional held-out store or an id-hash split; packed or length-bucketed micro-batches,
  reshuffled per epoch and sharded by rank deterministically.
* **Targets** (:mod:`eagle3.draft.target_head`): the target's frozen final norm + lm_head turn the
  stored pre-norm ``last`` states into its next-token distribution (or a top-k store's log-probs are used).
* **Draft vocab**: the ``draft_vocab_size`` most frequent loss-masked tokens of the training
  split, chosen once and saved as ``out_dir/draft_vocab.safetensors`` (frozen for the run,
  reusable by another run with ``draft_vocab=PATH``).
* **Loss and metrics**: the draft family's training forward (:mod:`eagle3.draft.families`; EAGLE-3's
  :func:`eagle3.draft.ttt.ttt_forward`, K=7 steps, weights 0.8**k), per-step accuracy,
  conditional acceptance and tau_sim (:mod:`eagle3.draft.metrics`) on train batches and on the eval
  split every ``eval_every`` steps; the best eval tau_sim is exported to ``out_dir/best``.
* **Checkpoints** (:mod:`eagle3.train.checkpoint`): DeepSpeed's, with the data position, best eval
  and per-rank RNG states, published atomically; a run killed at any moment resumes to the
  same losses. ``out_dir/final`` holds the last draft.
* **Logging** (:mod:`eagle3.train.log`): ``metrics.jsonl`` and wandb (offline by default)
  from rank 0, a tqdm bar on rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle3.atomic import atomic_write_text
from eagle3.cli import add_dataclass_arguments, parse_moved
from eagle3.config import TargetConfig
from eagle3.distributed import (
    ContextGroup,
    Runtime,
    all_reduce_sum,
    any_rank,
    context_group,
    init_runtime,
    peers_named,
    per_rank,
    print0,
    shutdown,
)
from eagle3.draft.families import parameter_count
from eagle3.draft.metrics import AcceptanceTally
from eagle3.draft.ttt import step_weights
from eagle3.errors import TrainError, run_cli
from eagle3.store.batches import (
    BatchLoader,
    epoch_plan,
    eval_batches_for_rank,
    load_batch,
    rank_batch_index,
    steps_per_epoch,
)
from eagle3.target.model import Target
from eagle3.train.checkpoint import (
    RunState,
    export_finite,
    finished_earlier,
    resume_point,
    save_checkpoint,
    start_over_or_resume,
)
from eagle3.train.config import MOVED, TrainConfig, train_config, train_settings
from eagle3.train.data import TrainData, open_data
from eagle3.train.local_ranks import local_ranks, train_on_local_ranks
from eagle3.train.log import NullSink, PhaseClock, RunSink
from eagle3.train.optim import build_engine, resolve_precision, unclip_muon_updates_under_zero
from eagle3.train.start import DraftStart, start_draft
from eagle3.train.step import run_batch, train_forward
from eagle3.train.token_weights import TokenWeights, read_token_weights

# ---------------------------------------------------------------- the draft's weights and gradients


def _grad_norm(engine: Any, params: Sequence[nn.Parameter]) -> float | None:
    """The global grad norm DeepSpeed clipped with; computed here where DeepSpeed does not keep
    it (ZeRO 0 in fp32: the gradients are whole and already averaged over ranks)."""
    norm = engine.get_global_grad_norm()
    if norm is not None:
        return float(norm)
    grads = [p.grad for p in params if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else None


# ---------------------------------------------------------------- the loop


class _Loop:
    """One run's optimisation loop: the steps over each epoch's plan, evaluation and the best
    draft, checkpoints, logging. ``state`` is what a checkpoint keeps of it."""

    def __init__(self, cfg: TrainConfig, rt: Runtime, engine: tuple[Any, Callable[[int], float]], start: DraftStart,
                 data: TrainData, state: RunState, context: ContextGroup, target_cfg: TargetConfig,
                 resumed_step: int | None) -> None:
        self.cfg, self.rt, self.state, self.start = cfg, rt, state, start
        self.engine, self.schedule = engine
        self.head, self.draft, self.t2d = start.head, start.model.draft, start.vocab.t2d.to(rt.device)
        self.store, self.train_idx, self.weights_by_id = data.store, data.train_idx, data.weights_by_id
        self.eval_store, self.eval_idx = data.eval_store, data.eval_idx
        spec = self.store.spec
        self.info = {"target": spec.target, "aux_layer_ids": list(spec.aux_layer_ids),
                     "tokenizer_sha256": spec.tokenizer_sha256}
        self.params = [p for p in start.model.parameters() if p.requires_grad]
        self.dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        self.weights = step_weights(cfg.ttt_steps, cfg.loss.step_decay)
        self.eval_batches_all = data.eval_batches
        self.context = context  # the ranks sharing a row; the data-parallel batch streams
        self.per_step = self.context.data_world * cfg.gradient_accumulation
        self.plan_epoch, self.plan = -1, []
        self.tokens_total, self.train_seconds, self.last_loss = 0, 0.0, None
        self.window = {"tokens": 0, "seconds": 0.0}
        self.loader = BatchLoader(self.store, cfg.data.batching, rt.device)
        self.clock = PhaseClock(rt.device, cfg.log.phase_times)
        self.token_weights = TokenWeights(read_token_weights(cfg.loss.token_weights, self.store.sample_ids),
                                          cfg.loss.hard_tokens, cfg.loss.hard_token_entropy,
                                          cfg.loss.hard_token_weight, cfg.steps)
        self.resumed_step = resumed_step
        self.sink = (RunSink(Path(cfg.out_dir), cfg.log, config={"train": asdict(cfg), "target": asdict(target_cfg),
                                                                 "draft": asdict(self.draft.config)},
                             resume_step=resumed_step)
                     if rt.rank == 0 else NullSink())

    def evaluate(self) -> dict[str, float]:
        cfg, rt = self.cfg, self.rt
        tally = AcceptanceTally(cfg.ttt_steps, rt.device)
        self.engine.eval()
        with torch.no_grad():
            for idx in eval_batches_for_rank(self.eval_batches_all, self.context.data_rank, self.context.data_world):
                batch = load_batch(self.eval_store, idx or self.eval_batches_all[0], cfg.data.batching, stored=True)
                out = run_batch(self.engine, self.head, batch, self.t2d, self.dtype, rt.device, self.context)
                if idx is not None:  # a pad forward keeps ZeRO-3's collectives in step; not counted
                    tally.add(out)
        self.engine.train()
        return tally.all_reduce().summary(self.weights, "eval")

    def _store_asks_to_save(self) -> bool:
        """Whether the store asks some rank for a checkpoint now (online: the shards read since the last
        one fill half the spool); every rank gets the same answer, so all of them save together."""
        if not self.store.saves_early:
            return False
        asked = self.store.needs_save()
        return any_rank(self.rt, asked)

    def save(self) -> None:
        # as JSON text: a pickled dict's bytes depend on which equal strings are one object, which differs
        # between runs (a CLI run and an in-process one), so the checkpoint files would differ in size
        client = {"trainer_json": json.dumps(asdict(self.state)),
                  "draft_config_json": json.dumps(asdict(self.draft.config))}
        save_checkpoint(self.engine, Path(self.cfg.out_dir) / "checkpoints", self.state.step, client,
                        rank=self.rt.rank, keep=self.cfg.keep_checkpoints, readable=asdict(self.state))
        if self.plan_epoch == self.state.epoch:  # a resume starts from this checkpoint, there in the epoch
            self.store.after_checkpoint(self.plan[self.state.batch_index:], leader=self.rt.rank == 0)

    def maybe_eval(self) -> dict[str, float] | None:
        """Evaluate; a better held-out tau_sim exports the draft to ``best/``."""
        if self.eval_store is None:
            return None
        state = self.state
        metrics = self.evaluate()
        self.sink.log(metrics, state.step)
        if state.first_eval is None:
            state.first_eval = {k: v for k, v in metrics.items() if k in ("eval/loss", "eval/tau_sim")}
        state.last_eval = metrics
        tau = metrics["eval/tau_sim"]
        better = state.best_tau is None or tau > state.best_tau
        if better and state.step > 0:
            state.best_tau, state.best_step = tau, state.step
            export_finite(Path(self.cfg.out_dir) / "best", self.draft, self.cfg.zero_stage,
                          {**self.info, "step": state.step, "eval": metrics}, self.rt.rank)
        return metrics

    def _step_in_epoch(self) -> int | None:
        """Where this step is in its epoch's plan (planning a new epoch when one starts); None at its end."""
        cfg, state = self.cfg, self.state
        if self.plan_epoch != state.epoch:
            self.plan = epoch_plan(cfg.data, cfg.seed, self.store, self.train_idx, self.weights_by_id, state.epoch)
            self.plan_epoch = state.epoch
            self.store.begin_epoch(state.epoch)
            if steps_per_epoch(len(self.plan), self.context.data_world, cfg.gradient_accumulation) == 0:
                raise TrainError(f"{cfg.data.store}: {len(self.plan)} micro-batches of train.data.micro_batch_tokens="
                                 f"{cfg.data.micro_batch_tokens} per epoch, fewer than world_size / context_parallel x "
                                 f"gradient_accumulation = {self.per_step}")
        step_in_epoch = state.batch_index // self.per_step
        if step_in_epoch >= steps_per_epoch(len(self.plan), self.context.data_world, cfg.gradient_accumulation):
            return None
        return step_in_epoch

    def step(self, step_in_epoch: int) -> tuple[float, dict[str, Any], int]:
        """One optimizer step (its micro-batches on this rank): (loss, metrics, tokens over the ranks)."""
        cfg, rt, engine = self.cfg, self.rt, self.engine
        lr = cfg.optim.lr * self.schedule(self.state.step)  # the AdamW lr; Muon matrices follow the same factor
        clock = self.clock
        clock.start()
        tally = AcceptanceTally(cfg.ttt_steps, rt.device)
        sums = torch.zeros(2, dtype=torch.float64, device=rt.device)  # loss over micro-batches, tokens
        grad_norm = None
        for micro in range(cfg.gradient_accumulation):
            idx, then = self._micro_batch(step_in_epoch, micro), self._micro_batch(step_in_epoch, micro + 1)
            batch = self.loader.get(idx, then)
            weigh = None
            if self.token_weights.active:
                batch = self.token_weights.attach(batch, [self.store.sample_ids[i] for i in idx], cfg.data.batching)
                weigh = functools.partial(self.token_weights, step=self.state.step)
            clock.mark("load")
            out, sums_now = train_forward(engine, self.head, batch, self.t2d, self.dtype, rt.device, cfg.loss.positions,
                                          self.context, weigh)
            clock.mark("forward")
            # a context group's losses add up to its row's; DeepSpeed averages gradients over every rank
            engine.backward(out.loss * self.context.size)  # x 1 alone: exact, the same gradients
            clock.mark("backward")
            if micro == cfg.gradient_accumulation - 1 and cfg.zero_stage == 0 and self.dtype == torch.float32:
                grad_norm = _grad_norm(engine, self.params)
            engine.step()
            clock.mark("optimizer")
            tally.add(out)
            sums += sums_now
        all_reduce_sum(sums)
        metrics = tally.all_reduce().summary(self.weights, "train")
        loss = float(sums[0]) / self.per_step
        if not math.isfinite(loss):  # every rank sees the same reduced loss
            raise TrainError(f"step {self.state.step + 1}: the loss is {loss}; stopping before a non-finite draft "
                             "is saved or exported (check the store's states, train.init.draft and train.optim.lr)")
        grad_norm = grad_norm if grad_norm is not None else _grad_norm(engine, self.params)
        metrics |= {"train/loss": loss, "train/lr": lr, "train/tokens": int(sums[1]),
                    "train/epoch": self.state.epoch}
        if grad_norm is not None:
            metrics["train/grad_norm"] = grad_norm
        clock.mark("metrics")
        return loss, metrics | clock.metrics(), int(sums[1])

    def _micro_batch(self, step_in_epoch: int, micro: int) -> list[int] | None:
        """This rank's sample indices of micro-batch ``micro`` of a step (the next step's first past the
        last); None past the epoch's end."""
        cfg = self.cfg
        if micro == cfg.gradient_accumulation:
            step_in_epoch, micro = step_in_epoch + 1, 0
        if step_in_epoch >= steps_per_epoch(len(self.plan), self.context.data_world, cfg.gradient_accumulation):
            return None
        return self.plan[rank_batch_index(step_in_epoch, micro, self.context.data_rank, self.context.data_world,
                                          cfg.gradient_accumulation)]

    def run(self) -> None:
        """Steps until ``train.steps``, evaluating and saving as configured."""
        from tqdm import tqdm

        cfg, state = self.cfg, self.state
        if state.step == 0 and cfg.eval_at_start:
            self.maybe_eval()
        bar = tqdm(total=cfg.steps, initial=state.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (cfg.log.progress and self.rt.rank == 0), file=sys.stderr)
        with bar, contextlib.closing(self.loader):
            while state.step < cfg.steps:
                step_in_epoch = self._step_in_epoch()
                if step_in_epoch is None:
                    state.epoch, state.batch_index = state.epoch + 1, 0
                    continue
                t0 = time.perf_counter()
                loss, metrics, tokens = self.step(step_in_epoch)
                seconds = time.perf_counter() - t0
                state.step += 1
                state.batch_index += self.per_step
                if state.step == 1:  # the run's first step, whichever process ran it (kept in checkpoints)
                    state.first_loss = loss
                self.last_loss = loss
                self.tokens_total += tokens
                if state.tokens is not None:
                    state.tokens += tokens
                self.train_seconds += seconds
                self.window["tokens"] += tokens
                self.window["seconds"] += seconds
                if state.step % cfg.log.every == 0 or state.step == cfg.steps:
                    metrics["train/tokens_per_s"] = self.window["tokens"] / max(self.window["seconds"], 1e-9)
                    self.window = {"tokens": 0, "seconds": 0.0}
                    self.sink.log(metrics, state.step)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tau=f"{metrics['train/tau_sim']:.2f}",
                                tok_s=f"{tokens / seconds:.0f}")
                at_end = state.step == cfg.steps
                if self.eval_store is not None and ((cfg.eval_every and state.step % cfg.eval_every == 0)
                                                    or at_end):
                    self.maybe_eval()
                asked = self._store_asks_to_save()
                if (cfg.save_every and state.step % cfg.save_every == 0) or at_end or asked:
                    self.save()  # online, also when the shards read since the last save fill half the spool


    def finish(self, started: float) -> dict[str, Any]:
        """The final draft exported, the log closed, the store's producers stopped; the run's summary."""
        cfg, rt, state, draft = self.cfg, self.rt, self.state, self.draft
        out_dir = Path(cfg.out_dir)
        export_finite(out_dir / "final", draft, cfg.zero_stage,
                      {**self.info, "step": state.step, "eval": state.last_eval or {}}, rt.rank)
        self.sink.close()
        if rt.rank == 0:
            self.store.finish()  # online: the producers stop
        gpu_peaks = ([round(x / 2**30, 2) for x in per_rank(torch.cuda.max_memory_allocated(rt.device), rt)]
                     if rt.device.type == "cuda" else None)
        summary = {
            "stage": "train", "out": str(out_dir), "steps": state.step, "resumed_from_step": self.resumed_step,
            "world_size": rt.world_size, "hosts": [host for host, _ in rt.hosts], "zero_stage": cfg.zero_stage,
            "precision": cfg.precision,
            "device": str(rt.device), "train_samples": len(self.train_idx), "eval_samples": len(self.eval_idx),
            "draft_vocab_size": self.start.vocab.size, "trainable_parameters": parameter_count(draft.config)
            - (draft.config.draft_vocab_size * draft.config.hidden_size if cfg.init.freeze_lm_head else 0),
            "first_loss": state.first_loss, "last_loss": self.last_loss, "tokens": state.tokens,
            "tokens_per_s": round(self.tokens_total / self.train_seconds, 1) if self.train_seconds else None,
            "context_parallel": cfg.context_parallel,
            "peak_gpu_gib": max(gpu_peaks) if gpu_peaks else None, "peak_gpu_gib_per_rank": gpu_peaks,
            "peak_rss_gib_per_rank": [round(x / 2**20, 2)  # each process's peak resident memory
                                      for x in per_rank(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rt)],
            "eval_first": state.first_eval, "eval_last": ({k: v for k, v in state.last_eval.items()
                                                              if k in ("eval/loss", "eval/tau_sim")}
                                                             if state.last_eval else None),
            "best_step": state.best_step, "best_tau_sim": state.best_tau, "start": self.start.fit or None,
            "wall_seconds": round(time.perf_counter() - started, 2),
        }
        summary |= self.store.summary()
        if rt.rank == 0:
            atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary


def train(cfg: TrainConfig, target_cfg: TargetConfig | None = None, *, target: Target | None = None) -> dict[str, Any]:
    """Train (or resume) a draft head; returns a summary. Every rank calls this. Called as one
    process with ``train.context_parallel`` > 1, it starts the ranks on this machine
    (:mod:`eagle3.train.local_ranks`; ``target`` is then loaded by each of them)."""
    if not cfg.data.store or not cfg.out_dir:
        raise TrainError("train.data.store and train.out_dir must be set")
    ranks, cfg = local_ranks(cfg)
    if ranks > 1:
        if target is not None and target_cfg is None:
            raise TrainError(f"train.context_parallel={cfg.context_parallel}: the local ranks load the target "
                             "themselves; pass its TargetConfig, not only the loaded model")
        return train_on_local_ranks(train, cfg, target_cfg or TargetConfig(), ranks)
    target_cfg = target_cfg or TargetConfig()
    started = time.perf_counter()
    rt = init_runtime(cfg.device, cfg.collective_timeout_s)  # train.device=cuda without CUDA: a ConfigError, named
    with peers_named(rt):  # a collective that lost a rank (its node died): named, not a bare gloo/nccl trace
        context = context_group(rt, cfg.context_parallel)  # a size that does not divide the world: named
        if rt.device.type == "cpu":
            torch.set_num_threads(cfg.threads)
        cfg = replace(cfg, precision=resolve_precision(cfg.precision, cfg.optim, cfg.zero_stage, rt.device))

        # the data, checked against the target before anything is read for training; then the draft, the
        # target's head (the target itself is not needed after), the engine; then resume, or start over
        data, target = open_data(cfg, target_cfg, target, rt)
        pinned = {**cfg.pinned(), "world_size": rt.world_size, **data.identity}
        resume_tag = resume_point(Path(cfg.out_dir), cfg.resume, pinned)
        start = start_draft(cfg, data, target, resume_tag, rt)
        del target
        engine, schedule = build_engine(cfg.optim, cfg.steps, start.model, rt, precision=cfg.precision,
                                        zero_stage=cfg.zero_stage, gradient_accumulation=cfg.gradient_accumulation)
        state = RunState(pinned=pinned)
        start_over_or_resume(Path(cfg.out_dir), engine, rt, state, resume_tag)
        resumed_step = state.step if resume_tag is not None else None
        if (done := finished_earlier(Path(cfg.out_dir), cfg.steps, rt, resumed_step)) is not None:
            if rt.rank == 0:
                data.store.finish()  # nothing to read (online: the producers stop)
            return done
        # after any resume: DeepSpeed restores the clip a checkpoint saved
        if cfg.optim.name == "muon" and unclip_muon_updates_under_zero(engine) and cfg.optim.max_grad_norm:
            print0(f"train.optim.max_grad_norm={cfg.optim.max_grad_norm} is not applied: DeepSpeed's ZeRO optimizer "
                   "would clip Muon's orthogonalised updates instead of the gradients (train.zero_stage=0, or bf16 "
                   "at stage 1, clips the gradients)")

        loop = _Loop(cfg, rt, (engine, schedule), start, data, state, context, target_cfg, resumed_step)
        loop.run()
        return loop.finish(started)


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """Every TrainConfig field a flag (its docstring the help), and the target's name and dtype."""
    parser = argparse.ArgumentParser(prog="python -m eagle3.train", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    parser.add_argument("--target", default=TargetConfig.name_or_path, help="target name or path (default %(default)s)")
    parser.add_argument("--target-dtype", default=TargetConfig.dtype, help="dtype the target's head runs in")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    add_dataclass_arguments(parser, train_settings(), required=("data.store", "out_dir"),
                            aliases={"out_dir": "--out", "data.store": "--store"})
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("train", _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = vars(parse_moved(parser, argv, MOVED))
    target_cfg_args = {"name_or_path": args.pop("target"), "dtype": args.pop("target_dtype")}
    args.pop("local_rank")
    try:
        cfg = train_config(**args)
        target_cfg = TargetConfig(**target_cfg_args)
    except ValueError as err:
        parser.error(str(err))
    print0(json.dumps(train(cfg, target_cfg)))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        shutdown()  # the process groups go before the interpreter does
