"""The trainer's settings (:class:`TrainConfig`): the run itself, and one section per part of the
trainer that reads it (``data``: :class:`eagle3.store.spec.StoreSpec`, ``draft``:
:class:`eagle3.draft.spec.DraftSpec`, ``init``, ``loss``, ``optim``: :class:`eagle3.train.optim.OptimSpec`,
``log``: :class:`eagle3.train.log.LogSpec`); and the draft recipes that set them
(``recipes/draft/<name>.yaml``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, make_dataclass
from pathlib import Path
from typing import Any

from eagle3.draft.families import family_names, get_family
from eagle3.draft.families.base import load_plugins
from eagle3.draft.losses import LOSSES
from eagle3.draft.spec import DraftSpec
from eagle3.errors import ConfigError
from eagle3.store.spec import StoreSpec
from eagle3.train.log import WANDB_MODES, LogSpec
from eagle3.train.optim import LR_SCHEDULES, OptimSpec

DRAFT_RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "draft"
"""The draft recipes (``recipes/draft/<name>.yaml``): ``train`` settings the pipeline's ``draft=<name>`` picks."""

_PRECISIONS = ("fp32", "bf16", "auto")
HARD_TOKENS = ("keep", "downweight", "phase_in")
"""What ``train.loss.hard_tokens`` may name."""


