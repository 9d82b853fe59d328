"""The trainer's settings (:class:`TrainConfig`) and the draft recipes that set them
(``recipes/draft/<name>.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from eagle3.draft.losses import LOSSES
from eagle3.errors import ConfigError

WANDB_MODES = ("offline", "online", "disabled")
DRAFT_RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "draft"
"""The draft recipes (``recipes/draft/<name>.yaml``): ``train`` settings the pipeline's ``draft=<name>`` picks."""

_PRECISIONS = ("fp32", "bf16", "auto")
LR_SCHEDULES = ("cosine", "linear", "constant")
"""What ``train.lr_schedule`` may name (see :func:`eagle3.train.optim.warmup_decay`)."""
HARD_TOKENS = ("keep", "downweight", "phase_in")
"""What ``train.hard_tokens`` may name."""


@dataclass
class TrainConfig:
    """The trainer (eagle3.train.loop): an EAGLE-3 draft head on a harvest store, with DeepSpeed."""

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
    data: str = "offline"
    """offline: train.store is a harvest store; online: train.store is a spool that producers
    (python -m data_gen.produce, same seed) fill while this run trains, a window of shards at a
    time (needs shard_window >= 1 and eval_fraction 0: held-out data comes from eval_store);
    hybrid: online for the first epoch (producers with --max-epochs 1), whose shards are kept as a
    harvest store in the spool's folder that later epochs (and mining) read offline; colocated:
    train.store is a plan without states (python -m data_gen.produce --max-epochs 0) and this
    run's own target computes each micro-batch's states (targets that fit beside the draft)."""
    spool_wait_s: float = 600.0
    """online/hybrid: how long the trainer waits for a shard (or the first producer) before it stops."""
    producer_stale_s: float = 120.0
    """online/hybrid: a producer on another host whose heartbeat is older than this counts as lost
    (on the trainer's own host a producer's pid tells at once)."""
    producer_grace_s: float = 30.0
    """online/hybrid: how long the trainer waits, after naming a lost producer in its log, for a
    restarted one (on any host) before it stops; a producer restarted meanwhile carries on the run."""
    collective_timeout_s: float = 600.0
    """How long the rendezvous and each collective wait for the other ranks: a rank on a lost node
    that never answers fails the job after this (a killed process's closed connection, at once)."""
    shard_window: int = 0
    """Sample order: 0 shuffles the whole training set each epoch; N > 0 shuffles the store's
    shards and batches N consecutive shards at a time (each shard needed only while its window
    trains: the order online training reads its spool in)."""
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
    context_parallel: int = 1
    """Ranks that share one row (context parallelism, :mod:`eagle3.draft.context`): each holds its share
    of the row's states, activations and logits (ranges of equal work), and all of its step-0 keys. It
    divides the world size; the data-parallel ranks are world / n. Offline data; EAGLE-3 and P-EAGLE drafts."""
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
    loss: str = "soft_ce"
    """What each TTT step trains the draft's distribution q against the target's p on
    (eagle3.draft.losses): soft_ce (-sum p log q, EAGLE-3's); tv (1 - alpha, alpha = sum min(p, q) the
    acceptance probability of speculative sampling); nla (-log alpha); lk_hybrid (lambda KL(p||q) +
    (1 - lambda)(1 - alpha), lambda = exp(-lk_eta alpha)): the LK losses, arXiv 2602.23881. The
    served draft is the same whichever is used."""
    lk_eta: float = 3.0
    """loss=lk_hybrid: how fast the KL term hands over to the acceptance term as alpha grows."""
    hard_tokens: str = "keep"
    """Positions the draft may not be able to fit, by the entropy of the target's distribution (over the
    draft vocab) at the predicted token: keep (every position weighs 1); downweight (those above
    ``hard_token_entropy`` weigh ``hard_token_weight`` in the loss, 0 leaving them out); phase_in (that
    weight rises linearly to 1 at the last step: easy tokens first, hard ones later). Matches and
    tau_sim count every position either way (eagle3.train.token_weights)."""
    hard_token_entropy: float = 2.0
    """hard_tokens: the entropy (nats) above which a position is hard."""
    hard_token_weight: float = 0.0
    """hard_tokens: the loss weight of a hard position (phase_in: at the first step)."""
    token_weights: str | None = None
    """A JSON file ``{sample_id: [[token index, weight], ...]}``: the loss weight of predicting those
    tokens of the sample (every TTT step whose target is that token); unlisted tokens weigh 1. Mining's
    error replay: the tokens the draft failed to propose, weighted up. The loss is a weighted mean."""
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
    variant (``norm_before_residual``, ``norm_before_fc`` and ``norm_output``), for comparisons;
    eagle3.1: EAGLE-3.1's (arXiv 2605.09992: ``fc_norm``, one norm per aux state before ``fc``, and
    ``norm_output``, the post-norm state fed to the next step; vLLM serves it as EAGLE-3)."""
    draft_family: str = "eagle3"
    """eagle3: each draft step reads the previous one (a chain or a tree, one forward per token);
    peagle: P-EAGLE, parallel drafting (the steps after the first read a mask token and a learned
    mask state instead, so one forward proposes them all; vLLM serves it as eagle3 with
    ``parallel_drafting``). An ``init_draft`` of the eagle3 family becomes a P-EAGLE draft with a
    fresh mask state. dflash: DFlash (:mod:`eagle3.draft.families.dflash`), Qwen3-style layers that read the aux
    states as keys and propose a block of ``ttt_steps`` tokens in one non-causal forward (vLLM
    ``method=dflash``); ``num_layers`` sets its depth, ``draft_variant`` and ``layer_init`` do not apply."""
    mask_token_id: int | None = None
    """peagle, dflash: the token fed at each mask position (its frozen embedding; the learned mask state
    carries the rest). None: the tokenizer's mask token, a vocabulary row no token uses, its pad or
    unknown token when that is not the end-of-text token, else the last id (SmolLM2: 0)."""
    draft_sliding_window: int | None = None
    """Set: the draft's layers attend to the last N positions only (:class:`eagle3.draft.model.DraftConfig`
    ``sliding_window``; exported as ``sliding_window`` and ``layer_types``, which vLLM honours). Must
    exceed ``ttt_steps`` and be shorter than the store's longest row (else it never acts in training)."""
    draft_full_attention_layers: list[int] = field(default_factory=list)
    """With ``draft_sliding_window``: draft layers (0-based) that keep full attention."""
    draft_rope: str = "target"
    """target: the target's RoPE theta and scaling (plain, linear, llama3 or yarn; anything else,
    e.g. Phi-3's longrope, fails naming this key); plain: the target's theta without scaling."""
    lm_head_init: str = "random"
    """random: fresh init (as EAGLE/SpecForge; learnt faster in short CPU runs); target: lm_head rows
    (and the final norm) copied from the target's (as speculators)."""
    head_scale_init: str = "one"
    """With ``lm_head_init=target``, at a fresh start: fit: the copied rows times the factor in [2^-16, 1]
    (half-octave steps) whose untrained draft has the lowest loss on the run's first micro-batch
    (:func:`eagle3.train.start.fit_start`; the factor is in the run's summary); one: as copied; auto: fit
    when the untrained draft's logits spread more than ``start.SHARP`` times the target's, else one."""
    aux_scale_init: str = "none"
    """At a fresh start: unit: every channel of what ``fc`` reads starts at unit RMS over the first
    micro-batch's tokens (the factor goes in the norm before ``fc``, else in ``fc``'s columns;
    :meth:`eagle3.draft.model.DraftHead.scale_aux_inputs`); none: as built; auto: unit where
    ``head_scale_init=auto`` would fit (a copied head far sharper than the target's), else none."""
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
    phase_times: bool = False
    """Log where each step's time goes (``time/<phase>_ms``: load, forward, backward, optimizer,
    metrics), each phase closed by a device sync: the syncs take away the overlap they measure, so
    the run's tokens/s is then not its speed."""

    def draft_overrides(self, mask_token_id: int | None = None) -> dict[str, Any]:
        """The draft-shape fields set here, as :meth:`eagle3.draft.model.DraftConfig.from_target_config` overrides:
        the common shape, then the family's own fields (``mask_token_id``: the one chosen for it)."""
        from eagle3.draft.families import get_family  # the families build on these settings

        out: dict[str, Any] = {"num_layers": self.num_layers}
        for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, "draft_" + name) is not None:
                out[name] = getattr(self, "draft_" + name)
        if self.draft_rope == "plain":
            out["rope_scaling"] = None
        if self.draft_sliding_window is not None:
            out |= {"sliding_window": self.draft_sliding_window,
                    "full_attention_layers": list(self.draft_full_attention_layers)}
        return {**out, **get_family(self.draft_family).config_fields(mask_token_id, self)}

    def __post_init__(self) -> None:
        positive = ("steps", "micro_batch_tokens", "gradient_accumulation", "ttt_steps", "draft_vocab_size",
                    "num_layers", "keep_checkpoints", "log_every", "threads")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)}: must be >= 1")
        for name in ("warmup_steps", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)}: must be >= 0")
        self._check_data()
        for name in ("spool_wait_s", "producer_grace_s"):  # 0: do not wait
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)}: must be >= 0 (seconds)")
        for name in ("producer_stale_s", "collective_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name}={getattr(self, name)}: must be > 0 (seconds)")
        if self.lr <= 0:
            raise ConfigError(f"train.lr={self.lr}: must be > 0")
        if self.optimizer not in ("adamw", "muon"):
            raise ConfigError(f"train.optimizer={self.optimizer!r}: expected adamw or muon")
        if self.optimizer == "muon" and self.precision == "bf16" and self.zero_stage == 0:
            raise ConfigError("train.optimizer=muon with precision=bf16 needs train.zero_stage >= 1 (DeepSpeed runs "
                              "Muon on bf16 weights only through its ZeRO optimizers; stage 1 costs nothing extra on "
                              "one rank)")
        if self.muon_ns_method not in ("auto", "gram", "standard"):
            raise ConfigError(f"train.muon_ns_method={self.muon_ns_method!r}: expected auto, gram or standard")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"train.muon_momentum={self.muon_momentum}: must be in [0, 1)")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"train.lr_schedule={self.lr_schedule!r}: expected one of {', '.join(LR_SCHEDULES)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        for name in ("weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)}: must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"train.{name}={getattr(self, name)}: must be in [0, 1)")
        if self.adam_eps <= 0:
            raise ConfigError(f"train.adam_eps={self.adam_eps}: must be > 0")
        if self.feature_noise < 0:
            raise ConfigError(f"train.feature_noise={self.feature_noise}: must be >= 0")
        if not self.target_temperature > 0:
            raise ConfigError(f"train.target_temperature={self.target_temperature}: must be > 0")
        if not 0.0 < self.step_decay <= 1.0:
            raise ConfigError(f"train.step_decay={self.step_decay}: must be in (0, 1]")
        if self.loss not in LOSSES:
            raise ConfigError(f"train.loss={self.loss!r}: expected one of {', '.join(LOSSES)}")
        if self.hard_tokens not in HARD_TOKENS:
            raise ConfigError(f"train.hard_tokens={self.hard_tokens!r}: expected one of {', '.join(HARD_TOKENS)}")
        if not self.hard_token_entropy > 0:
            raise ConfigError(f"train.hard_token_entropy={self.hard_token_entropy}: must be > 0 (nats)")
        if self.token_weights and self.data != "offline":
            raise ConfigError(f"train.token_weights={self.token_weights}: names samples of a harvest store; "
                              f"train.data={self.data} streams them (train offline)")
        if not 0.0 <= self.hard_token_weight <= 1.0:
            raise ConfigError(f"train.hard_token_weight={self.hard_token_weight}: must be in [0, 1]")
        if not self.lk_eta > 0:
            raise ConfigError(f"train.lk_eta={self.lk_eta}: must be > 0")
        if self.precision not in _PRECISIONS:
            raise ConfigError(f"train.precision={self.precision!r}: expected one of {', '.join(_PRECISIONS)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"train.zero_stage={self.zero_stage}: expected 0, 1, 2 or 3")
        self._check_draft()
        if self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"train.wandb_mode={self.wandb_mode!r}: expected one of {', '.join(WANDB_MODES)}")
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"train.device={self.device!r}: expected auto, cpu or cuda")


    def _check_data(self) -> None:
        """Where the samples come from and how they are batched."""
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"train.eval_fraction={self.eval_fraction}: must be in [0, 1)")
        if self.eval_store is not None and self.eval_fraction > 0:
            raise ConfigError(f"train.eval_fraction={self.eval_fraction}: set it or eval_store, not both")
        if self.data not in ("offline", "online", "hybrid", "colocated"):
            raise ConfigError(f"train.data={self.data!r}: expected offline, online, hybrid or colocated")
        if self.data == "colocated" and self.extra_stores:
            raise ConfigError("train.data=colocated computes the states of train.store's plan: no train.extra_stores")
        if self.data in ("online", "hybrid") and (self.shard_window < 1 or self.eval_fraction > 0 or self.extra_stores):
            raise ConfigError(f"train.data={self.data} reads its spool a window of shards at a time: it needs "
                              "train.shard_window >= 1, train.eval_fraction=0 (held-out data: train.eval_store) and "
                              "no train.extra_stores")
        if self.context_parallel < 1 or (self.context_parallel > 1 and self.data != "offline"):
            raise ConfigError(f"train.context_parallel={self.context_parallel}: must be >= 1, and 1 unless "
                              f"train.data=offline (not {self.data})")
        if self.shard_window < 0:
            raise ConfigError(f"train.shard_window={self.shard_window}: must be >= 0 (0: the whole set shuffled)")
        if self.batching not in ("pack", "buckets"):
            raise ConfigError(f"train.batching={self.batching!r}: expected pack or buckets")

    def _check_draft(self) -> None:
        """The draft's shape, family, attention and start."""
        for name in ("draft_intermediate_size", "draft_num_attention_heads", "draft_num_key_value_heads",
                     "draft_head_dim"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)}: must be >= 1 (or null)")
        if self.draft_variant not in ("eagle3", "speculators", "eagle3.1"):
            raise ConfigError(f"train.draft_variant={self.draft_variant!r}: expected eagle3, speculators or eagle3.1")
        from eagle3.draft.families import get_family  # the families build on these settings

        get_family(self.draft_family, "train.draft_family").check_train(self)
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ConfigError(f"train.mask_token_id={self.mask_token_id}: must be a token id (>= 0)")
        if self.draft_sliding_window is not None and self.draft_sliding_window <= self.ttt_steps:
            raise ConfigError(f"train.draft_sliding_window={self.draft_sliding_window}: must exceed train.ttt_steps="
                              f"{self.ttt_steps} (a draft step's query sits that many positions past its row)")
        if self.draft_full_attention_layers and self.draft_sliding_window is None:
            raise ConfigError(f"train.draft_full_attention_layers={list(self.draft_full_attention_layers)}: set "
                              "train.draft_sliding_window too (without it every layer attends in full)")
        bad = [i for i in self.draft_full_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"train.draft_full_attention_layers: {bad} not among the draft's layers "
                              f"0..{self.num_layers - 1} (train.num_layers={self.num_layers})")
        if self.draft_rope not in ("target", "plain"):
            raise ConfigError(f"train.draft_rope={self.draft_rope!r}: expected target or plain")
        if self.loss_positions not in ("assistant", "all"):
            raise ConfigError(f"train.loss_positions={self.loss_positions!r}: expected assistant or all")
        if self.lm_head_init not in ("target", "random"):
            raise ConfigError(f"train.lm_head_init={self.lm_head_init!r}: expected target or random")
        if self.head_scale_init not in ("auto", "fit", "one"):
            raise ConfigError(f"train.head_scale_init={self.head_scale_init!r}: expected auto, fit or one")
        if self.aux_scale_init not in ("auto", "unit", "none"):
            raise ConfigError(f"train.aux_scale_init={self.aux_scale_init!r}: expected auto, unit or none")
        if self.layer_init not in ("random", "readout"):
            raise ConfigError(f"train.layer_init={self.layer_init!r}: expected random or readout")
        if self.freeze_lm_head and self.lm_head_init != "target" and not self.init_draft:
            raise ConfigError("train.freeze_lm_head=true needs train.lm_head_init=target (or an init_draft): a frozen "
                              "random lm_head cannot be learnt around")


def draft_recipe(name: str) -> dict[str, Any]:
    """The ``train`` settings of ``recipes/draft/<name>.yaml`` (what the pipeline's ``draft=<name>``
    sets), for the tools that train outside the pipeline; ``none``: no settings (the library's
    defaults)."""
    if name == "none":
        return {}
    from omegaconf import OmegaConf

    path = DRAFT_RECIPES / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in DRAFT_RECIPES.glob("*.yaml")))
        raise ConfigError(f"draft recipe {name!r}: no {path}; known: {known}, none")
    settings = OmegaConf.to_container(OmegaConf.load(path))
    known = {f.name for f in fields(TrainConfig)}
    for key, value in settings.items():
        if key not in known:
            raise ConfigError(f"{path}: {key!r} is not a train setting")
        if value is None or isinstance(value, list | dict):
            raise ConfigError(f"{path}: {key}={value!r}: a draft recipe sets single values")
    return settings
