"""The eval's generations: the pair (target and draft) loaded and checked, each prompt decoded
plainly and by each proposer, where a speculative output parts from the plain one judged against the
target's precision (a near-tie, or a loss), in this process or in several side by side."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eagle3.config import SamplingConfig
from eagle3.device import usable_cores
from eagle3.errors import Eagle3Error
from eagle3.target.positions import context_length
from eagle3.target.reasoning import DEFAULT_MARKERS
from serve_eval.adaptive import measure_cost
from serve_eval.config import SpecConfig
from serve_eval.spec_decode import DecodeStats, SpeculativeDecoder

TIE_MARGIN = 1e-4
"""A divergence from plain decoding where the target's top-2 logits are closer than this (fp32) is a
near-tie, which the batched verification's other order of reduction may flip."""
TIE_ULPS = 4
"""In a coarser type (bf16, fp16) a near-tie is closer than this many units in the last place of the
top logit (bf16's unit is 0.125 at a logit of 20): the verification and plain decoding round apart
through every layer. A weaker check than fp32's, stated in the report as the dtype it ran in."""


def tie_margin(dtype: torch.dtype, top: float) -> float:
    """The top-2 margin under which a divergence is a near-tie for a target computing in ``dtype``
    whose top logit is ``top``: :data:`TIE_MARGIN`, or :data:`TIE_ULPS` units in the last place."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    ulp = eps * 2.0 ** math.floor(math.log2(abs(top))) if top else eps
    return max(TIE_MARGIN, TIE_ULPS * ulp)


def top2_margin(target: Any, ids: list[int]) -> float:
    return judged_margin(target, ids)[0]


def judged_margin(target: Any, ids: list[int]) -> tuple[float, bool]:
    """(the target's top-2 logit margin after ``ids``, whether a divergence there is a near-tie in the
    dtype it computes in: :func:`tie_margin`)."""
    with torch.no_grad():
        logits = target(torch.tensor([ids], device=target.device), return_logits=True).logits[0, -1].float()
    top = logits.topk(2).values
    margin = float(top[0] - top[1])
    return margin, margin < tie_margin(getattr(target, "dtype", torch.float32), float(top[0]))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def round_parts(tokenizer: Any, prompt: Sequence[int], tokens: Sequence[int], stats: DecodeStats) -> list[bool]:
    """Per round of a generation: whether its first drafted token lies in the target's thinking block
    (:class:`~eagle3.target.reasoning.ThinkingMarkers`), by where the round starts (``stats.contexts``)."""
    labels = DEFAULT_MARKERS.label(tokenizer, prompt, tokens)
    return [bool(labels[c - len(prompt)]) if 0 <= c - len(prompt) < len(labels) else False for c in stats.contexts]


def load_pair(draft_path: str, target_name: str, dtype: str = "auto", device: str = "auto") -> tuple[Any, Any]:
    """The target (capturing the draft's aux layers) and the draft: :func:`load_pair_meta` without the meta."""
    target, draft, _ = load_pair_meta(draft_path, target_name, dtype, device)
    return target, draft


def load_pair_meta(draft_path: str, target_name: str, dtype: str = "auto",
                   device: str = "auto") -> tuple[Any, Any, dict[str, Any]]:
    """The target (capturing the draft's aux layers), the draft and its ``draft.json``, read once and
    checked against each other: hidden size, vocabulary, aux layer ids, and the tokenizer where the
    draft recorded the fingerprint of the one it was trained with. Both on ``device`` (``auto``: CUDA
    when present) in the target's ``dtype`` (``auto``: bf16 on CUDA and on CPUs with native bf16, fp32
    elsewhere).

    A draft without its own embedding gets the target's; errors are :class:`DraftFormatError`,
    ``ValueError`` or ``OSError`` naming the file or the mismatch."""
    from eagle3.export import fit_to_target, load_draft
    from eagle3.target.model import load_target

    loaded = load_draft(draft_path)
    target = load_target(target_name, dtype=dtype, device=device, aux_layer_ids=loaded.aux_layer_ids)
    fit_to_target(loaded, target)
    return target, loaded.draft.to(device=target.device, dtype=target.dtype).eval(), loaded.meta


@dataclass(frozen=True)
class PairSource:
    """Where a worker process loads the evaluated pair from (what :func:`load_pair` takes)."""

    draft: str
    target: str
    dtype: str
    device: str

    @classmethod
    def of(cls, draft: str, target_name: str, target: Any) -> PairSource:
        """The source of a pair loaded in this process: the same dtype and device, resolved."""
        return cls(str(draft), target_name, str(target.dtype).removeprefix("torch."), str(target.device))


@dataclass
class Served:
    """One prompt's generations: plain decoding and each proposer's (its stats, its rounds' parts,
    and where it parted from plain decoding: None when equal, or not greedy)."""

    set: str
    index: int
    plain: DecodeStats
    runs: dict[str, tuple[DecodeStats, list[bool], dict[str, Any] | None]]


def make_decoders(target: Any, draft: Any, config: SpecConfig, compare: Sequence[str]) -> tuple[dict[str, Any], Any]:
    """A decoder per proposer (``config``'s first), its lookup priced by this machine's cost model,
    measured first (it also warms the device up); the cost model, or None where nothing is drafted."""
    from dataclasses import replace

    decoders = {config.proposer: SpeculativeDecoder(target, draft, config)}
    for name in compare:
        if name not in decoders:
            decoders[name] = SpeculativeDecoder(target, draft, replace(config, proposer=name))
    main = decoders[config.proposer]
    width = config.budget if config.mode == "tree" else config.k
    room = context_length(target.config) or 4096
    cost = measure_cost(main, width, context=min(256, room // 2))
    for decoder in decoders.values():
        decoder.cost_lookup(cost.verify_s)
    return decoders, (cost if main.proposer is not None else None)


def serve(target: Any, decoders: dict[str, Any], items: Sequence[tuple[str, int, list[int]]],
           params: SamplingConfig, max_new_tokens: int, stops: frozenset[int], seed: int,
           done: Callable[[Served], None]) -> None:
    """Plain decoding, then each decoder, on every ``(set, index, prompt)``; ``done`` gets each prompt's."""
    tokenizer = getattr(target, "tokenizer", None)  # labels rounds: thinking or answer
    plain_decoder = next(iter(decoders.values()))
    for name, i, prompt in items:
        base = plain_decoder.generate(prompt, max_new_tokens, stops, params, seed=seed + i, speculate=False)
        runs = {}
        for proposer, decoder in decoders.items():
            got = decoder.generate(prompt, max_new_tokens, stops, params, seed=seed + i)
            parts = (round_parts(tokenizer, prompt, got.tokens, got.stats) if tokenizer is not None
                     else [False] * len(got.stats.accepted))
            at = first_divergence(got.tokens, base.tokens) if params.greedy else None
            divergence = None
            if at is not None:
                margin, tie = judged_margin(target, prompt + base.tokens[:at])
                divergence = {"prompt": i, "position": at, "margin": round(margin, 6), "tie": tie}
            runs[proposer] = (got.stats, parts, divergence)
        done(Served(name, i, base.stats, runs))


def _worker(w: int, source: PairSource, threads: int, config: SpecConfig, compare: Sequence[str],
            items: list[tuple[str, int, list[int]]], params: SamplingConfig, max_new_tokens: int,
            stops: frozenset[int], seed: int, out: Any) -> None:
    """Worker ``w``: its own pair and cost model, its share of the prompts, each put on ``out``."""
    torch.set_num_threads(threads)
    if source.device.startswith("cuda"):
        torch.cuda.set_device(source.device)
    target, draft = load_pair(source.draft, source.target, source.dtype, source.device)
    decoders, _ = make_decoders(target, draft, config, compare)
    serve(target, decoders, items, params, max_new_tokens, stops, seed, lambda one: out.put((w, one)))


class EvalError(Eagle3Error, RuntimeError):
    """The evaluation cannot finish: a worker process failed."""


class Workers:
    """``n - 1`` processes beside this one, worker w serving ``items[w::n]`` (on CUDA, GPU w) with
    this process's torch threads; what they serve read back with :meth:`collect`."""

    def __init__(self, n: int, source: PairSource | None, args: tuple[Any, ...]) -> None:
        self.n, self.source, self.args = n, source, args
        self.procs: dict[int, Any] = {}
        self.queue: Any = None
        self.owed: dict[int, int] = {}  # per worker: the prompts it has not sent back yet

    def start(self, items: list[tuple[str, int, list[int]]]) -> None:
        import multiprocessing
        from dataclasses import replace

        if self.n == 1:
            return
        assert self.source is not None
        ctx = multiprocessing.get_context("spawn")
        self.queue = ctx.Queue()
        config, compare, params, max_new_tokens, stops, seed = self.args
        for w in range(1, self.n):
            source = replace(self.source, device=f"cuda:{w}") if self.source.device.startswith("cuda") else self.source
            share = items[w::self.n]
            proc = ctx.Process(target=_worker, daemon=True,
                               args=(w, source, torch.get_num_threads(), config, compare, share, params,
                                     max_new_tokens, stops, seed, self.queue))
            proc.start()
            self.procs[w], self.owed[w] = proc, len(share)

    def collect(self, block: bool) -> list[Served]:
        """What the workers served since the last call; ``block``: until they have sent every prompt.
        A worker that exits before sending all of its share fails the evaluation, naming its exit code."""
        import queue

        got: list[Served] = []
        while any(self.owed.values()):
            try:
                w, one = self.queue.get(timeout=0.5) if block else self.queue.get_nowait()
            except queue.Empty:
                gone = [w for w, proc in self.procs.items() if self.owed[w] and proc.exitcode is not None]
                if not gone:
                    if block:
                        continue
                    break
                try:  # what it put just before exiting may still be on its way
                    w, one = self.queue.get(timeout=2.0)
                except queue.Empty:
                    w = gone[0]
                    raise EvalError(f"eval.workers: worker {w} exited with code {self.procs[w].exitcode} before "
                                    f"sending {self.owed[w]} of its prompts (its message is above)") from None
            self.owed[w] -= 1
            got.append(one)
        return got

    def stop(self) -> None:
        for proc in self.procs.values():  # finished, or on an error here: the workers stop too
            if proc.is_alive():
                proc.join(timeout=5.0 if not any(self.owed.values()) else 0.0)
            if proc.is_alive():
                proc.terminate()
                proc.join()


def eval_workers(workers: int, device: str, threads: int = 1) -> int:
    """The processes an evaluation on ``device`` (the loaded target's) runs with ``threads`` torch
    threads each: ``workers``, but no more than the GPUs from this one on (two processes sharing a GPU
    would time each other's forwards), or than the CPU cores this process may use over ``threads``;
    one on any other accelerator."""
    if device.startswith("cuda"):
        first = int(device.partition(":")[2] or 0)
        return max(1, min(workers, torch.cuda.device_count())) if first == 0 else 1
    if not device.startswith("cpu"):
        return 1
    cores = usable_cores()
    return max(1, min(workers, cores // max(threads, 1)))