@dataclass
class InitSpec:
    """Where the draft's weights start, and what stays fixed (``train.init.*``; read by
    :mod:`eagle3.train.start`)."""

    draft: str | None = None
    """Continue training this draft (a folder in any format :func:`eagle3.export.load_draft` reads:
    ours, vLLM/EAGLE/SpecForge, speculators, SGLang): its shape, weights and draft vocab replace
    ``train.draft``'s shape and vocabulary and ``lm_head``. Its aux layer ids must be the store's."""
    lm_head: str = "random"
    """random: fresh init (as EAGLE/SpecForge; learnt faster in short CPU runs); target: lm_head rows
    (and the final norm) copied from the target's (as speculators)."""
    head_scale: str = "one"
    """With ``lm_head=target``, at a fresh start: fit: the copied rows times the factor in [2^-16, 1]
    (half-octave steps) whose untrained draft has the lowest loss on the run's first micro-batch
    (:func:`eagle3.train.fit.fit_start`; the factor is in the run's summary); one: as copied; auto: fit
    when the untrained draft's logits spread more than ``fit.SHARP`` times the target's, else one."""
    aux_scale: str = "none"
    """At a fresh start: unit: every channel of what ``fc`` reads starts at unit RMS over the first
    micro-batch's tokens (the factor goes in the norm before ``fc``, else in ``fc``'s columns;
    :meth:`eagle3.draft.model.DraftHead.scale_aux_inputs`); none: as built; auto: unit where
    ``head_scale=auto`` would fit (a copied head far sharper than the target's), else none."""
    layers: str = "random"
    """random: fresh init; readout: ``fc`` passes the deepest aux state through and the decoder
    layers' output projections start at zero, so the untrained draft reads the target's state at
    that depth (with ``lm_head=target``: the target's logit lens there), as Medusa starts its
    heads from the target's prediction. Needs the draft's hidden size equal to the target's."""
    freeze_lm_head: bool = False
    """Keep lm_head fixed during training (speculators 0.9.0 freezes its target-initialised one): with
    ``lm_head=target`` the draft must produce states in the target's own output space."""

    def __post_init__(self) -> None:
        for name, allowed in (("lm_head", ("target", "random")), ("head_scale", ("auto", "fit", "one")),
                              ("aux_scale", ("auto", "unit", "none")), ("layers", ("random", "readout"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"train.init.{name}={getattr(self, name)!r}: expected {' or '.join(allowed)}")
        if self.freeze_lm_head and self.lm_head != "target" and not self.draft:
            raise ConfigError("train.init.freeze_lm_head=true needs train.init.lm_head=target (or an init.draft): a "
                              "frozen random lm_head cannot be learnt around")


@dataclass
class LossSpec:
    """What each training-time-test step is trained on, and how positions weigh (``train.loss.*``)."""

    kind: str = "soft_ce"
    """What each TTT step trains the draft's distribution q against the target's p on
    (eagle3.draft.losses): soft_ce (-sum p log q, EAGLE-3's); tv (1 - alpha, alpha = sum min(p, q) the
    acceptance probability of speculative sampling); nla (-log alpha); lk_hybrid (lambda KL(p||q) +
    (1 - lambda)(1 - alpha), lambda = exp(-lk_eta alpha)): the LK losses, arXiv 2602.23881. The
    served draft is the same whichever is used."""
    lk_eta: float = 3.0
    """kind=lk_hybrid: how fast the KL term hands over to the acceptance term as alpha grows."""
    step_decay: float = 0.8
    """Loss weight of TTT step k is step_decay**k (1.0 weighs the steps equally)."""
    positions: str = "assistant"
    """assistant: train on the positions the store's loss mask marks (the replies, as EAGLE-3,
    SpecForge and speculators); all: on every position of each conversation (prompts and template
    tokens too: the store holds the target's distribution everywhere, so the same samples teach
    more). Evaluation always counts the replies only."""
    on_oov: bool = False
    """Also train positions whose target argmax lies outside the draft vocab, on the target's
    distribution renormalised over the draft vocab (as speculators 0.9.0); by default they are
    dropped (as EAGLE-3 and SpecForge): the draft cannot propose that token anyway."""
    gate_steps: bool = False
    """TTT step k >= 1 trains a position only where steps 0..k-1 there matched the target's argmax
    (where greedy verification reaches step k; GRIFFIN's token-alignment mask); the step's loss still
    averages over all its positions, so broken chains add nothing. The train and eval loss figures
    are the gated ones; matches, accuracies and tau_sim are unchanged."""
    target_temperature: float = 1.0
    """The distribution the draft learns from is the target's softmax(logits / T) over the draft
    vocab: T < 1 sharpens it towards the target's argmax (what greedy verification accepts), T > 1
    flattens it. The argmax, tau_sim and which positions count do not change; the loss figures
    (train and eval) are against the tempered distribution."""
    feature_noise: float = 0.0
    """Training only: Gaussian noise on every aux state the draft reads, its std this fraction of
    the state's RMS at that position (a regulariser, as EAGLE-1's noise on the target's features;
    evaluation reads the states as stored). 0: off."""
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

    def __post_init__(self) -> None:
        if self.kind not in LOSSES:
            raise ConfigError(f"train.loss.kind={self.kind!r}: expected one of {', '.join(LOSSES)}")
        if not self.lk_eta > 0:
            raise ConfigError(f"train.loss.lk_eta={self.lk_eta}: must be > 0")
        if not 0.0 < self.step_decay <= 1.0:
            raise ConfigError(f"train.loss.step_decay={self.step_decay}: must be in (0, 1]")
        if self.positions not in ("assistant", "all"):
            raise ConfigError(f"train.loss.positions={self.positions!r}: expected assistant or all")
        if not self.target_temperature > 0:
            raise ConfigError(f"train.loss.target_temperature={self.target_temperature}: must be > 0")
        if self.feature_noise < 0:
            raise ConfigError(f"train.loss.feature_noise={self.feature_noise}: must be >= 0")
        if self.hard_tokens not in HARD_TOKENS:
            raise ConfigError(f"train.loss.hard_tokens={self.hard_tokens!r}: expected one of {', '.join(HARD_TOKENS)}")
        if not self.hard_token_entropy > 0:
            raise ConfigError(f"train.loss.hard_token_entropy={self.hard_token_entropy}: must be > 0 (nats)")
        if not 0.0 <= self.hard_token_weight <= 1.0:
            raise ConfigError(f"train.loss.hard_token_weight={self.hard_token_weight}: must be in [0, 1]")


@dataclass
class TrainConfig:
    """The trainer (eagle3.train.loop): an EAGLE-3 draft head on a harvest store, with DeepSpeed. The
    run's own settings here; the rest in the section of the code that reads it."""

    out_dir: str = ""
    """checkpoints/, best/ and final/ exported drafts, draft_vocab.safetensors, metrics.jsonl, wandb/."""
    steps: int = 1000
    """Optimizer steps; the data repeats in epochs, reshuffled per epoch."""
    ttt_steps: int = 7
    """Training-time-test steps K unrolled per position (the tokens a round drafts)."""
    gradient_accumulation: int = 1
    """Micro-batches per rank per optimizer step; the global batch is world_size times this."""
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
    collective_timeout_s: float = 600.0
    """How long the rendezvous and each collective wait for the other ranks: a rank on a lost node
    that never answers fails the job after this (a killed process's closed connection, at once)."""
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
    seed: int = 0
    """Draft init and data order."""
    device: str = "auto"
    """auto (cuda:LOCAL_RANK if CUDA is available, else cpu), cpu or cuda."""
    threads: int = 1
    """torch intra-op threads per process on CPU."""
    data: StoreSpec = field(default_factory=StoreSpec)
    """The training data: stores, mode, batching (:class:`eagle3.store.spec.StoreSpec`)."""
    draft: DraftSpec = field(default_factory=DraftSpec)
    """The draft's family and shape (:class:`eagle3.draft.spec.DraftSpec`)."""
    init: InitSpec = field(default_factory=InitSpec)
    """Where its weights start (:class:`InitSpec`)."""
    loss: LossSpec = field(default_factory=LossSpec)
    """What it is trained on (:class:`LossSpec`)."""
    optim: OptimSpec = field(default_factory=OptimSpec)
    """The optimizer and its schedule (:class:`eagle3.train.optim.OptimSpec`)."""
    log: LogSpec = field(default_factory=LogSpec)
    """Metrics, wandb and progress (:class:`eagle3.train.log.LogSpec`)."""

    _schema = False  # train_settings(): the schema recipes and command lines are checked against

    def __post_init__(self) -> None:
        for name, kind in SECTIONS.items():  # built from plain mappings (hydra's containers, a recipe's dict)
            value = getattr(self, name)
            if name == "draft" and isinstance(value, Mapping | DraftSpec):
                spec = draft_spec(value)  # its family's class, checked
                if not self._schema:
                    self.draft = spec
                elif isinstance(value, Mapping):
                    self.draft = _build(draft_settings(), value, "train.draft")
            elif isinstance(value, Mapping):
                setattr(self, name, _build(kind, value, f"train.{name}"))
            elif not isinstance(value, kind):
                raise ConfigError(f"train.{name}={value!r}: train.{name} is a section now; the setting is "
                                  f"train.{MOVED[name]}" if name in MOVED else
                                  f"train.{name}={value!r}: a section ({', '.join(f.name for f in fields(kind))})")
        for name in ("steps", "gradient_accumulation", "ttt_steps", "keep_checkpoints", "threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)}: must be >= 1")
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)}: must be >= 0")
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"train.collective_timeout_s={self.collective_timeout_s}: must be > 0 (seconds)")
        if self.precision not in _PRECISIONS:
            raise ConfigError(f"train.precision={self.precision!r}: expected one of {', '.join(_PRECISIONS)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"train.zero_stage={self.zero_stage}: expected 0, 1, 2 or 3")
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"train.device={self.device!r}: expected auto, cpu or cuda")
        self._check_across()

    def _check_across(self) -> None:
        """What one section asks of another, and what the draft's family cannot do."""
        if self.optim.name == "muon" and self.precision == "bf16" and self.zero_stage == 0:
            raise ConfigError("train.optim.name=muon with precision=bf16 needs train.zero_stage >= 1 (DeepSpeed runs "
                              "Muon on bf16 weights only through its ZeRO optimizers; stage 1 costs nothing extra on "
                              "one rank)")
        if self.loss.token_weights and self.data.mode != "offline":
            raise ConfigError(f"train.loss.token_weights={self.loss.token_weights}: names samples of a harvest store; "
                              f"train.data.mode={self.data.mode} streams them (train offline)")
        if self.context_parallel < 1 or (self.context_parallel > 1 and self.data.mode != "offline"):
            raise ConfigError(f"train.context_parallel={self.context_parallel}: must be >= 1, and 1 unless "
                              f"train.data.mode=offline (not {self.data.mode})")
        spec = draft_spec(self.draft)
        spec.check_steps(self.ttt_steps)
        family = get_family(spec.family, "train.draft.family")
        family.check_spec(spec)
        if self.gradient_checkpointing and not family.recomputes_steps:
            raise ConfigError(f"train.gradient_checkpointing=true: a {family.name} draft does not train as an "
                              "unroll to recompute step by step; it is not supported there")
        if self.context_parallel > 1 and not family.splits_rows:
            raise ConfigError(f"train.context_parallel={self.context_parallel}: a {family.name} draft trains a row on "
                              "one rank (its attention to the context is not split)")
        if self.init.layers != "random" and not family.starts_from_readout:
            raise ConfigError(f"train.init.layers={self.init.layers}: a {family.name} draft starts from random layers")

    def draft_overrides(self, mask_token_id: int | None = None) -> dict[str, Any]:
        """The draft's shape as :meth:`eagle3.draft.model.DraftConfig.from_target_config` overrides: the
        spec's common shape, then its family's fields for this run's TTT steps (``mask_token_id``: the
        one chosen for it)."""
        family = get_family(self.draft.family)
        return {**self.draft.config_overrides(), **family.config_fields(mask_token_id, self.draft, self.ttt_steps)}

    def pinned(self) -> dict[str, Any]:
        """The settings a resumed run must share with the run that saved its checkpoint, by recipe key
        (``train.optim.lr``; the run's data is pinned beside them: :class:`eagle3.train.data.TrainData`)."""
        flat = settings_of(self)
        # a family's own keys (a DFlash draft's draft.block_size) as the draft is shaped: unset and
        # set to the value it stands for are the same model
        for key, value in get_family(self.draft.family).shape(self.draft, self.ttt_steps).items():
            if f"draft.{key}" in flat:
                flat[f"draft.{key}"] = value
        return {f"train.{k}": flat[k] for k in PINNED if k in flat}  # draft.block_size: a DFlash draft's only


