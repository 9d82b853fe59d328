"""The EAGLE-3 draft head: one Llama-style decoder layer over the target's aux states.

No distributed, device or logging code: the trainer wraps this module from outside.

Data flow for one draft token (``H`` draft hidden, ``H_t`` target hidden, ``A`` aux layers)::

    aux [.., A, H_t] --flatten--> fc --> hidden [.., H]          (step 0; later steps feed the
                                                                    previous step's pre-norm output)
    token --> embed_tokens (frozen, the target's) --> embeds [.., H]

    midlayer:  x        = cat(input_layernorm(embeds), hidden_norm(hidden))   [.., 2H]
               residual = hidden                  (hidden_norm(hidden) with norm_before_residual)
               h        = residual + o_proj(attn(q/k/v_proj(x)))
               h        = h + mlp(post_attention_layernorm(h))               pre-norm output
    logits = lm_head(norm(h))   over the draft vocabulary; draft id i is target id i + d2t[i]

The embedding comes first in the concatenation and the hidden state second, as vLLM's
``LlamaForCausalLMEagle3`` reads it. Parameter names are the ones vLLM loads
(``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; extra layers of a deeper
draft are ``layers.<i>.*`` for i >= 1), so :meth:`Eagle3Draft.vllm_state_dict` needs no renames.

Two ways to run it, sharing every projection, norm and MLP:

* :meth:`Eagle3Draft.forward` with a :class:`KVCache`, as at serving time (prefill, then one
  token per step);
* :func:`eagle3.draft.ttt.ttt_forward`, the batched training-time-test unroll, which supplies its
  own attention through :meth:`Eagle3Draft.decode`'s ``attends`` callbacks.

P-EAGLE (``DraftConfig.mask_token_id`` set; vLLM serves it as EAGLE-3 with ``parallel_drafting``):
the same layer, but draft step k >= 1 is fed ``mask_token_id`` and ``combine_aux(mask_hidden)``
(a learned point in the aux states' space) at RoPE position t + k instead of the drafted token and
the previous step's state, so no step waits for another: one causal forward over the context rows
and k - 1 mask rows proposes k tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.draft.kv import Attend, DraftKV, KVCache, cached_attend
from eagle3.draft.rope import (
    ROPE_TYPES,
    apply_rope,
    read_rope,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
    rope_kind,
)
from eagle3.errors import ConfigError
from eagle3.target.positions import as_dict


@dataclass
class DraftConfig:
    """Hyper-parameters of the draft; ``from_target_config`` fills them from the target's HF config."""

    hidden_size: int
    """Draft hidden size H (EAGLE-3 uses the target's)."""
    intermediate_size: int
    """SwiGLU width of the draft MLP."""
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    """The target's vocabulary (the frozen embedding's rows, the size of ``t2d``)."""
    draft_vocab_size: int
    """Rows of ``lm_head``; draft ids map to target ids through ``d2t``."""
    target_hidden_size: int | None = None
    """Hidden size of the target's aux states; None means ``hidden_size``."""
    num_aux_layers: int = 3
    """Aux states concatenated (ascending layer ids) before ``fc``."""
    head_dim: int | None = None
    """None means ``hidden_size // num_attention_heads``."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """None (plain RoPE), or ``{"rope_type": "linear", "factor": f}``, Llama-3's
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}`` or YaRN's ``{"rope_type": "yarn", "factor",
    "original_max_position_embeddings"}`` (optional ``beta_fast``, ``beta_slow``, ``truncate``,
    ``attention_factor``, ``mscale``, ``mscale_all_dim``: HF's and vLLM's keys and defaults)."""
    max_position_embeddings: int = 2048
    num_layers: int = 1
    """Decoder layers; the first takes the 2H concatenation, later ones are plain Llama layers."""
    norm_before_residual: bool = False
    """vLLM's ``norm_before_residual``: the residual is hidden_norm(hidden) instead of hidden."""
    norm_before_fc: bool = False
    """vLLM's ``norm_before_fc``: one RMSNorm (``input_norm``, width A*H_t) over the concatenated
    aux states before ``fc`` (speculators' default)."""
    fc_norm: bool = False
    """vLLM's ``fc_norm``: one RMSNorm per aux state (``fc_norm.<i>``) before ``fc``."""
    norm_output: bool = False
    """vLLM's ``norm_output``: the next step is fed the post-norm state instead of the pre-norm
    one (speculators' default, "EAGLE 3.1")."""
    initializer_range: float = 0.02
    """Std of the normal init of fresh linear weights."""
    mask_token_id: int | None = None
    """Set: a P-EAGLE draft (vLLM's ``parallel_drafting``). Draft steps after the first are fed this
    token and the learned ``mask_hidden`` (A*H_t, in the aux states' space before ``fc``) instead of
    a drafted token and the previous step's state, so one forward proposes every draft token."""
    block_size: int | None = None
    """Set: a DFlash draft (:mod:`eagle3.draft.families.dflash`): one non-causal forward over the bonus token and
    ``block_size - 1`` mask tokens (``mask_token_id``) proposes ``block_size - 1`` tokens."""
    sliding_window: int | None = None
    """Set: draft layers attend to the last ``sliding_window`` positions only, their own included (a
    query at position p sees keys at p - sliding_window < q <= p, as vLLM's and HF's ``sliding_window``),
    except the layers in ``full_attention_layers``. Exported as ``sliding_window`` and ``layer_types``."""
    full_attention_layers: list[int] = field(default_factory=list)
    """With ``sliding_window``: the draft layers (0-based) that keep full attention."""
    family: str | None = None
    """The draft family (:mod:`eagle3.draft.families`: eagle3, peagle, dflash, or one registered later;
    :func:`eagle3.draft.families.family_of` checks the fields fit it). None: read from the fields, as for
    configs saved before they named it (a block: dflash; a mask token alone: peagle; else eagle3)."""

    def __post_init__(self) -> None:
        if self.family is None:  # a config saved before configs named their family: what its fields make
            self.family = "dflash" if self.block_size is not None else "peagle" if self.mask_token_id is not None \
                else "eagle3"
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "vocab_size", "draft_vocab_size", "target_hidden_size", "num_aux_layers", "head_dim",
                     "num_layers", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"draft.{name}={getattr(self, name)}: must be >= 1")
        if self.sliding_window is not None and self.sliding_window < 2:
            raise ConfigError(f"draft.sliding_window={self.sliding_window}: must be >= 2 (or null: full attention)")
        bad = [i for i in self.full_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"draft.full_attention_layers={list(self.full_attention_layers)}: {bad} not among the "
                              f"draft's layers 0..{self.num_layers - 1}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"draft.num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"draft.mask_token_id={self.mask_token_id}: not a token id of the vocabulary "
                             f"(0..{self.vocab_size - 1})")
        if self.head_dim % 2:
            raise ConfigError(f"draft.head_dim={self.head_dim}: RoPE needs an even head_dim")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(f"draft.draft_vocab_size={self.draft_vocab_size} exceeds vocab_size={self.vocab_size}")
        if self.rope_scaling is not None:
            kind = rope_kind(self.rope_scaling)
            if kind not in ROPE_TYPES:
                raise ConfigError(f"draft.rope_scaling type {kind!r} is not supported (one of {', '.join(ROPE_TYPES)})")
            needed = {"linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                 "original_max_position_embeddings")}.get(kind, ())
            missing = [key for key in needed if self.rope_scaling.get(key) is None]
            if missing:
                raise ConfigError(f"draft.rope_scaling ({kind}) lacks {', '.join(missing)}")
            if self.rope_scaling.get("partial_rotary_factor", 1.0) != 1.0:
                raise ConfigError("draft.rope_scaling: partial_rotary_factor is not supported (the draft rotates "
                                 "the whole head)")

    @classmethod
    def from_target_config(cls, hf_config: Any, draft_vocab_size: int, **overrides: Any) -> DraftConfig:
        """A draft shaped like one decoder layer of the target (an HF ``PretrainedConfig``, or the
        dict of its config.json; a multimodal config's ``text_config`` is used). ``overrides`` set
        fields directly; ``rope_scaling=None`` among them means plain RoPE whatever the target uses."""
        if isinstance(hf_config, dict):
            hf_config = SimpleNamespace(**hf_config)
        text = getattr(hf_config, "text_config", None)
        if text is not None:
            hf_config = SimpleNamespace(**text) if isinstance(text, dict) else text
        theta, rope = read_rope(as_dict(hf_config))
        rope.pop("partial_rotary_factor", None)  # the draft rotates its whole head, whatever the target does
        kind = rope_kind(rope)
        hidden = hf_config.hidden_size
        heads = overrides.get("num_attention_heads", hf_config.num_attention_heads)
        values = dict(
            hidden_size=hidden,
            intermediate_size=hf_config.intermediate_size,
            num_attention_heads=hf_config.num_attention_heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hidden // heads,
            rms_norm_eps=getattr(hf_config, "rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if kind == "default" else rope,
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 2048),
            target_hidden_size=hidden,
            vocab_size=hf_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
        )
        values.update(overrides)
        try:
            return cls(**values)
        except ValueError as err:  # __post_init__'s RoPE checks (type, keys): the key is the target's
            if "rope_scaling" not in str(err):
                raise
            raise ConfigError(f"the target's rope_scaling / rope_parameters: {err}; set train.draft.rope=plain for "
                             "plain RoPE") from None


# ---------------------------------------------------------------- building blocks

class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def gather_rows(x: Tensor, rows: Tensor) -> Tensor:
    """x [B, S, ...] at the positions ``rows`` [B, M] of each batch row -> [B, M, ...]."""
    return x.gather(1, rows.view(*rows.shape, *[1] * (x.dim() - 2)).expand(*rows.shape, *x.shape[2:]))


class Attention(nn.Module):
    """q/k/v/o projections with RoPE; the attention pattern itself is the caller's ``attend``."""

    def __init__(self, config: DraftConfig, in_features: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend, rows: Tensor | None = None) -> Tensor:
        """x [B, S, in] -> [B, S, H]; with ``rows`` [B, M] keys and values still come from every
        row, queries (and the output) only from those rows: [B, M, H]."""
        b, s, _ = x.shape
        k = apply_rope(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim), cos, sin)  # [B, S, nkv, d]
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)  # [B, S, nkv, d]
        if rows is not None:
            x, cos, sin = gather_rows(x, rows), gather_rows(cos, rows), gather_rows(sin, rows)
        m = x.shape[1]
        q = apply_rope(self.q_proj(x).view(b, m, self.num_heads, self.head_dim), cos, sin)  # [B, M, nh, d]
        out = attend(q, k, v)  # [B, M, nh, d]
        return self.o_proj(out.reshape(b, m, self.num_heads * self.head_dim))  # [B, M, H]


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer; the first one (``first=True``) attends over cat(embeds, hidden)."""

    def __init__(self, config: DraftConfig, first: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.first = first
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Attention(config, 2 * h if first else h)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = MLP(h, config.intermediate_size)

    def forward(self, hidden: Tensor, embeds: Tensor, cos: Tensor, sin: Tensor, attend: Attend,
                rows: Tensor | None = None) -> Tensor:
        """hidden [B, S, H] (fc output or previous pre-norm state), embeds [B, S, H] -> pre-norm [B, S, H],
        or with ``rows`` [B, M] the output at those rows only, [B, M, H] (keys from every row)."""
        if self.first:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, S, 2H] embedding first
        else:
            residual, x = hidden, self.input_layernorm(hidden)
        if rows is not None:
            residual = gather_rows(residual, rows)
        h = residual + self.self_attn(x, cos, sin, attend, rows)
        return h + self.mlp(self.post_attention_layernorm(h))


# ---------------------------------------------------------------- what every draft family shares

class DraftHead:
    """The pieces every draft family has, whatever its layers: the target's frozen embedding
    (``embed_tokens``), the final ``norm`` and ``lm_head`` over the draft vocabulary, and the
    ``d2t``/``t2d`` mapping (:meth:`finish_head`); mixed into an ``nn.Module``."""

    config: DraftConfig
    embed_tokens: nn.Embedding
    norm: RMSNorm
    lm_head: nn.Linear
    d2t: Tensor
    t2d: Tensor

    def reset_parameters(self) -> None:
        """Fresh init: normal(0, initializer_range) linears and embedding, unit RMSNorm weights."""
        with torch.no_grad():
            for module in self.modules():  # type: ignore[attr-defined]
                if isinstance(module, nn.Linear | nn.Embedding):
                    module.weight.normal_(0.0, self.config.initializer_range)
                elif isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)

    def finish_head(self, embed_tokens_weight: Tensor | None) -> None:
        """The end of every family's ``__init__``, after its layers: the final ``norm`` and ``lm_head``,
        the identity vocab (draft id i is target id i until :meth:`set_draft_vocab`), a fresh init,
        then the target's embedding when given."""
        c = self.config
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))  # type: ignore[attr-defined]
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)  # type: ignore[attr-defined]
        self.reset_parameters()
        if embed_tokens_weight is not None:
            self.load_embedding(embed_tokens_weight)

    # -- weights from the target

    def load_embedding(self, weight: Tensor) -> None:
        """Copy the target's input embedding [vocab, H] (stays frozen)."""
        want = tuple(self.embed_tokens.weight.shape)
        if tuple(weight.shape) != want:
            raise ValueError(f"embedding of shape {tuple(weight.shape)}, expected {want}")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def set_draft_vocab(self, d2t: Tensor, t2d: Tensor) -> None:
        """d2t [draft_vocab] int64 offsets (target = draft + d2t[draft]); t2d [vocab] bool."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)}, expected "
                             f"{tuple(self.d2t.shape)} / {tuple(self.t2d.shape)}")
        target_ids = torch.arange(len(d2t), device=d2t.device) + d2t
        if int(t2d.sum()) != len(d2t) or not bool(t2d[target_ids].all()):
            raise ValueError("t2d does not mark exactly the target ids of d2t")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def init_lm_head_from_target(self, target_lm_head_weight: Tensor, d2t: Tensor,
                                 target_norm_weight: Tensor | None = None) -> None:
        """lm_head rows = the target lm_head's rows of the draft vocab ([vocab, H] -> [draft_vocab, H]).

        With ``target_norm_weight`` the draft's final norm copies the target's too, so that a
        draft whose pre-norm state equals the target's reproduces the target's logits exactly.
        """
        target_ids = torch.arange(len(d2t), device=d2t.device) + d2t
        rows = target_lm_head_weight[target_ids.to(target_lm_head_weight.device)]
        if rows.shape != self.lm_head.weight.shape:
            raise ValueError(f"target lm_head rows {tuple(rows.shape)}, expected {tuple(self.lm_head.weight.shape)}")
        with torch.no_grad():
            self.lm_head.weight.copy_(rows)
            if target_norm_weight is not None:
                self.norm.weight.copy_(target_norm_weight)

    def fc_input(self, aux: Tensor) -> Tensor:
        """aux [.., A, H_t] -> what ``fc`` reads [.., A*H_t] (the concatenated states; a family with
        norms before ``fc`` applies them)."""
        return aux.flatten(-2)

    @torch.no_grad()
    def scale_aux_inputs(self, aux: Tensor) -> Tensor:
        """Start every channel of what ``fc`` reads at unit RMS over ``aux`` [N, A, H_t] (the real
        rows of a batch): returns the factor [A*H_t] applied. A target's states differ in scale by
        orders of magnitude between layers and between channels (a few "massive" channels can
        carry nearly all of a state's energy, so a norm over the state leaves the others near
        zero); ``fc`` would then read little more than those few channels until training grows
        its weights by as much. The factor goes where the draft can hold it: the last norm before
        ``fc`` (:meth:`_scale_fc_input`), else ``fc``'s columns; the served draft computes the same."""
        x = self.fc_input(aux.to(self.fc.weight.dtype)).float()
        rms = x.pow(2).mean(0).sqrt()  # [A*H_t]
        floor = rms.median() * 1e-6  # a channel (nearly) dead on these rows stays as it is
        factor = torch.where(rms > floor, 1.0 / rms.clamp_min(floor), torch.ones_like(rms))
        self._scale_fc_input(factor, aux)
        return factor

    def _scale_fc_input(self, factor: Tensor, aux: Tensor) -> None:
        """Multiply channel c of ``fc``'s input by ``factor[c]`` (here: ``fc``'s columns)."""
        self.fc.weight.mul_(factor.to(self.fc.weight))

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of draft layer ``layer`` (None: full attention)."""
        c = self.config
        return None if c.sliding_window is None or layer in c.full_attention_layers else c.sliding_window

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)  # [B, S, H]

    def compute_logits(self, prenorm: Tensor) -> Tensor:
        """pre-norm state [.., H] -> draft-vocab logits [.., draft_vocab]."""
        return self.lm_head(self.norm(prenorm))

    def draft_to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def vllm_state_dict(self, include_embedding: bool = False) -> dict[str, Tensor]:
        """The checkpoint vLLM loads (``LlamaForCausalLMEagle3``, or ``DFlashDraftModel`` for a DFlash
        draft), names unchanged. Without the embedding vLLM uses the target's (ours is a frozen copy)."""
        state = self.state_dict()
        if not include_embedding:
            state.pop("embed_tokens.weight")
        return state


