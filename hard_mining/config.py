"""The mining rounds' settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle3.errors import ConfigError
from eagle3.train.config import WANDB_MODES

MINE_STRATEGIES = ("reweight", "hardest", "synthesize", "replay", "uniform")
RANKS = ("missed_confident", "excess", "loss")
"""How samples are ranked hardest first (``mine.rank``, :func:`hard_mining.score.rank_key`):
``missed_confident``, the share of starts whose first draft token was rejected where the target was
confident (ties: higher excess first); ``excess``, the loss above the target's own entropy;
``loss``, the raw loss (high-entropy text first: kept for comparison)."""


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
    """Any of reweight, hardest, synthesize, replay; or uniform (random pool prompts, the ablation's control)."""
    rank: str = "missed_confident"
    """hardest and synthesize: how samples are ranked hardest first (hard_mining.score.RANKS):
    missed_confident (the share of starts whose first draft token the target rejected where it was
    confident itself: learnable misses), excess (the loss above the target's entropy), or loss (raw:
    picks text no draft can learn; for comparison)."""
    confidence: float = 0.5
    """rank=missed_confident: the target's top-1 probability from which a position counts as confident."""
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
    replay_prompts: int = 16
    """replay: pool prompts per round (balanced over domains) the draft is run against; with them,
    every conversation the round adds is replayed: the tokens its served rounds rejected are weighted
    ``replay_weight`` in training (``train.token_weights``; earlier rounds' carried)."""
    replay_weight: float = 3.0
    """replay: the loss weight of a rejected token (every TTT step whose target it is)."""
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
    workers: int = 1
    """Processes regenerating the mined prompts side by side (``regenerate.workers``: the same output
    for any number)."""
    thinking: str = "template"
    """The thinking mode the mined prompts are regenerated in (``regenerate.thinking``: the pipeline
    passes the run's, so a reasoning target's mined data is rendered as its training data)."""
    thinking_on_fraction: float = 0.5
    """With ``thinking=mix``: the share regenerated with thinking on (``regenerate.thinking_on_fraction``)."""
    seed: int = 0
    wandb_mode: str = "offline"
    wandb_project: str = "eagle3"

    @property
    def mode(self) -> tuple[str, float]:
        """(thinking, thinking_on_fraction): how mined prompts are regenerated."""
        return self.thinking, self.thinking_on_fraction

    def __post_init__(self) -> None:
        bad = [s for s in self.strategies if s not in MINE_STRATEGIES]
        if bad or not self.strategies:
            raise ConfigError(f"mine.strategies={self.strategies}: expected some of {', '.join(MINE_STRATEGIES)}")
        if self.thinking not in ("template", "on", "off", "mix"):
            raise ConfigError(f"mine.thinking={self.thinking!r}: expected template, on, off or mix")
        for name in ("rounds", "steps", "max_new_tokens", "candidate_tokens", "variation_tokens", "workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"mine.{name}={getattr(self, name)}: must be >= 1")
        if self.rank not in RANKS:
            raise ConfigError(f"mine.rank={self.rank!r}: expected one of {', '.join(RANKS)}")
        if not 0.0 < self.confidence <= 1.0:
            raise ConfigError(f"mine.confidence={self.confidence}: must be in (0, 1]")
        if not self.replay_weight >= 0:
            raise ConfigError(f"mine.replay_weight={self.replay_weight}: must be >= 0")
        for name in ("candidates", "hard_examples", "variations", "procedural", "uniform", "replay_prompts"):
            if getattr(self, name) < 0:
                raise ConfigError(f"mine.{name}={getattr(self, name)}: must be >= 0")
        if self.lr is not None and self.lr <= 0:
            raise ConfigError(f"mine.lr={self.lr}: must be > 0 (or null: a quarter of train.lr)")
        if not 0.0 < self.keep_fraction <= 1.0:
            raise ConfigError(f"mine.keep_fraction={self.keep_fraction}: must be in (0, 1]")
        if self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"mine.wandb_mode={self.wandb_mode!r}: expected one of {', '.join(WANDB_MODES)}")
