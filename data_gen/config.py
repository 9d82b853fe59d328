"""The data stages' settings: prompt pools, selection, regeneration, the hidden-state harvest."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from eagle3.config import SamplingConfig
from eagle3.errors import ConfigError

TRAIN_SOURCES = ["sharegpt", "codeio", "stdlib", "reasoning_gym", "mmath", "chatterbot", "dataset_build",
                 "bfcl", "bfcl_agent", "code_agent"]


@dataclass
class UserFileConfig:
    """Prompts a user brings: jsonl (ShareGPT or OpenAI messages) or an HF datasets folder."""

    path: str = "???"
    domain: str = "general"
    """coding, science, multilingual or general."""
    language: str | None = None
    """ISO 639-1 code; detected per prompt when unset."""

    def __post_init__(self) -> None:
        from eagle3.conversations import DOMAINS

        if self.domain not in DOMAINS:
            raise ConfigError(f"pools.user_files.domain={self.domain!r}: expected one of {', '.join(DOMAINS)}")
        if self.language is not None and not re.fullmatch(r"[a-z]{2,3}", self.language):
            raise ConfigError(f"pools.user_files.language={self.language!r}: expected an ISO 639 code such as en, zh "
                              "or fil, quoted in YAML where it reads as a boolean ('no'), or unset: detected per "
                              "prompt")


@dataclass
class LongReuseConfig:
    """The ``long_reuse`` source (:mod:`data_gen.reuse`), used when ``pools.sources`` lists it."""

    tasks: int = 400
    context_chars: list[int] = field(default_factory=lambda: [0, 8000, 16000])
    """Each task's context length in characters, in turn (0: the text alone); ~4 characters a token."""
    turns_every: int = 3
    """Every N-th task gets a second request on the same context (0: none)."""

    def __post_init__(self) -> None:
        if self.tasks < 1:
            raise ConfigError(f"pools.long_reuse.tasks={self.tasks}: must be >= 1")
        if not self.context_chars or any(c < 0 for c in self.context_chars):
            raise ConfigError(f"pools.long_reuse.context_chars={list(self.context_chars)}: give one or more lengths "
                              ">= 0 (characters; 0 is the text alone)")
        if self.turns_every < 0:
            raise ConfigError(f"pools.long_reuse.turns_every={self.turns_every}: must be >= 0 (0: one turn)")


