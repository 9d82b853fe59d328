"""The typed config tree. Hydra recipes in ``recipes/`` compose YAML over these dataclasses;
the entry point converts once, and nothing below it sees a ``DictConfig``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class TargetConfig:
    """Which model the draft speculates for, and how to run it."""

    name_or_path: str = "smollm2-135m"
    """An embedded target name, a local HF model folder, a local .gguf file, or a hub id."""
    dtype: str = "auto"
    """auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16 or float16."""
    device: str = "auto"
    """auto, cpu, cuda, cuda:N."""
    aux_layer_ids: list[int] | None = None
    """Decoder layers whose inputs feed the draft; default (2, N//2, N-3)."""
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    """Run code shipped with the model folder: only for models you trust."""
    architecture: dict[str, Any] | None = None
    """The target's architecture as its config.json states it (hidden_size, num_hidden_layers,
    vocab_size, ...; nested under ``text_config`` for multimodal checkpoints): lets a recipe be
    planned without the weights (``stages=[plan]``: draft shape and parameter count). Once the
    model is loaded, every value given here is checked against its config."""
    nvfp4_mode: str = "auto"
    """For an NVFP4 checkpoint (``python -m eagle3.nvfp4 convert``), run emulated: auto (as the
    checkpoint says: W4A4 when it has activation scales), w4a4, or w4a16 (weights only)."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"target.dtype={self.dtype!r}: expected one of {', '.join(_DTYPES)}")
        if self.nvfp4_mode not in ("auto", "w4a4", "w4a16"):
            raise ValueError(f"target.nvfp4_mode={self.nvfp4_mode!r}: expected auto, w4a4 or w4a16")
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise ValueError(f"target.device={self.device!r}: expected auto, cpu, cuda, cuda:N or mps")


def add_target_arguments(parser: Any, *, target: str | None = None) -> None:
    """``--target``, ``--target-dtype`` and ``--device`` on an argparse CLI that loads a target, with
    :class:`TargetConfig`'s defaults and meanings (the one definition of these three flags)."""
    parser.add_argument("--target", default=TargetConfig.name_or_path if target is None else target,
                        help="embedded target name, model folder, .gguf file or hub id (default %(default)s)")
    parser.add_argument("--target-dtype", default=TargetConfig.dtype, choices=_DTYPES,
                        help="auto: bf16 on CUDA, fp32 elsewhere (default %(default)s)")
    parser.add_argument("--device", default=TargetConfig.device,
                        help="where the target (and draft) run: auto (CUDA when present), cpu, cuda, cuda:N")


TRAIN_SOURCES = ["sharegpt", "codeio", "stdlib", "reasoning_gym", "mmath", "chatterbot", "dataset_build"]


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
            raise ValueError(f"pools.user_files.domain={self.domain!r}: expected one of {', '.join(DOMAINS)}")
        if self.language is not None and not re.fullmatch(r"[a-z]{2,3}", self.language):
            raise ValueError(f"pools.user_files.language={self.language!r}: expected an ISO 639 code such as en, zh "
                             "or fil, quoted in YAML where it reads as a boolean ('no'), or unset: detected per prompt")


@dataclass
class PoolsConfig:
    """Prompt pools and held-out eval sets (data_gen.pools)."""

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
    """Per user turn; longer prompts are skipped and counted."""
    max_user_turns: int = 2
    per_generator: int = 60
    """Items per reasoning-gym math generator."""
    paragraphs_per_language: int = 60
    eval_math: int = 100
    eval_multilingual: int = 20
    """MMATH problems held out; each appears in the 9 non-English languages."""
    eval_gsm8k: int = 150
    eval_alpaca: int = 100

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"pools.val_fraction={self.val_fraction}: must be in [0, 1)")
        if "sharegpt" not in self.sources:
            raise ValueError("pools.sources must include sharegpt (the Alpaca stand-in eval set is drawn from it)")


