"""What a draft is to be: its family, layer variant, depth, widths, attention window, RoPE and
vocabulary (:class:`DraftSpec`, the trainer's ``train.draft`` section; a family with settings of its
own subclasses it, its ``spec_class``). The families read this and
the number of tokens a round drafts, never the trainer's settings; the trainer asks the chosen family
to check it (:meth:`eagle3.draft.families.base.DraftFamily.check_spec`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle3.errors import ConfigError

VARIANTS = ("eagle3", "speculators", "eagle3.1")
KEY = "train.draft"
"""Where the pipeline and the trainer's command line hold these settings (errors name it)."""


@dataclass
class DraftSpec:
    """The draft's shape (``train.draft.*``; unset widths: the target's)."""

    family: str = "eagle3"
    """eagle3: each draft step reads the previous one (a chain or a tree, one forward per token);
    peagle: P-EAGLE, parallel drafting (the steps after the first read a mask token and a learned
    mask state instead, so one forward proposes them all; vLLM serves it as eagle3 with
    ``parallel_drafting``). An ``init.draft`` of the eagle3 family becomes a P-EAGLE draft with a
    fresh mask state. dflash: DFlash (:mod:`eagle3.draft.families.dflash`), Qwen3-style layers that read
    the aux states as keys and propose a block of tokens in one non-causal forward (vLLM
    ``method=dflash``; its section is :class:`eagle3.draft.families.dflash.DFlashSpec`, with
    ``block_size``); ``layers`` sets its depth, ``variant`` and ``init.layers`` do not apply."""
    variant: str = "eagle3"
    """eagle3: the layer of the EAGLE-3 paper (no extra norms); speculators: speculators 0.9.0's
    variant (``norm_before_residual``, ``norm_before_fc`` and ``norm_output``), for comparisons;
    eagle3.1: EAGLE-3.1's (arXiv 2605.09992: ``fc_norm``, one norm per aux state before ``fc``, and
    ``norm_output``, the post-norm state fed to the next step; vLLM serves it as EAGLE-3)."""
    layers: int = 1
    """Decoder layers of the draft."""
    intermediate_size: int | None = None
    """SwiGLU width of the draft's MLP (None: the target's ``intermediate_size``)."""
    num_attention_heads: int | None = None
    """Query heads of the draft's attention (None: the target's)."""
    num_key_value_heads: int | None = None
    """Key/value heads of the draft's attention (None: the target's)."""
    head_dim: int | None = None
    """Head size of the draft's attention (None: the target's ``head_dim``, else hidden / heads)."""
    mask_token_id: int | None = None
    """peagle, dflash: the token fed at each mask position (its frozen embedding; the learned mask state
    carries the rest). None: the tokenizer's mask token, a vocabulary row no token uses, its pad or
    unknown token when that is not the end-of-text token, else the last id (SmolLM2: 0)."""
    sliding_window: int | None = None
    """Set: the draft's layers attend to the last N positions only (:class:`eagle3.draft.model.DraftConfig`
    ``sliding_window``; exported as ``sliding_window`` and ``layer_types``, which vLLM honours). Must
    exceed ``train.ttt_steps`` and be shorter than the store's longest row (else it never acts in training)."""
    full_attention_layers: list[int] = field(default_factory=list)
    """With ``sliding_window``: draft layers (0-based) that keep full attention."""
    rope: str = "target"
    """target: the target's RoPE theta and scaling (plain, linear, llama3 or yarn; anything else,
    e.g. Phi-3's longrope, fails naming this key); plain: the target's theta without scaling."""
    vocab_size: int = 32000
    """Target tokens the draft can propose: the most frequent loss-masked tokens of the training
    store (capped at the target's vocabulary)."""
    vocab: str | None = None
    """Reuse a draft vocab instead (a draft_vocab.safetensors of another run, or an exported
    draft folder): across runs and mining rounds."""

    def __post_init__(self) -> None:
        for name in ("layers", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{KEY}.{name}={getattr(self, name)}: must be >= 1")
        for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{KEY}.{name}={getattr(self, name)}: must be >= 1 (or null)")
        if self.variant not in VARIANTS:
            raise ConfigError(f"{KEY}.variant={self.variant!r}: expected {', '.join(VARIANTS)}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ConfigError(f"{KEY}.mask_token_id={self.mask_token_id}: must be a token id (>= 0)")
        if self.full_attention_layers and self.sliding_window is None:
            raise ConfigError(f"{KEY}.full_attention_layers={list(self.full_attention_layers)}: set "
                              f"{KEY}.sliding_window too (without it every layer attends in full)")
        bad = [i for i in self.full_attention_layers if not 0 <= i < self.layers]
        if bad:
            raise ConfigError(f"{KEY}.full_attention_layers: {bad} not among the draft's layers "
                              f"0..{self.layers - 1} ({KEY}.layers={self.layers})")
        if self.rope not in ("target", "plain"):
            raise ConfigError(f"{KEY}.rope={self.rope!r}: expected target or plain")

    def check_steps(self, steps: int) -> None:
        """Refuse a shape that cannot draft ``steps`` tokens a round (``train.ttt_steps``)."""
        if self.sliding_window is not None and self.sliding_window <= steps:
            raise ConfigError(f"{KEY}.sliding_window={self.sliding_window}: must exceed train.ttt_steps={steps} "
                              "(a draft step's query sits that many positions past its row)")

    def config_overrides(self) -> dict[str, Any]:
        """The common shape set here as :meth:`eagle3.draft.model.DraftConfig.from_target_config`
        overrides (the family adds its own: :meth:`eagle3.draft.families.base.DraftFamily.config_fields`)."""
        out: dict[str, Any] = {"num_layers": self.layers}
        for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.rope == "plain":
            out["rope_scaling"] = None
        if self.sliding_window is not None:
            out |= {"sliding_window": self.sliding_window, "full_attention_layers": list(self.full_attention_layers)}
        return out


__all__ = ["KEY", "VARIANTS", "DraftSpec"]