PINNED = ("data.batching", "data.shard_window", "data.micro_batch_tokens", "gradient_accumulation", "seed",
          "data.eval_fraction", "ttt_steps", "init.draft", "draft.layers", "draft.intermediate_size",
          "draft.num_attention_heads", "draft.num_key_value_heads", "draft.head_dim", "draft.rope", "draft.variant",
          "draft.family", "draft.sliding_window", "draft.full_attention_layers", "draft.mask_token_id", "zero_stage",
          "context_parallel", "precision", "init.freeze_lm_head", "optim.name", "optim.muon_momentum",
          "init.lm_head", "init.layers", "init.head_scale", "init.aux_scale", "loss.step_decay", "draft.vocab_size",
          "draft.vocab", "draft.block_size", "loss.kind", "loss.lk_eta", "loss.hard_tokens", "loss.hard_token_entropy",
          "loss.hard_token_weight",
          # a checkpoint restores the optimizer's own lr, decay, betas and eps: a change would only be logged
          "optim.lr", "optim.weight_decay", "optim.adam_beta1", "optim.adam_beta2", "optim.adam_eps")
"""The settings a resumed run must share with the run that saved the checkpoint (``train.<key>``)."""


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(TrainConfig)  # type: ignore[misc]
                             if isinstance(f.default_factory, type) and is_dataclass(f.default_factory)}