@dataclass
class SelectConfig:
    """Which pool prompts the pipeline regenerates: a seeded, domain-balanced subset."""

    num_prompts: int = 64
    domains: list[str] = field(default_factory=lambda: ["coding", "science", "multilingual", "general"])
    """Taken in turn, one prompt per domain per round, until ``num_prompts``."""
    split: str = "train"
    """Pool file to draw from: train or val."""
    seed: int = 0

    def __post_init__(self) -> None:
        from eagle3.conversations import DOMAINS

        unknown = [d for d in self.domains if d not in DOMAINS]
        if unknown or not self.domains:
            raise ValueError(f"select.domains={self.domains}: expected a non-empty subset of {', '.join(DOMAINS)}")
        if self.split not in ("train", "val"):
            raise ValueError(f"select.split={self.split!r}: expected train or val")
        if self.num_prompts < 1:
            raise ValueError(f"select.num_prompts={self.num_prompts}: must be >= 1")


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings; ``temperature == 0`` is greedy (top_p/top_k then unused)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables it."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RegenerateConfig:
    """The regeneration stage: every assistant turn of a prompt pool rewritten by the target.

    All fields but ``threads`` (and the paths) go into the output folder's manifest: a
    rerun into the same folder must use the same values, so that resumed batches match.
    """

    pool: str = ""
    """The prompt pool, jsonl of conversation records."""
    out_dir: str = ""
    """Output folder: manifest.json, parts/, dataset/regenerated.jsonl, summary.json."""
    limit: int | None = None
    """Only the first ``limit`` records of the pool."""
    batch_size: int = 8
    """Records per batch; batch b is always records [b*batch_size, (b+1)*batch_size)."""
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
    """A turn whose prompt is longer is dropped with the turns after it (None: no limit)."""
    threads: int = 1
    """torch intra-op threads on CPU; 1 was fastest on a loaded 2-core machine."""
    backend: str = "hf"
    """hf (transformers) or vllm (run from the venv of scripts/setup_vllm_env.sh)."""

    def __post_init__(self) -> None:
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"regenerate.backend={self.backend!r}: expected hf or vllm")
        for name in ("batch_size", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"regenerate.{name}={getattr(self, name)}: must be >= 1")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"regenerate.limit={self.limit}: must be >= 0")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"regenerate.max_prompt_tokens={self.max_prompt_tokens}: must be >= 1 or None")
        try:
            self.sampling  # noqa: B018  (validates the sampling settings)
        except ValueError as err:
            raise ValueError(f"regenerate.{err}") from None

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k)


@dataclass
class HarvestConfig:
    """The hidden-state harvest (data_gen.harvest): regenerated conversations -> shard store."""

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

    def __post_init__(self) -> None:
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"harvest.backend={self.backend!r}: expected hf or vllm")
        if self.dtype not in ("bfloat16", "float8_e4m3fn", "float32"):
            raise ValueError(f"harvest.dtype={self.dtype!r}: expected bfloat16, float8_e4m3fn or float32")
        if self.store not in ("last", "topk") or (self.store == "topk") != (self.topk > 0):
            raise ValueError(f"harvest.store={self.store!r}, topk={self.topk}: use last, or topk with topk > 0")
        for name in ("max_seq_len", "batch_size", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"harvest.{name}={getattr(self, name)}: must be >= 1")
        if self.max_shard_mb <= 0:
            raise ValueError(f"harvest.max_shard_mb={self.max_shard_mb}: must be > 0")
        self.worker  # noqa: B018  (validates shard)

    @property
    def worker(self) -> tuple[int, int]:
        try:
            i, n = (int(x) for x in self.shard.split("/"))
        except ValueError:
            raise ValueError(f"harvest.shard={self.shard!r}: expected i/n, e.g. 0/4") from None
        if not 0 <= i < n:
            raise ValueError(f"harvest.shard={self.shard!r}: need 0 <= i < n")
        return i, n


_PRECISIONS = ("fp32", "bf16", "auto")
_WANDB_MODES = ("offline", "online", "disabled")


LR_SCHEDULES = ("cosine", "linear", "constant")
"""What ``train.lr_schedule`` may name (see :func:`eagle3.optim.warmup_decay`)."""


