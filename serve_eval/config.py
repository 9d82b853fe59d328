"""The serving settings: how the draft proposes (:class:`SpecConfig`, the loop's, the server's and
the evaluation's), the serving evaluation, and the NVFP4 stage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from eagle3.config import SamplingConfig
from eagle3.errors import ConfigError
from eagle3.train.config import WANDB_MODES

EVAL_SETS = ("mtbench", "humaneval", "gsm8k", "multilingual", "tool_use", "agent")
"""The pools' eval sets the evaluation runs by default (``<pools>/eval/<name>.jsonl``)."""


THINKING_MODES = ("template", "on", "off")
"""How an evaluation renders prompts for a reasoning target (:meth:`ChatFormat.in_mode`)."""

TARGET_CACHES = ("dynamic", "static", "graphs")  # SpecConfig.target_cache; serve_eval/static_cache.py
PROPOSERS = ("draft", "lookup", "hybrid")
"""SpecConfig.proposer: the draft alone, the lookup alone (no draft forward), or both in one tree."""


@dataclass(frozen=True)
class SpecConfig:
    """How the draft proposes: a chain of ``k`` tokens, or a tree of depth ``k``."""

    mode: str = "chain"
    """chain or tree."""
    k: int = 3
    """Chain length, or tree depth."""
    topk: int = 4
    """Tree: children per expanded node, and nodes expanded per depth."""
    budget: int = 16
    """Tree: draft tokens verified per round (the best by cumulative draft log-prob); a hybrid tree's
    lookup branch takes its room out of it (the draft's last nodes make way)."""
    target_cache: str = "dynamic"
    """The target's KV cache: dynamic (transformers' DynamicCache, cropped after each round); static
    (one preallocated cache, rolled back by length, a tree's accepted nodes moved down in place,
    :mod:`serve_eval.static_cache`); graphs (static, and the fixed-length forwards compiled with mode
    reduce-overhead: CUDA graphs on CUDA)."""
    proposer: str = "draft"
    """draft (the draft's chain or tree), lookup (the continuation of the longest earlier match of the
    context's last tokens, :mod:`serve_eval.lookup`; no draft needed), or hybrid (both in one verified
    tree, shared prefixes merged)."""
    lookup_k: int = 8
    """Most tokens the lookup proposes in a round (its branch)."""
    lookup_min: int = 1
    """Shortest match (tokens ending the context) the lookup acts on."""
    lookup_max: int = 8
    """Longest n-gram the lookup indexes (a match may run further back; it is then measured whole)."""
    lookup_scale: int = 2
    """Tokens the lookup proposes per matched token, up to ``lookup_k`` (a one-token match is a weak hint)."""

    def __post_init__(self) -> None:
        if self.mode not in ("chain", "tree"):
            raise ConfigError(f"mode={self.mode!r}: expected chain or tree")
        if self.proposer not in PROPOSERS:
            raise ConfigError(f"proposer={self.proposer!r}: expected one of {', '.join(PROPOSERS)}")
        if self.target_cache not in TARGET_CACHES:
            raise ConfigError(f"target_cache={self.target_cache!r}: expected {', '.join(TARGET_CACHES[:-1])} or "
                              f"{TARGET_CACHES[-1]}")
        for name in ("k", "topk", "budget", "lookup_k", "lookup_min", "lookup_scale"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.lookup_max < self.lookup_min:
            raise ConfigError(f"lookup_max={self.lookup_max}: must be >= lookup_min={self.lookup_min}")
        if self.proposer == "hybrid" and self.mode == "tree" and self.budget <= self.lookup_k:
            raise ConfigError(f"budget={self.budget}: a hybrid tree's budget holds the lookup's branch "
                              f"(lookup_k={self.lookup_k}) and at least one draft node; raise budget above "
                              f"{self.lookup_k} or lower lookup_k")

    @property
    def uses_draft(self) -> bool:
        return self.proposer != "lookup"

    @property
    def uses_lookup(self) -> bool:
        return self.proposer != "draft"


@dataclass
class EvalConfig:
    """The serving evaluation (serve_eval): the bundled loop, speculative vs plain, on the eval sets.
    Its speculation and sampling settings default to :class:`SpecConfig`'s and
    :class:`~eagle3.config.SamplingConfig`'s, and are checked by them."""

    RUN_ONLY: ClassVar[tuple[str, ...]] = ("out_dir", "wandb_mode", "workers")
    """The fields that do not change the evaluation's tokens or the draft's figures (the lookup's move
    with ``workers``, as they do with the machine's load: :func:`serve_eval.evaluate.evaluate`)."""

    draft: str | None = None
    """Draft folder (any format eagle3.export reads); in the pipeline None: the last mining round's
    draft, else the training run's final one."""
    sets: list[str] = field(default_factory=lambda: list(EVAL_SETS))
    """Eval sets to run, <pools>/eval/<name>.jsonl."""
    per_set: int = 10
    """Prompts per set (the first user turn of each, or the turns up to its request: a long_chat history)."""
    max_new_tokens: int = 96
    """New tokens per prompt, speculative and plain alike."""
    mode: str = SpecConfig.mode
    """chain or tree."""
    k: int = SpecConfig.k
    """Chain length, or tree depth."""
    topk: int = SpecConfig.topk
    """Tree: children per expanded node, and nodes expanded per depth."""
    budget: int = SpecConfig.budget
    """Tree: draft tokens verified per round."""
    target_cache: str = SpecConfig.target_cache
    """dynamic, static (chains) or graphs (static + CUDA graphs on CUDA); see :class:`SpecConfig`."""
    proposer: str = SpecConfig.proposer
    """draft, lookup or hybrid (both in one verified tree); see :class:`SpecConfig`."""
    compare: list[str] = field(default_factory=lambda: ["lookup"])
    """Other proposers run on the same prompts beside ``proposer``, reported side by side (tokens per
    target forward, speedup, acceptance by proposer); [] for none."""
    lookup_k: int = SpecConfig.lookup_k
    """Most tokens the lookup proposes in a round."""
    lookup_min: int = SpecConfig.lookup_min
    """Shortest match the lookup acts on."""
    lookup_max: int = SpecConfig.lookup_max
    """Longest n-gram the lookup indexes."""
    lookup_scale: int = SpecConfig.lookup_scale
    """Tokens the lookup proposes per matched token (up to lookup_k)."""
    temperature: float = SamplingConfig.temperature
    """0 is greedy (outputs equal plain decoding token for token); above, sampled as the target samples."""
    top_p: float = SamplingConfig.top_p
    top_k: int = SamplingConfig.top_k
    thinking: str = "template"
    """Reasoning targets: render the eval prompts with the template's thinking switch ``on`` or ``off``
    (``template``: unset, whatever the template does unasked), to measure each mode."""
    workers: int = 1
    """Processes serving the prompts side by side, each with the run's torch threads, each prompt's
    plain and speculative runs in the same one: the same tokens and draft tau in about 1 / workers of
    the time (capped at the cores over the threads, or at the GPUs: one process per GPU). Each loads
    the target: workers times its memory."""
    out_dir: str = ""
    """Where report.json, report.md and the plots go."""
    wandb_mode: str = "offline"

    def __post_init__(self) -> None:
        for name in ("per_set", "max_new_tokens", "workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"eval.{name}={getattr(self, name)}: must be >= 1")
        try:
            self.spec  # noqa: B018  (the speculation and sampling settings are checked by their classes)
            self.sampling  # noqa: B018
        except ConfigError as err:
            raise ConfigError(f"eval.{err}") from None
        for name in self.compare:
            if name not in PROPOSERS:
                raise ConfigError(f"eval.compare: {name!r} is not a proposer (expected {', '.join(PROPOSERS)})")
            try:
                self.spec_for(name)
            except ConfigError as err:
                raise ConfigError(f"eval.compare: {name}: {err}") from None
        if self.thinking not in THINKING_MODES:
            raise ConfigError(f"eval.thinking={self.thinking!r}: expected one of {', '.join(THINKING_MODES)}")
        if self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"eval.wandb_mode={self.wandb_mode!r}: expected one of {', '.join(WANDB_MODES)}")

    @property
    def spec(self) -> SpecConfig:
        return self.spec_for(self.proposer)

    def spec_for(self, proposer: str) -> SpecConfig:
        """These speculation settings with ``proposer`` (the main run's, or one of ``compare``)."""
        return SpecConfig(mode=self.mode, k=self.k, topk=self.topk, budget=self.budget,
                          target_cache=self.target_cache, proposer=proposer, lookup_k=self.lookup_k,
                          lookup_min=self.lookup_min, lookup_max=self.lookup_max, lookup_scale=self.lookup_scale)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


