"""The DFlash draft family: Qwen3-style layers that propose a whole block in one non-causal forward.

What vLLM's ``DFlashDraftModel`` serves (``method: "dflash"``; checked against vLLM 0.32's
``qwen3_dflash.py`` and ``v1/spec_decode/dflash.py``), for ``A`` aux states, block size ``B``::

    context   every token the target has verified, position p:
              c[p] = hidden_norm(fc(aux[p]))                        [.., H], no input_layernorm
              per layer: K = rope(k_norm(k_proj(c)), p), V = v_proj(c)  kept in the draft's cache
    block     the bonus token (the target's newest token, position n) and B-1 mask tokens at n+1..
              per layer (pre-norm residual): h = input_layernorm(x); q/k/v with q_norm, k_norm and
              RoPE; attention over the cached context keys and the block's own keys, NOT causal
              inside the block; o_proj; SwiGLU MLP after post_attention_layernorm
    logits    lm_head(norm(x)) at mask slot k = the draft token at position n + k

Training (:func:`dflash_forward`) uses the TTT rows of :mod:`eagle3.draft.ttt`: at row t the target has
verified x[<=t], the bonus token is x[t+1] at position pos[t]+1, slot k (1..B-1) is a mask at
pos[t]+1+k and learns p[t+k] (the distribution of x[t+k+1]), i.e. TTT step k-1 at row t, with its
counting, loss gating and metrics. The attention is TTT's too: the step-0 window (context rows
s <= t of the same document) plus a "diagonal" of the row's own keys, here all B slots at every
slot (non-causal). ``tests/test_dflash.py`` checks the batched form against the draft run with
its own cache, block by block, as vLLM serves it.

Differences from speculators' DFlash trainer (which samples up to 512 anchors per sequence and
weights slots by D-PACE or exp(-(k-1)/gamma)): every counted row is an anchor and the slots are
weighted ``train.loss.step_decay**(k-1)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from eagle3.device import sdpa
from eagle3.draft.families.base import DraftFamily, Proposal, Proposer, register
from eagle3.draft.formats import (
    DFLASH_ARCHITECTURE,
    MARKER,
    DraftFormatError,
    LoadedDraft,
    checked_ids,
    draft_config_from_json,
    fill_draft,
    is_id_list,
    layer_config,
    our_meta,
)
from eagle3.draft.losses import SOFT_CE, Objective
from eagle3.draft.model import (
    MLP,
    DraftConfig,
    DraftHead,
    KVCache,
    RMSNorm,
    apply_rope,
    gather_rows,
    rope_cos_sin,
)
from eagle3.draft.spec import KEY, DraftSpec
from eagle3.draft.ttt import (
    RowLayout,
    StepTally,
    TTTOutput,
    TTTTargets,
    checked_weights,
    layout_of,
    step0_attention_mask,
    step_input_ids,
    step_loss,
    ttt_attention,
)
from eagle3.errors import ConfigError, TrainError

if TYPE_CHECKING:
    from eagle3.config import SamplingConfig


class DFlashAttention(nn.Module):
    """q/k/v/o projections with Qwen3's per-head q_norm/k_norm; context keys use the same k_proj."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        assert d is not None
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, S, H] (normed) -> rotated keys and values [B, S, nkv, d]."""
        b, s, _ = x.shape
        k = apply_rope(self.k_norm(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)), cos, sin)
        return k, self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)

    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        return apply_rope(self.q_norm(self.q_proj(x).view(b, s, self.num_heads, self.head_dim)), cos, sin)


class DFlashLayer(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = MLP(h, config.intermediate_size)


class DFlashDraft(DraftHead, nn.Module):
    """A DFlash draft (``config.block_size`` and ``config.mask_token_id`` set). Tensor names are
    the ones vLLM's ``DFlashDraftModel`` loads."""

    def __init__(self, config: DraftConfig, embed_tokens_weight: Tensor | None = None) -> None:
        super().__init__()
        if config.family != "dflash":
            raise ValueError(f"draft.family={config.family}: a DFlash draft's config names the dflash family")
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.requires_grad_(False)
        self.fc = nn.Linear(config.num_aux_layers * config.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_layers)])
        self.finish_head(embed_tokens_weight)

    @property
    def block_size(self) -> int:
        assert self.config.block_size is not None
        return self.config.block_size

    def context(self, aux: Tensor) -> Tensor:
        """aux [B, S, A, H_t] -> the context states every layer's keys read, [B, S, H]."""
        return self.hidden_norm(self.fc(aux.flatten(-2)))

    def run_block(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Sequence) -> Tensor:
        """Block embeddings x [B, Q, H] through the layers; ``attend[i](q, k, v)`` is layer i's
        attention of the block's rotated q/k/v over the context and the block. -> pre-norm [B, Q, H]"""
        b, q_len, _ = x.shape
        for layer, attend_i in zip(self.layers, attend, strict=True):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            k, v = attn.keys(h, cos, sin)
            out = attend_i(attn.queries(h, cos, sin), k, v)  # [B, Q, nh, d]
            x = x + attn.o_proj(out.reshape(b, q_len, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    # -- serving

    def add_context(self, aux: Tensor, position_ids: Tensor, cache: KVCache) -> None:
        """Append verified tokens' context keys/values (aux [1, C, A, H_t], positions [1, C]) to ``cache``."""
        ctx = self.context(aux.to(self.fc.weight.dtype))
        cos, sin = rope_cos_sin(self.config, position_ids, ctx.dtype)
        for i, layer in enumerate(self.layers):
            cache.update(i, *layer.self_attn.keys(ctx, cos, sin))

    def propose(self, input_ids: Tensor, position_ids: Tensor, cache: KVCache) -> Tensor:
        """One block (the bonus token then mask tokens, ids/positions [1, Q]) over the cached context,
        non-causal; ``cache`` is not changed. -> logits [1, Q, Vd] (slot k's is draft token k). Serve
        the trained block (Q = ``block_size``): every slot sees every other, so a shorter block
        changes every slot's logits."""
        x = self.embed(input_ids)
        cos, sin = rope_cos_sin(self.config, position_ids, x.dtype)

        def attend_for(i: int):
            def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                keys, values = torch.cat([cache.keys[i], k], dim=1), torch.cat([cache.values[i], v], dim=1)
                out = sdpa(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                           enable_gqa=keys.shape[2] != q.shape[2])
                return out.transpose(1, 2)
            return attend

        return self.compute_logits(self.run_block(x, cos, sin, [attend_for(i) for i in range(len(self.layers))]))


def dflash_forward(draft: DFlashDraft, input_ids: Tensor, aux: Tensor, position_ids: Tensor, document_ids: Tensor,
                   loss_mask: Tensor, targets: TTTTargets, *, num_steps: int = 7,
                   weights: Sequence[float] | Tensor | None = None, gradient_checkpointing: bool = False,
                   return_logits: bool = False, loss_on_oov: bool = False, skip_unread_rows: bool = True,
                   gate_steps: bool = False, objective: Objective = SOFT_CE,
                   layout: RowLayout | None = None) -> TTTOutput:
    """The DFlash block at every row at once (module docstring): :func:`eagle3.draft.ttt.ttt_forward`'s
    inputs and output, step k being slot k + 1. Tensors: ids/positions/documents/mask [B, S],
    aux [B, S, A, H_t]. ``gradient_checkpointing`` is not applied (one block, no unroll to replay)."""
    if not 1 <= num_steps <= draft.block_size - 1:
        raise ValueError(f"num_steps={num_steps}: the DFlash block proposes 1..{draft.block_size - 1} tokens")
    w = checked_weights(num_steps, weights)
    mask0 = step0_attention_mask(document_ids)  # [B, S, S]: row t sees context rows s <= t
    layout = layout_of(layout, loss_mask, document_ids, num_steps, skip_unread_rows and not return_logits)
    at, live = layout.at, layout.live
    rows = (lambda x: x) if at is None else (lambda x: gather_rows(x, at))
    b = input_ids.shape[0]
    r = input_ids.shape[1] if at is None else at.shape[1]
    # the whole trained block (the bonus slot and block_size - 1 masks) always: inside the block attention
    # goes both ways, so a shorter one would be another model; steps past num_steps are not scored
    slots = draft.block_size

    # block inputs, slot-major: [B, slots * R]
    bonus = rows(step_input_ids(input_ids, 0))  # x[t+1]
    ids = torch.cat([bonus, torch.full((b, (slots - 1) * r), draft.config.mask_token_id, dtype=bonus.dtype,
                                       device=bonus.device)], dim=1)
    base = rows(position_ids) + 1
    positions = torch.cat([base + j for j in range(slots)], dim=1)
    window = rows(mask0).repeat(1, slots, 1)  # [B, slots * R, S]

    ctx = draft.context(aux)
    ctx_cos, ctx_sin = rope_cos_sin(draft.config, position_ids, ctx.dtype)

    def attend_for(layer: DFlashLayer):
        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            context = layer.self_attn.keys(ctx, ctx_cos, ctx_sin)  # [B, S, nkv, d] each
            # every slot sees every slot of its own row: slot j's key, repeated for each query slot
            block = [(k[:, j * r:(j + 1) * r].repeat(1, slots, 1, 1), v[:, j * r:(j + 1) * r].repeat(1, slots, 1, 1))
                     for j in range(slots)]
            return ttt_attention(q, context, block, window)
        return attend

    x = draft.embed(ids)
    cos, sin = rope_cos_sin(draft.config, positions, x.dtype)
    prenorm = draft.run_block(x, cos, sin, [attend_for(layer) for layer in draft.layers])  # [B, slots*R, H]

    tally = StepTally(w, loss_mask, document_ids, targets, draft.t2d, loss_on_oov=loss_on_oov,
                      gate_steps=gate_steps, at=at, live=live)
    for k in range(num_steps):
        trained_k = tally.step(k)  # [B, R]
        out_k = prenorm[:, (k + 1) * r:(k + 2) * r]  # [B, R, H]: slot k + 1
        tally.add(*step_loss(draft, out_k, k, trained_k, layout.counted[k], at, targets, input_ids, return_logits,
                             objective))
    return tally.output(return_logits)


def dflash_config(config: DraftConfig, aux_layer_ids: Sequence[int], torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json of a DFlash draft as vLLM's ``DFlashDraftModel`` reads it: a Qwen3 config, the
    block size, and ``dflash_config`` whose ``target_layer_ids`` name layer *outputs* (our aux ids,
    which name layer inputs, minus one); ``causal: false`` (the block attends both ways) and
    ``rope_theta`` written explicitly (vLLM assumes 1e6 when it is absent)."""
    ids = checked_ids(aux_layer_ids, config)
    if ids[0] < 1:
        raise DraftFormatError(f"aux layer ids {ids}: DFlash names layer outputs, so it cannot read the input of "
                               "layer 0 (the embedding output)")
    layer = layer_config(config, torch_dtype)
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        **layer,
        "model_type": "qwen3",
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "num_aux_hidden_states": len(ids),
        "block_size": config.block_size,
        "num_speculative_tokens": (config.block_size or 2) - 1,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": [i - 1 for i in ids],
                          "causal": False},
        MARKER: {"format": "vllm", "aux_layer_ids": ids, "family": "dflash"},
    }



@dataclass
class DFlashSpec(DraftSpec):
    """A DFlash draft's ``train.draft`` section: the common shape, and its block."""

    block_size: int | None = None
    """Slots of the block one forward fills: the newest token, then ``block_size - 1`` proposals.
    vLLM serves the block whole (``num_speculative_tokens = block_size - 1``: its attention goes both
    ways, so another size is another model). Training scores the block's first ``train.ttt_steps``
    proposals. None: ``train.ttt_steps + 1``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size is not None and self.block_size < 2:
            raise ConfigError(f"{KEY}.block_size={self.block_size}: must be >= 2 (the newest token and at least "
                              "one proposal)")

    def check_steps(self, steps: int) -> None:
        super().check_steps(steps)
        if self.block_size is not None and self.block_size - 1 < steps:
            raise ConfigError(f"{KEY}.block_size={self.block_size}: proposes {self.block_size - 1} tokens, fewer "
                              f"than train.ttt_steps={steps} trains (at least {steps + 1}, or null: ttt_steps + 1)")


class DFlashFamily(DraftFamily):
    name = "dflash"
    reads_mask_token = True
    architectures = (DFLASH_ARCHITECTURE,)

    spec_class = DFlashSpec
    splits_rows = False  # its blocks attend to the context in their own way: a row trains on one rank
    recomputes_steps = False  # one block, not an unroll to recompute step by step
    starts_from_readout = False  # random layers

    def check_config(self, config: DraftConfig) -> None:
        if config.block_size is None or config.block_size < 2 or config.mask_token_id is None:
            raise ConfigError(f"draft.block_size={config.block_size}: a DFlash draft needs block_size >= 2 and a "
                             "mask_token_id")
        if config.sliding_window is not None:
            raise ConfigError(f"draft.sliding_window={config.sliding_window}: a DFlash draft's block attends over the "
                             "whole context; sliding windows are for eagle3 and peagle drafts")

    def shape(self, spec: DraftSpec, steps: int) -> dict[str, Any]:
        # EAGLE-3's layer variants do not apply
        return {"block_size": getattr(spec, "block_size", None) or steps + 1}

    def build(self, config: DraftConfig, embed_tokens_weight: Tensor | None = None) -> DFlashDraft:
        return DFlashDraft(config, embed_tokens_weight)

    def parameter_count(self, config: DraftConfig) -> int:
        h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        per_layer = h * (q + 2 * kv) + q * h + 2 * d + 2 * h + 3 * h * i  # q/k/v/o, q_norm, k_norm, 2 norms, SwiGLU
        return (config.num_aux_layers * config.target_hidden_size * h + h + config.num_layers * per_layer
                + h + config.draft_vocab_size * h)  # fc, hidden_norm, the layers, the final norm, lm_head

    def adopt(self, draft: DraftHead, source: str, mask_token_id: int | None, steps: int) -> DraftHead:
        draft = super().adopt(draft, source, mask_token_id, steps)
        if draft.config.block_size - 1 < steps:
            raise TrainError(f"train.ttt_steps={steps}: the init draft's DFlash block proposes "
                             f"{draft.config.block_size - 1} tokens")
        return draft

    def forward(self, draft: Any, *args: Any, **kwargs: Any) -> TTTOutput:
        return dflash_forward(draft, *args, **kwargs)

    def proposer(self, draft: Any, cache: Any, spec: Any) -> Proposer:
        if spec.mode != "chain":
            raise ConfigError(f"a {self.name} draft proposes a chain in one forward: mode=tree is not supported")
        if spec.k > draft.block_size - 1:
            raise ConfigError(f"k={spec.k}: the DFlash draft's block proposes at most {draft.block_size - 1} tokens")
        return BlockProposer(draft, cache, spec)

    def vllm_speculative_config(self, engine_cfg: dict[str, Any], k: int) -> dict[str, Any] | None:
        """Always the trained block, whatever ``k``: vLLM runs a block of 1 + K, and another block is
        another model (its attention goes both ways)."""
        if (engine_cfg.get("speculators_model_type") == "dflash"
                or DFLASH_ARCHITECTURE in (engine_cfg.get("architectures") or [])):
            return {"method": "dflash", "num_speculative_tokens": int(engine_cfg["block_size"]) - 1}
        return None

    def engine_config(self, config: DraftConfig, aux_layer_ids: Any, fmt: str, dtype: str,
                      **speculators: Any) -> dict[str, Any]:
        self.vllm_only(config, fmt)
        return dflash_config(config, aux_layer_ids, dtype)

    def load_folder(self, folder: Path, cfg: dict[str, Any], tensors: dict[str, Tensor],
                    embed_tokens_weight: Tensor | None) -> Any:
        """A ``DFlashDraftModel`` folder (vLLM's layout: dflash_config.target_layer_ids name layer outputs)."""
        where = folder / "config.json"
        options = cfg.get("dflash_config") or {}
        tensors = {k[len("model."):] if k.startswith("model.") else k: v for k, v in tensors.items()}
        # causality as vLLM resolves it: is_causal, then dflash_config.causal, then sliding layers
        causal = cfg.get("is_causal", options.get("causal"))
        sliding = options.get("use_swa") or "sliding_attention" in (cfg.get("layer_types") or [])
        if causal or sliding or (causal is None and sliding):
            raise DraftFormatError(f"{where}: a causal or sliding-window DFlash draft is not supported (only the "
                                   "non-causal block of full-attention layers)")
        ids = options.get("target_layer_ids")
        if not is_id_list(ids) or options.get("mask_token_id") is None:
            raise DraftFormatError(f"{where}: dflash_config needs target_layer_ids (a list of ints) and mask_token_id")
        aux = tuple(sorted(int(i) + 1 for i in ids))  # vLLM captures them in ascending order
        plain = {k: v for k, v in cfg.items() if k != "dflash_config"}
        if plain.get("rope_theta") is None and not (plain.get("rope_parameters") or {}).get("rope_theta"):
            plain["rope_theta"] = 1e6  # vLLM's default for a DFlash draft without one
        base = draft_config_from_json(plain, "vllm", where, len(aux))
        block = cfg.get("block_size") or (cfg.get("num_speculative_tokens") or 0) + 1
        try:
            config = DraftConfig(**{**asdict(base), "mask_token_id": int(options["mask_token_id"]),
                                    "block_size": int(block), "family": self.name})
            self.check_config(config)
        except (TypeError, ValueError) as err:
            raise DraftFormatError(f"{where}: {err} (the block: block_size, or num_speculative_tokens + 1)") from None
        draft = self.build(config, None if "embed_tokens.weight" in tensors else embed_tokens_weight)
        d2t = tensors.pop("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64)).long()
        tensors.pop("t2d", None)
        target_ids = torch.arange(len(d2t)) + d2t
        outside = bool(((target_ids < 0) | (target_ids >= config.vocab_size)).any())
        if d2t.shape != (config.draft_vocab_size,) or outside:
            raise DraftFormatError(f"{folder}: d2t {tuple(d2t.shape)} does not map draft_vocab_size="
                                   f"{config.draft_vocab_size} ids into the vocabulary of {config.vocab_size}")
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[target_ids] = True
        if "lm_head.weight" not in tensors:
            raise DraftFormatError(f"{folder}: no lm_head.weight (a DFlash draft has its own head)")
        fill_draft(draft, tensors, d2t, t2d, folder)
        return LoadedDraft(draft=draft, aux_layer_ids=aux, format="vllm", path=folder,  # type: ignore[arg-type]
                           meta=our_meta(folder), has_embedding="embed_tokens.weight" in tensors, has_lm_head=True)


class BlockProposer(Proposer):
    """DFlash serving: the catch-up rows' context keys into the draft cache, then the trained block (the
    newest token and block_size - 1 mask tokens, attending both ways); its first k mask slots are the
    proposal. The block itself never enters the cache."""

    one_forward = True

    def propose(self, aux: Tensor, tokens: list[int], start: int, k: int, params: SamplingConfig,
                g: torch.Generator | None) -> Proposal:
        return self.draw_each(self.proposal_logits(aux, tokens, start, k), params, g)

    def proposal_logits(self, aux: Tensor, tokens: list[int], start: int, k: int) -> Tensor:
        d = self.draft
        end, size = start + len(tokens), d.block_size
        d.add_context(aux, torch.arange(start, end, device=self.device)[None], self.cache)
        block = torch.tensor([[tokens[-1]] + [d.config.mask_token_id] * (size - 1)], device=self.device)
        logits = d.propose(block, torch.arange(end, end + size, device=self.device)[None], self.cache)
        return logits[0, 1:1 + k]  # [k, Vd]: the first k mask slots


DFLASH = register(DFlashFamily())

__all__ = ["DFLASH", "BlockProposer", "DFlashDraft", "DFlashFamily", "DFlashSpec", "dflash_forward"]