@dataclass
class TrainConfig:
    """The trainer (eagle3.train): an EAGLE-3 draft head on a harvest store, with DeepSpeed."""

    store: str = ""
    """Training harvest store (a folder with manifest.json), checked against the target."""
    out_dir: str = ""
    """checkpoints/, best/ and final/ exported drafts, draft_vocab.safetensors, metrics.jsonl, wandb/."""
    extra_stores: list[str] = field(default_factory=list)
    """More stores of the same target and layers, trained on with ``store`` as one (e.g. what
    mining rounds appended); the held-out split by sample id covers them too."""
    sample_weights: str | None = None
    """A JSON file ``{sample_id: weight}``: each epoch a sample is seen floor(w) times, plus once
    with probability frac(w) (drawn per seed, epoch and id); unlisted samples weigh 1. Mining's
    oversampling of weak domains."""
    eval_store: str | None = None
    """Held-out harvest store for evaluation (None: hold out ``eval_fraction`` of ``store``)."""
    eval_fraction: float = 0.0
    """Without ``eval_store``: the share of the store's samples held out for eval, chosen by a
    hash of each sample id (the same split in every run); 0 means no eval."""
    steps: int = 1000
    """Optimizer steps; the data repeats in epochs, reshuffled per epoch."""
    micro_batch_tokens: int = 2048
    """Tokens per micro-batch per rank: one packed row, or one padded bucket."""
    batching: str = "pack"
    """pack: documents concatenated into rows of ``micro_batch_tokens`` (attention never crosses
    a document); buckets: similar lengths padded together."""
    gradient_accumulation: int = 1
    """Micro-batches per rank per optimizer step; the global batch is world_size times this."""
    optimizer: str = "adamw"
    """adamw; or muon: Muon (orthogonalised momentum, DeepSpeed's) on the draft's hidden 2-D
    matrices (fc, attention, MLP) and AdamW on the rest (lm_head, norms), as speculators does."""
    lr: float = 1e-4
    """Peak learning rate (AdamW; with ``optimizer=muon`` each Muon matrix's step is scaled to
    the RMS an AdamW step of this lr would have, 0.2 * lr, so one lr serves both halves)."""
    muon_momentum: float = 0.95
    """Momentum of the Muon half (DeepSpeed's Muon)."""
    muon_ns_method: str = "auto"
    """Newton-Schulz variant of DeepSpeed's Muon: gram (fp16 Gram iteration, DeepSpeed's default,
    the faster one on GPUs), standard (the original bf16 iteration), or auto: gram on CUDA,
    standard elsewhere (on this project's CPUs standard runs the step's 8 matrices 3.7x faster,
    same spectrum after 5 steps)."""
    lr_schedule: str = "cosine"
    """After warmup: cosine or linear decay to lr * min_lr_ratio at the last step (speculators'
    default is linear), or constant."""
    min_lr_ratio: float = 0.0
    """Where the decay ends, as a share of lr."""
    warmup_steps: int = 50
    """Linear warmup from lr / warmup_steps to lr."""
    weight_decay: float = 0.0
    """Decoupled weight decay on every trained parameter (AdamW's; with Muon, both halves)."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay."""
    adam_beta2: float = 0.95
    """AdamW's second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW's denominator epsilon."""
    max_grad_norm: float = 0.5
    """Gradient clipping by global norm; 0 disables it. Not applied to Muon runs under DeepSpeed's
    ZeRO optimizer (zero_stage >= 1, except bf16 at stage 1), which would clip Muon's
    orthogonalised updates instead of the gradients (see ``unclip_muon_updates_under_zero``)."""
    precision: str = "fp32"
    """fp32, bf16 (DeepSpeed keeps fp32 master weights), or auto: bf16 where bf16 matmuls are the
    faster ones (CUDA; a CPU with bf16 units, measured at start) and the optimizer allows it
    (Muon on bf16 needs zero_stage >= 1), else fp32."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3."""
    ttt_steps: int = 7
    """Training-time-test steps K unrolled per position."""
    step_decay: float = 0.8
    """Loss weight of TTT step k is step_decay**k (1.0 weighs the steps equally)."""
    loss_on_oov: bool = False
    """Also train positions whose target argmax lies outside the draft vocab, on the target's
    distribution renormalised over the draft vocab (as speculators 0.9.0); by default they are
    dropped (as EAGLE-3 and SpecForge): the draft cannot propose that token anyway."""
    gate_steps: bool = False
    """TTT step k >= 1 trains a position only where steps 0..k-1 there matched the target's argmax
    (where greedy verification reaches step k; GRIFFIN's token-alignment mask); the step's loss still
    averages over all its positions, so broken chains add nothing. The train and eval loss figures
    are the gated ones; matches, accuracies and tau_sim are unchanged."""
    loss_positions: str = "assistant"
    """assistant: train on the positions the store's loss mask marks (the replies, as EAGLE-3,
    SpecForge and speculators); all: on every position of each conversation (prompts and template
    tokens too: the store holds the target's distribution everywhere, so the same samples teach
    more). Evaluation always counts the replies only."""
    draft_vocab_size: int = 32000
    """Target tokens the draft can propose: the most frequent loss-masked tokens of the training
    store (capped at the target's vocabulary)."""
    draft_vocab: str | None = None
    """Reuse a draft vocab instead (a draft_vocab.safetensors of another run, or an exported
    draft folder): across runs and mining rounds."""
    init_draft: str | None = None
    """Continue training this draft (a folder in any format :func:`eagle3.export.load_draft` reads:
    ours, vLLM/EAGLE/SpecForge, speculators, SGLang): its shape, weights and draft vocab replace
    the draft-shape fields, ``draft_vocab*`` and ``lm_head_init``. Its aux layer ids must be the
    store's."""
    num_layers: int = 1
    """Decoder layers of the draft."""
    draft_intermediate_size: int | None = None
    """SwiGLU width of the draft's MLP (None: the target's ``intermediate_size``)."""
    draft_num_attention_heads: int | None = None
    """Query heads of the draft's attention (None: the target's)."""
    draft_num_key_value_heads: int | None = None
    """Key/value heads of the draft's attention (None: the target's)."""
    draft_head_dim: int | None = None
    """Head size of the draft's attention (None: the target's ``head_dim``, else hidden / heads)."""
    draft_variant: str = "eagle3"
    """eagle3: the layer of the EAGLE-3 paper (no extra norms); speculators: speculators 0.9.0's
    variant (``norm_before_residual``, ``norm_before_fc`` and ``norm_output``), for comparisons."""
    draft_rope: str = "target"
    """target: the target's RoPE theta and scaling (plain, linear, llama3 or yarn; anything else,
    e.g. Phi-3's longrope, fails naming this key); plain: the target's theta without scaling."""
    lm_head_init: str = "random"
    """random: fresh init (as EAGLE/SpecForge; learnt faster in short CPU runs); target: lm_head rows
    (and the final norm) copied from the target's (as speculators)."""
    target_temperature: float = 1.0
    """The distribution the draft learns from is the target's softmax(logits / T) over the draft
    vocab: T < 1 sharpens it towards the target's argmax (what greedy verification accepts), T > 1
    flattens it. The argmax, tau_sim and which positions count do not change; the loss figures
    (train and eval) are against the tempered distribution."""
    feature_noise: float = 0.0
    """Training only: Gaussian noise on every aux state the draft reads, its std this fraction of
    the state's RMS at that position (a regulariser, as EAGLE-1's noise on the target's features;
    evaluation reads the states as stored). 0: off."""
    layer_init: str = "random"
    """random: fresh init; readout: ``fc`` passes the deepest aux state through and the decoder
    layers' output projections start at zero, so the untrained draft reads the target's state at
    that depth (with ``lm_head_init=target``: the target's logit lens there), as Medusa starts its
    heads from the target's prediction. Needs the draft's hidden size equal to the target's."""
    freeze_lm_head: bool = False
    """Keep lm_head fixed during training (speculators 0.9.0 freezes its target-initialised one): with
    ``lm_head_init=target`` the draft must produce states in the target's own output space."""
    gradient_checkpointing: bool = False
    """Recompute each TTT step in backward: less memory, ~1/3 more compute."""
    eval_every: int = 100
    """Evaluate every N optimizer steps (0: only at the end); the best eval tau_sim is exported."""
    eval_at_start: bool = True
    """Also evaluate the untrained draft, before step 1."""
    save_every: int = 100
    """Checkpoint every N optimizer steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Older checkpoints are deleted; the latest complete one is always kept."""
    resume: bool = True
    """Continue from ``out_dir/checkpoints/latest`` when it exists (the data, model and sharding
    settings must match: a mismatch fails naming the key); False starts over, deleting the
    out_dir's old checkpoints and exports."""
    log_every: int = 1
    """Write metrics every N optimizer steps."""
    seed: int = 0
    """Draft init and data order."""
    device: str = "auto"
    """auto (cuda:LOCAL_RANK if CUDA is available, else cpu), cpu or cuda."""
    threads: int = 1
    """torch intra-op threads per process on CPU."""
    wandb_mode: str = "offline"
    """offline (synced later with ``wandb sync``), online, or disabled."""
    wandb_project: str = "eagle3"
    """The wandb project the run is logged under."""
    wandb_run_name: str | None = None
    """None: the name of ``out_dir``."""
    progress: bool = True
    """A tqdm progress bar on rank 0."""

    def draft_overrides(self) -> dict[str, Any]:
        """The draft-shape fields set here, as :meth:`eagle3.draft.DraftConfig.from_target_config` overrides."""
        out: dict[str, Any] = {"num_layers": self.num_layers}
        for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, "draft_" + name) is not None:
                out[name] = getattr(self, "draft_" + name)
        if self.draft_rope == "plain":
            out["rope_scaling"] = None
        if self.draft_variant == "speculators":
            out.update(norm_before_residual=True, norm_before_fc=True, norm_output=True)
        return out

    def __post_init__(self) -> None:
        positive = ("steps", "micro_batch_tokens", "gradient_accumulation", "ttt_steps", "draft_vocab_size",
                    "num_layers", "keep_checkpoints", "log_every", "threads")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)}: must be >= 1")
        for name in ("warmup_steps", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}={getattr(self, name)}: must be >= 0")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"train.eval_fraction={self.eval_fraction}: must be in [0, 1)")
        if self.eval_store is not None and self.eval_fraction > 0:
            raise ValueError(f"train.eval_fraction={self.eval_fraction}: set it or eval_store, not both")
        if self.lr <= 0:
            raise ValueError(f"train.lr={self.lr}: must be > 0")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"train.optimizer={self.optimizer!r}: expected adamw or muon")
        if self.optimizer == "muon" and self.precision == "bf16" and self.zero_stage == 0:
            raise ValueError("train.optimizer=muon with precision=bf16 needs train.zero_stage >= 1 (DeepSpeed runs "
                             "Muon on bf16 weights only through its ZeRO optimizers; stage 1 costs nothing extra on "
                             "one rank)")
        if self.muon_ns_method not in ("auto", "gram", "standard"):
            raise ValueError(f"train.muon_ns_method={self.muon_ns_method!r}: expected auto, gram or standard")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"train.muon_momentum={self.muon_momentum}: must be in [0, 1)")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"train.lr_schedule={self.lr_schedule!r}: expected one of {', '.join(LR_SCHEDULES)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        for name in ("weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}={getattr(self, name)}: must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"train.{name}={getattr(self, name)}: must be in [0, 1)")
        if self.adam_eps <= 0:
            raise ValueError(f"train.adam_eps={self.adam_eps}: must be > 0")
        if self.feature_noise < 0:
            raise ValueError(f"train.feature_noise={self.feature_noise}: must be >= 0")
        if not self.target_temperature > 0:
            raise ValueError(f"train.target_temperature={self.target_temperature}: must be > 0")
        if not 0.0 < self.step_decay <= 1.0:
            raise ValueError(f"train.step_decay={self.step_decay}: must be in (0, 1]")
        if self.batching not in ("pack", "buckets"):
            raise ValueError(f"train.batching={self.batching!r}: expected pack or buckets")
        if self.precision not in _PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r}: expected one of {', '.join(_PRECISIONS)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"train.zero_stage={self.zero_stage}: expected 0, 1, 2 or 3")
        for name in ("draft_intermediate_size", "draft_num_attention_heads", "draft_num_key_value_heads",
                     "draft_head_dim"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)}: must be >= 1 (or null)")
        if self.draft_variant not in ("eagle3", "speculators"):
            raise ValueError(f"train.draft_variant={self.draft_variant!r}: expected eagle3 or speculators")
        if self.draft_rope not in ("target", "plain"):
            raise ValueError(f"train.draft_rope={self.draft_rope!r}: expected target or plain")
        if self.loss_positions not in ("assistant", "all"):
            raise ValueError(f"train.loss_positions={self.loss_positions!r}: expected assistant or all")
        if self.lm_head_init not in ("target", "random"):
            raise ValueError(f"train.lm_head_init={self.lm_head_init!r}: expected target or random")
        if self.layer_init not in ("random", "readout"):
            raise ValueError(f"train.layer_init={self.layer_init!r}: expected random or readout")
        if self.freeze_lm_head and self.lm_head_init != "target" and not self.init_draft:
            raise ValueError("train.freeze_lm_head=true needs train.lm_head_init=target (or an init_draft): a frozen "
                             "random lm_head cannot be learnt around")
        if self.wandb_mode not in _WANDB_MODES:
            raise ValueError(f"train.wandb_mode={self.wandb_mode!r}: expected one of {', '.join(_WANDB_MODES)}")
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"train.device={self.device!r}: expected auto, cpu or cuda")