# ---------------------------------------------------------------- the draft

class Eagle3Draft(DraftHead, nn.Module):
    """The EAGLE-3 draft head. ``embed_tokens`` is a frozen copy of the target's embedding."""

    def __init__(self, config: DraftConfig, embed_tokens_weight: Tensor | None = None) -> None:
        super().__init__()
        if config.block_size is not None:
            raise ValueError("a config with a block (block_size) is not an EAGLE-3 draft's")
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.requires_grad_(False)
        width = config.num_aux_layers * config.target_hidden_size
        if config.norm_before_fc:
            self.input_norm = RMSNorm(width, config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                          for _ in range(config.num_aux_layers)])
        self.fc = nn.Linear(width, h, bias=False)
        if self.has_mask_state:  # P-EAGLE: the aux states fed at every mask position (vLLM's name and layout)
            self.mask_hidden = nn.Parameter(torch.zeros(width))
        self.midlayer = DecoderLayer(config, first=True)
        if config.num_layers > 1:  # vLLM names them layers.<i> (it maps midlayer. to layers.0.)
            self.layers = nn.ModuleDict({str(i): DecoderLayer(config, first=False)
                                         for i in range(1, config.num_layers)})
        self.finish_head(embed_tokens_weight)

    def reset_parameters(self) -> None:
        """Fresh init (:meth:`DraftHead.reset_parameters`); P-EAGLE's mask state N(0, 1), as speculators starts it."""
        super().reset_parameters()
        if self.has_mask_state:
            with torch.no_grad():
                self.mask_hidden.normal_(0.0, 1.0)

    def init_as_readout(self) -> None:
        """Start as the target's own readout of its deepest aux state: ``fc`` passes that state
        through (identity on its slice, zeros elsewhere), every decoder layer's output projections
        (``o_proj``, ``down_proj``) start at zero and the norms on that path at one, so the untrained
        draft's pre-norm output at position t is the target's state entering its deepest aux layer
        there (up to scale). With :meth:`init_lm_head_from_target` the first logits are the target's
        logit lens at that depth (as Medusa starts its heads from the target's prediction)."""
        c = self.config
        if c.target_hidden_size != c.hidden_size:
            raise ValueError(f"a readout init needs target_hidden_size ({c.target_hidden_size}) == hidden_size "
                             f"({c.hidden_size})")
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, -c.target_hidden_size:].copy_(torch.eye(c.hidden_size))
            for norm in (getattr(self, "input_norm", None), self.midlayer.hidden_norm,
                         *getattr(self, "fc_norm", ())):  # the norms on that path scale nothing
                if norm is not None:
                    norm.weight.fill_(1.0)
            for layer in self.decoder_layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()

    @property
    def has_mask_state(self) -> bool:
        """A mask token in the config: P-EAGLE's ``mask_hidden`` is part of the draft."""
        return self.config.mask_token_id is not None

    # -- pieces of the forward, shared by serving and the TTT unroll

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return [self.midlayer, *(self.layers.values() if self.config.num_layers > 1 else ())]

    def fc_input(self, aux: Tensor) -> Tensor:
        """aux [.., A, H_t] (ascending layer ids) -> what ``fc`` reads [.., A*H_t] (norms first, as
        vLLM: ``input_norm`` over the concatenation, then ``fc_norm`` per state)."""
        x = aux.flatten(-2)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        if self.config.fc_norm:
            x = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1),
                                                              strict=True)], dim=-1)
        return x

    def combine_aux(self, aux: Tensor) -> Tensor:
        """aux [B, S, A, H_t] -> fc output [B, S, H]."""
        return self.fc(self.fc_input(aux))

    def _scale_fc_input(self, factor: Tensor, aux: Tensor) -> None:
        """The factor in the last norm before ``fc`` (``fc_norm``, else ``input_norm``), else in
        ``fc``'s columns. P-EAGLE's mask state starts as a typical state instead of N(0, 1): each
        channel at the RMS the real states have there, so that the scaled path sees it at unit
        scale too."""
        c = self.config
        if c.fc_norm:
            for norm, part in zip(self.fc_norm, factor.view(c.num_aux_layers, -1), strict=True):
                norm.weight.mul_(part.to(norm.weight))
        elif c.norm_before_fc:
            self.input_norm.weight.mul_(factor.to(self.input_norm.weight))
        else:
            super()._scale_fc_input(factor, aux)
        if self.has_mask_state:
            raw = aux.flatten(-2).float().pow(2).mean(0).sqrt()  # [A*H_t]
            self.mask_hidden.mul_(raw.to(self.mask_hidden))

    def mask_state(self) -> Tensor:
        """P-EAGLE: the state every mask position is fed, ``combine_aux`` of ``mask_hidden``. [1, 1, H]"""
        c = self.config
        return self.combine_aux(self.mask_hidden.view(1, 1, c.num_aux_layers, c.target_hidden_size))

    def mask_inputs(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """P-EAGLE: what ``shape`` = (B, M) mask rows are fed, the mask token ids [B, M] and the mask
        state [B, M, H]."""
        ids = torch.full(shape, self.config.mask_token_id, dtype=torch.long, device=device)
        return ids, self.mask_state().to(dtype).expand(*shape, -1)

    def next_hidden(self, prenorm: Tensor) -> Tensor:
        """The state the next draft step is fed: the pre-norm output, or with ``norm_output`` the
        post-norm one. [.., H] -> [.., H]"""
        return self.norm(prenorm) if self.config.norm_output else prenorm

    def rope(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(self.config, position_ids, dtype)

    def decode(self, hidden: Tensor, embeds: Tensor, position_ids: Tensor, attends: Sequence[Attend],
               rows: Tensor | None = None) -> Tensor:
        """hidden [B, S, H], embeds [B, S, H], position_ids [B, S] -> pre-norm output [B, S, H].

        ``attends[i]`` is layer i's attention pattern over its rotated q/k/v. With ``rows`` [B, M]
        the output is wanted at those rows only ([B, M, H]): every layer still gives keys for all
        rows, the last one computes queries, attention output and MLP only at ``rows``.
        """
        cos, sin = self.rope(position_ids, hidden.dtype)
        h = hidden
        layers = self.decoder_layers
        for i, (layer, attend) in enumerate(zip(layers, attends, strict=True)):
            h = layer(h, embeds, cos, sin, attend, rows if i == len(layers) - 1 else None)
        return h

    # -- serving

    def forward(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor,
                cache: KVCache | None = None, attn_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Serving-time forward over new tokens, continuing ``cache`` (updated in place).

        input_ids [B, S]: the token after each position; hidden [B, S, H]: ``combine_aux`` of the
        target's aux states (tokens the target verified) or the draft's previous pre-norm output
        (draft steps); position_ids [B, S]; attn_mask [S, past + S] bool for tree drafting (default
        causal). Returns (the state the next step takes [B, S, H] (see :meth:`next_hidden`),
        logits [B, S, Vd]).
        """
        cache = KVCache() if cache is None else cache
        attends = []
        for i in range(self.config.num_layers):
            window, mask = self.layer_window(i), attn_mask
            if window is not None and mask is not None:  # a tree: cache slots of the context are their positions,
                # a node's slot is at least its position, and a tree is shallower than the window
                mask = mask & (position_ids[0, :, None] - torch.arange(mask.shape[-1], device=mask.device) < window)
            attends.append(cached_attend(cache, i, mask, window))
        prenorm = self.decode(hidden, self.embed(input_ids), position_ids, attends)
        cache.commit(input_ids.shape[1])
        return self.next_hidden(prenorm), self.compute_logits(prenorm)


__all__ = [
    "DraftConfig", "DraftHead", "DraftKV", "Eagle3Draft", "KVCache", "apply_rope", "read_rope",
    "rope_attention_factor", "rope_cos_sin", "rope_inv_freq", "rope_kind",
]