"""TrainConfig's sections, by key (its fields that are settings classes)."""

MOVED: dict[str, str] = {
    **{name: f"data.{name}" for name in ("store", "extra_stores", "sample_weights", "eval_store", "eval_fraction",
                                          "micro_batch_tokens", "batching", "shard_window", "spool_wait_s",
                                          "producer_stale_s", "producer_grace_s")},
    "data": "data.mode",
    "num_layers": "draft.layers", "draft_layers": "draft.layers", "draft_family": "draft.family",
    "draft_variant": "draft.variant", "mask_token_id": "draft.mask_token_id",
    **{f"draft_{name}": f"draft.{name}" for name in ("intermediate_size", "num_attention_heads",
                                                      "num_key_value_heads", "head_dim", "sliding_window",
                                                      "full_attention_layers", "rope", "vocab_size", "vocab")},
    "init_draft": "init.draft", "lm_head_init": "init.lm_head", "head_scale_init": "init.head_scale",
    "aux_scale_init": "init.aux_scale", "layer_init": "init.layers", "freeze_lm_head": "init.freeze_lm_head",
    "loss": "loss.kind", "lk_eta": "loss.lk_eta", "step_decay": "loss.step_decay", "loss_positions": "loss.positions",
    "loss_on_oov": "loss.on_oov", "gate_steps": "loss.gate_steps", "target_temperature": "loss.target_temperature",
    "feature_noise": "loss.feature_noise", "hard_tokens": "loss.hard_tokens",
    "hard_token_entropy": "loss.hard_token_entropy", "hard_token_weight": "loss.hard_token_weight",
    "token_weights": "loss.token_weights",
    "optimizer": "optim.name", "lr": "optim.lr", "lr_schedule": "optim.schedule", "warmup_steps": "optim.warmup_steps",
    "min_lr_ratio": "optim.min_lr_ratio", "weight_decay": "optim.weight_decay", "adam_beta1": "optim.adam_beta1",
    "adam_beta2": "optim.adam_beta2", "adam_eps": "optim.adam_eps", "muon_momentum": "optim.muon_momentum",
    "muon_ns_method": "optim.muon_ns_method", "max_grad_norm": "optim.max_grad_norm",
    "log_every": "log.every", "wandb_mode": "log.wandb_mode", "wandb_project": "log.wandb_project",
    "wandb_run_name": "log.wandb_run_name", "progress": "log.progress", "phase_times": "log.phase_times",
}
"""Flat train keys of earlier versions -> where each setting is now (``train.<new>``)."""