MINE_STRATEGIES = ("reweight", "hardest", "synthesize", "uniform")


@dataclass
class MineConfig:
    """Hard-example mining rounds (hard_mining): score -> mine -> harvest -> continue training."""

    draft: str = ""
    """The draft of round 0 (a trained draft folder)."""
    store: str = ""
    """Its training store; rounds append stores next to it (``train.extra_stores``)."""
    records: list[str] = field(default_factory=list)
    """Regenerated conversations behind ``store`` (their ids, domains and languages)."""
    eval_store: str = ""
    """Held-out store scored before and after each round."""
    eval_records: list[str] = field(default_factory=list)
    pool: str = ""
    """Not-yet-harvested prompts to mine candidates from (a pool JSONL)."""
    eval_sets: str = ""
    """Folder of eval-set JSONL files new prompts are deduplicated against (e.g. runs/pools/eval)."""
    out_dir: str = ""
    rounds: int = 1
    strategies: list[str] = field(default_factory=lambda: ["reweight", "hardest", "synthesize"])
    """Any of reweight, hardest, synthesize; or uniform (random pool prompts, the ablation's control)."""
    candidates: int = 64
    """hardest: pool prompts scored cheaply per round (balanced over domains)."""
    candidate_tokens: int = 48
    """hardest: new tokens regenerated per candidate for its cheap score."""
    keep_fraction: float = 0.25
    """hardest: the share of candidates kept (by loss, within each domain)."""
    hard_examples: int = 8
    """synthesize: the hardest training samples whose prompts get variations."""
    variations: int = 1
    variation_tokens: int = 96
    """synthesize: new tokens the target may spend writing one variation (a question, not an answer)."""
    procedural: int = 4
    """synthesize: procedural math and code prompts each per round."""
    uniform: int = 16
    """uniform: random pool prompts per round."""
    weight_power: float = 4.0
    """reweight: domain weight (tau_best / tau_domain) ** power, clipped to [0.25, 4]."""
    steps: int = 60
    """Training steps per round (continuing from the previous round's draft, vocab frozen)."""
    lr: float | None = None
    """Peak learning rate of each round's training; None: a quarter of train.lr. The draft a round
    starts from has decayed its rate already: in the quickstart, 40 more steps on the same data
    re-warmed to the full train.lr raised the held-out loss (21.38 -> 22.04), at a quarter they
    lowered it (21.22)."""
    max_new_tokens: int = 160
    """Regeneration length of the mined prompts."""
    seed: int = 0
    wandb_mode: str = "offline"
    wandb_project: str = "eagle3"

    def __post_init__(self) -> None:
        bad = [s for s in self.strategies if s not in MINE_STRATEGIES]
        if bad or not self.strategies:
            raise ValueError(f"mine.strategies={self.strategies}: expected some of {', '.join(MINE_STRATEGIES)}")
        for name in ("rounds", "steps", "max_new_tokens", "candidate_tokens", "variation_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"mine.{name}={getattr(self, name)}: must be >= 1")
        for name in ("candidates", "hard_examples", "variations", "procedural", "uniform"):
            if getattr(self, name) < 0:
                raise ValueError(f"mine.{name}={getattr(self, name)}: must be >= 0")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"mine.lr={self.lr}: must be > 0 (or null: a quarter of train.lr)")
        if not 0.0 < self.keep_fraction <= 1.0:
            raise ValueError(f"mine.keep_fraction={self.keep_fraction}: must be in (0, 1]")
        if self.wandb_mode not in _WANDB_MODES:
            raise ValueError(f"mine.wandb_mode={self.wandb_mode!r}: expected one of {', '.join(_WANDB_MODES)}")