@dataclass
class PoolsConfig:
    """Prompt pools and held-out eval sets (data_gen.pools)."""

    RUN_ONLY: ClassVar[tuple[str, ...]] = ("out_dir",)

    out_dir: str = "runs/pools"
    seed: int = 0
    """Drives every sample, split and held-out selection."""
    sources: list[str] = field(default_factory=lambda: list(TRAIN_SOURCES))
    """Registered training sources (data_gen.sources.SOURCES) to include."""
    user_files: list[UserFileConfig] = field(default_factory=list)
    strict_user_files: bool = False
    """Stop at the first bad row of a user file (naming file:line) instead of skipping and counting."""
    val_fraction: float = 0.02
    min_chars: int = 2
    max_chars: int = 6000
    """Per user turn; longer prompts are skipped and counted (not those of a source long on purpose:
    ``long_reuse``)."""
    max_user_turns: int = 2
    per_generator: int = 60
    """Items per reasoning-gym math generator."""
    paragraphs_per_language: int = 60
    long_reuse: LongReuseConfig = field(default_factory=LongReuseConfig)
    eval_math: int = 100
    eval_multilingual: int = 20
    """MMATH problems held out; each appears in the 9 non-English languages."""
    eval_gsm8k: int = 150
    eval_alpaca: int = 100
    eval_tool_use: int = 100
    """BFCL single-turn questions held out (the ``tool_use`` set)."""
    eval_agent: int = 40
    """Agent conversations held out (the ``agent`` set): half BFCL multi-turn, half coding-agent tasks."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"pools.val_fraction={self.val_fraction}: must be in [0, 1)")
        if "sharegpt" not in self.sources:
            raise ConfigError("pools.sources must include sharegpt (the Alpaca stand-in eval set is drawn from it)")


@dataclass
class SelectConfig:
    """Which pool prompts the pipeline regenerates: a seeded, domain-balanced subset."""

    num_prompts: int = 64
    domains: list[str] = field(default_factory=lambda: ["coding", "science", "multilingual", "general", "tool_use",
                                                        "agent"])
    """Taken in turn, one prompt per domain per round, until ``num_prompts``."""
    split: str = "train"
    """Pool file to draw from: train or val."""
    seed: int = 0

    def __post_init__(self) -> None:
        from eagle3.conversations import DOMAINS

        unknown = [d for d in self.domains if d not in DOMAINS]
        if unknown or not self.domains:
            raise ConfigError(f"select.domains={self.domains}: expected a non-empty subset of {', '.join(DOMAINS)}")
        if self.split not in ("train", "val"):
            raise ConfigError(f"select.split={self.split!r}: expected train or val")
        if self.num_prompts < 1:
            raise ConfigError(f"select.num_prompts={self.num_prompts}: must be >= 1")

@dataclass
class RegenerateConfig:
    """The regeneration stage: every assistant turn of a prompt pool rewritten by the target.

    All fields but ``threads``, ``workers`` (and the paths) go into the output folder's manifest: a
    rerun into the same folder must use the same values, so that resumed batches match.
    """

    RUN_ONLY: ClassVar[tuple[str, ...]] = ("pool", "out_dir", "threads", "workers")
    """Where and how fast, not what: the fields that do not shape the regenerated data."""

    pool: str = ""
    """The prompt pool, jsonl of conversation records."""
    out_dir: str = ""
    """Output folder: manifest.json, parts/, dataset/regenerated.jsonl, summary.json."""
    limit: int | None = None
    """Only the first ``limit`` records of the pool."""
    batch_size: int = 8
    """Records per batch; batch b is always records [b*batch_size, (b+1)*batch_size), generated on its own
    (its output depends on nothing else) and written as one part."""
    rows: int = 8
    """(hf backend) Conversations of a batch decoded together, each keeping its KV cache from turn to turn;
    a row whose conversation ends takes the batch's next one. More rows read the weights once for more
    tokens, up to where attending over every row's history costs more than the weights."""
    max_new_tokens: int = 256
    """Per assistant turn."""
    temperature: float = 0.0
    """0 is greedy decoding."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    seed: int = 0
    """Sampling seed; each batch and turn depth derives its own from it."""
    max_prompt_tokens: int | None = 2048
    """A turn whose prompt is longer is dropped with the turns after it (None, or 0 on the command line: no limit)."""
    threads: int = 1
    """torch intra-op threads on CPU; 1 was fastest on a loaded 2-core machine."""
    workers: int = 1
    """Processes generating batches side by side (hf backend; vLLM batches and shards on its own and
    runs as one), each with its own copy of the target and ``threads`` threads; on CUDA with as many
    GPUs, worker i uses GPU i. Each batch is generated alone from its own seed, so the output is the
    same for any number of workers."""
    backend: str = "hf"
    """hf (transformers) or vllm (run from the venv of scripts/setup_vllm_env.sh)."""
    thinking: str = "template"
    """A reasoning target's thinking: ``template`` (whatever its template does unasked), ``on``, ``off``, or
    ``mix`` (each record on with probability ``thinking_on_fraction``, drawn from the seed), set through the
    template's own switch (``enable_thinking`` or ``thinking``); a template without one is refused. The
    mode is kept in each record (``generation.thinking``) so that the harvest renders it the same way."""
    thinking_on_fraction: float = 0.5
    """With ``thinking=mix``: the share of records regenerated with thinking on."""
    capture: bool = False
    """(hf backend; vLLM keeps none, said in one line) Keep the states the generating forwards computed
    (aux-layer inputs, pre-norm last state) of every sample the harvest will store, in ``states/``: a
    harvest of this folder's dataset then reads them instead of running the target (``harvest.fused``)."""
    capture_dtype: str = "bfloat16"
    """The kept states' dtype: bfloat16 or float32 (a harvest storing another dtype than this one
    recomputes, unless this is float32)."""

    def __post_init__(self) -> None:
        if self.backend not in ("hf", "vllm"):
            raise ConfigError(f"regenerate.backend={self.backend!r}: expected hf or vllm")
        if self.capture_dtype not in ("bfloat16", "float32"):
            raise ConfigError(f"regenerate.capture_dtype={self.capture_dtype!r}: expected bfloat16 or float32")
        if self.thinking not in THINKING_MODES:
            raise ConfigError(f"regenerate.thinking={self.thinking!r}: expected one of {', '.join(THINKING_MODES)}")
        if not 0.0 <= self.thinking_on_fraction <= 1.0:
            raise ConfigError(f"regenerate.thinking_on_fraction={self.thinking_on_fraction}: must be in [0, 1]")
        for name in ("batch_size", "rows", "threads", "workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"regenerate.{name}={getattr(self, name)}: must be >= 1")
        if self.limit is not None and self.limit < 0:
            raise ConfigError(f"regenerate.limit={self.limit}: must be >= 0")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"regenerate.max_prompt_tokens={self.max_prompt_tokens}: must be >= 1 or None")
        try:
            self.sampling  # noqa: B018  (validates the sampling settings)
        except ConfigError as err:
            raise ConfigError(f"regenerate.{err}") from None

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