def moved_key(key: str) -> str | None:
    """``train.<old flat key>`` (or the bare key) -> one line naming where it is now; None for a current key."""
    bare = key.removeprefix("+").removeprefix("train.")
    if bare not in MOVED or "." in bare:
        return None
    return f"train.{bare} is now train.{MOVED[bare]}"


def _build(kind: type, values: Mapping[str, Any], where: str) -> Any:
    """A settings dataclass from a mapping, each unknown key refused in one line naming ``where``
    (and its new place when it is a key of an earlier version)."""
    known = {f.name for f in fields(kind)}
    for key in values:
        if key not in known:
            moved = moved_key(key) if where == "train" else None
            raise ConfigError(moved or f"{where}.{key}: not a setting (known: {', '.join(sorted(known))})")
    return kind(**values)


def draft_spec(value: Mapping[str, Any] | DraftSpec) -> DraftSpec:
    """The ``train.draft`` section as its family's class (:attr:`DraftFamily.spec_class`): a field of
    another family's class is dropped at its default and refused set, naming the key and the family."""
    values = value if isinstance(value, Mapping) else {f.name: getattr(value, f.name) for f in fields(value)}
    family = get_family(str(values.get("family", DraftSpec.family)), "train.draft.family")
    kind = family.spec_class
    if type(value) is kind:
        return value  # type: ignore[return-value]
    own = {f.name for f in fields(kind)}
    others = {f.name: f for f in fields(draft_settings()) if f.name not in own}
    for key, v in values.items():
        if key in others and v != (others[key].default if others[key].default is not MISSING
                                   else others[key].default_factory()):  # type: ignore[misc]
            owners = [name for name in family_names() if key in {f.name for f in fields(get_family(name).spec_class)}]
            raise ConfigError(f"train.draft.{key}={v!r}: a setting of {' and '.join(owners)} drafts, not of "
                              f"train.draft.family={family.name}")
    return _build(kind, {k: v for k, v in values.items() if k not in others}, "train.draft")


@functools.cache
def draft_settings() -> type[DraftSpec]:
    """What ``train.draft`` takes from a recipe or a command line: the common shape and every registered
    family's own fields (a class built on each family's section class, installed packages' families
    included: the schema hydra and the command line check); a run's section is its family's class
    (:func:`draft_spec`). A family registered later is built and checked all the same, its own keys
    taken in code only."""
    load_plugins()
    kinds = list(dict.fromkeys(get_family(n).spec_class for n in family_names()))
    bases = tuple(k for k in kinds if not any(o is not k and issubclass(o, k) for o in kinds))  # most derived
    return _module_class(make_dataclass("DraftSettings", [], bases=bases),
                         "Every draft family's ``train.draft`` settings (a run's section is its family's class).")


@functools.cache
def train_settings() -> type[TrainConfig]:
    """:class:`TrainConfig` as recipes and the command line take it: ``draft`` with every family's fields
    (:func:`draft_settings`); the run's own config keeps its family's class (:func:`run_config`)."""
    draft = draft_settings()
    cls = make_dataclass("TrainSettings", [("draft", draft, field(default_factory=draft))], bases=(TrainConfig,),
                         namespace={"_schema": True})
    return _module_class(cls, TrainConfig.__doc__ or "")