@dataclass
class EvalConfig:
    """The serving evaluation (serve_eval): the bundled loop, speculative vs plain, on the eval sets."""

    draft: str | None = None
    """Draft folder; None: the last mining round's draft, else the training run's final one."""
    sets: list[str] = field(default_factory=lambda: ["mtbench", "humaneval", "gsm8k", "multilingual"])
    per_set: int = 10
    max_new_tokens: int = 96
    mode: str = "chain"
    k: int = 3
    topk: int = 4
    budget: int = 16
    temperature: float = 0.0
    out_dir: str = ""
    wandb_mode: str = "offline"

    def __post_init__(self) -> None:
        if self.mode not in ("chain", "tree"):
            raise ValueError(f"eval.mode={self.mode!r}: expected chain or tree")
        for name in ("per_set", "max_new_tokens", "k", "topk", "budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name}={getattr(self, name)}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"eval.temperature={self.temperature}: must be >= 0")
        if self.wandb_mode not in _WANDB_MODES:
            raise ValueError(f"eval.wandb_mode={self.wandb_mode!r}: expected one of {', '.join(_WANDB_MODES)}")


@dataclass
class QuantizeConfig:
    """The ``quantize`` stage: convert the target to NVFP4 (as Blackwell serves it) and run every later
    stage (regeneration, harvest, training, mining, evaluation) on the converted target, emulated."""

    mode: str = "w4a4"
    """w4a4 (weights and activations FP4, activation scales calibrated) or w4a16 (weights only)."""
    calibration: str = ""
    """Pool jsonl whose conversations calibrate; empty: the pools stage's train pool."""
    samples: int = 64
    max_tokens: int = 512
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    out_dir: str = ""
    """The converted checkpoint; empty: ``<out_dir>/nvfp4-target``."""

    def __post_init__(self) -> None:
        if self.mode not in ("w4a4", "w4a16"):
            raise ValueError(f"quantize.mode={self.mode!r}: expected w4a4 or w4a16")
        for name in ("samples", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"quantize.{name}={getattr(self, name)}: must be >= 1")


@dataclass
class LauncherConfig:
    """Where the pipeline runs: in this process (``none``), or as submitit jobs (recipes/launch.py)."""

    kind: str = "none"
    """none, local (submitit processes here, the groups one after the other) or slurm."""
    folder: str = "runs/submitit"
    """Job logs and pickles; each submission gets a fresh sub-folder."""
    partition: str | None = None
    timeout_min: int = 240
    cpus_per_task: int = 2
    mem_gb: int | None = None
    gpus_per_node: int = 0
    nodes: int = 1
    """The training job's nodes ..."""
    tasks_per_node: int = 1
    """... and ranks per node (one per GPU on GPU nodes)."""
    harvest_shards: int = 1
    """The harvest array's tasks (``harvest.shard`` i/n each)."""
    additional: dict[str, str] = field(default_factory=dict)
    """Extra sbatch options (account, qos, constraint, ...)."""

    def __post_init__(self) -> None:
        if self.kind not in ("none", "local", "slurm"):
            raise ValueError(f"launcher.kind={self.kind!r}: expected none, local or slurm")
        for name in ("timeout_min", "cpus_per_task", "nodes", "tasks_per_node", "harvest_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"launcher.{name}={getattr(self, name)}: must be >= 1")


@dataclass
class PipelineConfig:
    """One run of the pipeline: every stage reads its part of this tree."""

    target: TargetConfig = field(default_factory=TargetConfig)
    pools: PoolsConfig = field(default_factory=PoolsConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    harvest: HarvestConfig = field(default_factory=HarvestConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    val: SelectConfig = field(default_factory=lambda: SelectConfig(num_prompts=24, split="val"))
    """The held-out prompts the ``val`` stage regenerates and harvests (mining scores on them)."""
    mine: MineConfig = field(default_factory=MineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    """Used when ``stages`` has ``quantize``: every stage after it runs on the NVFP4 target."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    out_dir: str = "runs/quickstart"
    """Where every stage writes its outputs."""
    stages: list[str] = field(default_factory=lambda: ["target", "pools", "regenerate", "harvest", "val", "train",
                                                       "mine", "eval", "report"])
    """Stages to run, in order."""
    threads: int = 1
    """torch intra-op threads on CPU; 1 was fastest on a loaded 2-core machine."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads={self.threads}: must be >= 1")