THINKING_MODES = ("template", "on", "off", "mix")


@dataclass
class HarvestConfig:
    """The hidden-state harvest (data_gen.harvest): regenerated conversations -> shard store."""

    RUN_ONLY: ClassVar[tuple[str, ...]] = ("data", "out_dir", "shard", "threads", "spool_budget_mb", "fused")
    """The fields that do not shape the store (the data is pinned by its sha256; a fused capture equals
    a separate harvest)."""

    data: str = ""
    """Regenerated conversations (jsonl), e.g. <regenerate.out_dir>/dataset/regenerated.jsonl."""
    out_dir: str = ""
    dtype: str = "bfloat16"
    """Stored state dtype: bfloat16, float8_e4m3fn (per-row scales; half the disk) or float32."""
    store: str = "last"
    """last: the pre-norm last-layer state (the trainer applies the target's norm and lm_head);
    topk: the target's top-k next-token log-probs instead (smaller for large hidden sizes)."""
    topk: int = 0
    max_seq_len: int = 2048
    """Longer conversations are truncated (counted)."""
    batch_size: int = 4
    max_shard_mb: float = 256
    shard: str = "0/1"
    """i/n: this worker harvests shards j with j % n == i (Slurm arrays, several processes)."""
    backend: str = "hf"
    """hf, or vllm (run from the venv of scripts/setup_vllm_env.sh)."""
    threads: int = 1
    spool_budget_mb: float = 1024.0
    """Online training (train.data.mode=online): out_dir is the spool producers fill, at most this many MiB
    (plus the one shard the trainer waits for)."""
    fused: str = "auto"
    """Read the states the regeneration kept (``regenerate.capture``, its ``states/`` beside ``data``)
    instead of running the target: ``auto`` where they exist and were made by this target, dtype, chat
    template and aux layers (else the target runs, said in one line), ``on`` (a mismatch fails, naming
    the key), ``off``."""

    def __post_init__(self) -> None:
        if self.backend not in ("hf", "vllm"):
            raise ConfigError(f"harvest.backend={self.backend!r}: expected hf or vllm")
        if self.fused not in ("auto", "on", "off"):
            raise ConfigError(f"harvest.fused={self.fused!r}: expected auto, on or off")
        if self.dtype not in ("bfloat16", "float8_e4m3fn", "float32"):
            raise ConfigError(f"harvest.dtype={self.dtype!r}: expected bfloat16, float8_e4m3fn or float32")
        if self.store not in ("last", "topk") or (self.store == "topk") != (self.topk > 0):
            raise ConfigError(f"harvest.store={self.store!r}, topk={self.topk}: use last, or topk with topk > 0")
        for name in ("max_seq_len", "batch_size", "threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"harvest.{name}={getattr(self, name)}: must be >= 1")
        if self.max_shard_mb <= 0:
            raise ConfigError(f"harvest.max_shard_mb={self.max_shard_mb}: must be > 0")
        self.worker  # noqa: B018  (validates shard)

    @property
    def worker(self) -> tuple[int, int]:
        try:
            i, n = (int(x) for x in self.shard.split("/"))
        except ValueError:
            raise ConfigError(f"harvest.shard={self.shard!r}: expected i/n, e.g. 0/4") from None
        if not 0 <= i < n:
            raise ConfigError(f"harvest.shard={self.shard!r}: need 0 <= i < n")
        return i, n


@dataclass
class QuantizeConfig:
    """The ``quantize`` stage: convert the target to NVFP4 (as Blackwell serves it) and run every later
    stage (regeneration, harvest, training, mining, evaluation) on the converted target, emulated."""

    RUN_ONLY: ClassVar[tuple[str, ...]] = ("out_dir",)

    mode: str = "w4a4"
    """w4a4 (weights and activations FP4, activation scales calibrated) or w4a16 (weights only)."""
    calibration: str = ""
    """Pool or dataset jsonl whose conversations set the activation scales (w4a4 needs it); in the
    pipeline, empty means the pools stage's train pool."""
    samples: int = 64
    """Calibration conversations (a seeded random pick)."""
    max_tokens: int = 512
    """Tokens per calibration conversation."""
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    """Linear names left unquantised."""
    out_dir: str = ""
    """The converted checkpoint (written atomically); in the pipeline, empty means ``<out_dir>/nvfp4-target``."""

    def __post_init__(self) -> None:
        if self.mode not in ("w4a4", "w4a16"):
            raise ConfigError(f"quantize.mode={self.mode!r}: expected w4a4 or w4a16")
        for name in ("samples", "max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"quantize.{name}={getattr(self, name)}: must be >= 1")