def _module_class(cls: type, doc: str) -> Any:
    """A class made at run time, findable under its module (it pickles, and hydra names it)."""
    cls.__module__, cls.__qualname__, cls.__doc__ = __name__, cls.__name__, doc
    globals()[cls.__name__] = cls
    return cls


def run_config(cfg: TrainConfig) -> TrainConfig:
    """The run's own :class:`TrainConfig` from one checked against :func:`train_settings` (its draft
    section its family's class)."""
    if type(cfg) is TrainConfig:
        return cfg
    return TrainConfig(**{f.name: getattr(cfg, f.name) for f in fields(TrainConfig)})


def train_config(settings: Mapping[str, Any] | None = None, **keys: Any) -> TrainConfig:
    """A :class:`TrainConfig` from nested settings (``{"optim": {"lr": 1e-3}}``) and/or dotted keys
    (``**{"optim.lr": 1e-3}``, later ones win); a key of an earlier version is refused naming its new place."""
    nested: dict[str, Any] = {}
    for source in (settings or {}, keys):
        for key, value in source.items():
            _put(nested, key.split("."), value)
    return _build(TrainConfig, nested, "train")


def _put(nested: dict[str, Any], path: list[str], value: Any) -> None:
    if len(path) == 1:
        if isinstance(value, Mapping) and isinstance(nested.get(path[0]), dict):
            for key, sub in value.items():
                _put(nested[path[0]], [key], sub)
        elif is_dataclass(value) or not isinstance(value, Mapping):
            nested[path[0]] = value
        else:
            nested[path[0]] = dict(value)
        return
    head = nested.setdefault(path[0], {})
    if not isinstance(head, dict):
        raise ConfigError(f"train.{path[0]}: set both as a value and as a section")
    _put(head, path[1:], value)


def settings_of(cfg: TrainConfig) -> dict[str, Any]:
    """``{dotted key: value}`` of every setting (``optim.lr``: the same keys the command line and
    :func:`train_config` take)."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in SECTIONS:
            out |= {f"{f.name}.{g.name}": getattr(value, g.name) for g in fields(value)}
        else:
            out[f.name] = value
    return out


def updated(cfg: TrainConfig, settings: Mapping[str, Any] | None = None, **keys: Any) -> TrainConfig:
    """``cfg`` with some settings replaced, named by dotted key (``**{"optim.lr": 1e-3}``), checked again."""
    return train_config({**settings_of(cfg), **(settings or {}), **keys})


def setting_keys() -> set[str]:
    """Every dotted key a TrainConfig takes (``steps``, ``optim.lr``, ..; each family's ``draft.*``)."""
    return set(settings_of(TrainConfig())) | {f"draft.{f.name}" for f in fields(draft_settings())}


def draft_recipe(name: str) -> dict[str, Any]:
    """The ``train`` settings of ``recipes/draft/<name>.yaml`` (what the pipeline's ``draft=<name>``
    sets) as dotted keys (``optim.lr``), for the tools that train outside the pipeline; ``none``: no
    settings (the library's defaults)."""
    if name == "none":
        return {}
    from omegaconf import OmegaConf

    path = DRAFT_RECIPES / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in DRAFT_RECIPES.glob("*.yaml")))
        raise ConfigError(f"draft recipe {name!r}: no {path}; known: {known}, none")
    out: dict[str, Any] = {}
    known = setting_keys()

    def walk(prefix: str, node: Any) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict) and dotted in SECTIONS:
                walk(dotted + ".", value)
            elif dotted not in known:
                moved = moved_key(dotted)
                raise ConfigError(f"{path}: {moved or repr(dotted) + ' is not a train setting'}")
            elif value is None or isinstance(value, list | dict):
                raise ConfigError(f"{path}: {dotted}={value!r}: a draft recipe sets single values")
            else:
                out[dotted] = value

    walk("", OmegaConf.to_container(OmegaConf.load(path)) or {})
    return out


__all__ = ["DRAFT_RECIPES", "HARD_TOKENS", "LR_SCHEDULES", "MOVED", "PINNED", "SECTIONS", "WANDB_MODES", "InitSpec",
           "LossSpec", "TrainConfig", "draft_recipe", "draft_settings", "draft_spec", "moved_key", "run_config",
           "setting_keys", "settings_of", "train_config", "train_settings", "updated"]
