"""The EAGLE-3 family: each draft step reads the previous one's state (:mod:`eagle3.draft.model`), trained
by the TTT unroll (:mod:`eagle3.draft.ttt`), served as a chain (one draft step per token) or an EAGLE-2
dynamic tree, exported in every engine format (vLLM, SGLang, speculators)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from eagle3.draft.families.base import DraftFamily, Proposal, Proposer, register
from eagle3.draft.formats import DraftFormatError, sglang_config, speculators_config, vllm_config
from eagle3.draft.model import DraftConfig, Eagle3Draft
from eagle3.draft.ttt import TTTOutput, ttt_forward
from eagle3.errors import ConfigError

if TYPE_CHECKING:
    from eagle3.config import SamplingConfig
    from eagle3.draft.spec import DraftSpec

LAYER_VARIANTS = {"eagle3": {}, "speculators": {"norm_before_residual": True, "norm_before_fc": True,
                                                "norm_output": True},
                  "eagle3.1": {"fc_norm": True, "norm_output": True}}
"""``train.draft.variant`` -> the layer's flags (EAGLE-3's own layer, speculators 0.9.0's, EAGLE-3.1's)."""


def eagle3_parameter_count(config: DraftConfig) -> int:
    """Closed form of an :class:`Eagle3Draft`'s trainable parameters (all but the frozen embedding and d2t/t2d)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d

    def layer(width: int, norms: int) -> int:  # q/k/v from `width`, o_proj, SwiGLU, RMSNorm weights
        return width * (q + 2 * kv) + q * h + 3 * h * i + norms * h

    mask_state = config.mask_token_id is not None  # P-EAGLE's mask_hidden
    fc = config.num_aux_layers * config.target_hidden_size * (h + config.norm_before_fc + config.fc_norm + mask_state)
    first = layer(2 * h, 3)  # input_layernorm, hidden_norm, post_attention_layernorm
    rest = (config.num_layers - 1) * layer(h, 2)
    return fc + first + rest + h + config.draft_vocab_size * h  # + final norm + lm_head


class Eagle3Family(DraftFamily):
    name = "eagle3"
    replays_steps = True

    def check_config(self, config: DraftConfig) -> None:
        if config.block_size is not None or (config.mask_token_id is not None) != self.reads_mask_token:
            raise ConfigError(f"draft.family={config.family}: block_size={config.block_size}, mask_token_id="
                             f"{config.mask_token_id} do not fit it (eagle3: neither; peagle: a mask token; "
                             "dflash: both)")

    def shape(self, spec: DraftSpec, steps: int) -> dict[str, Any]:
        return dict(LAYER_VARIANTS[spec.variant])

    def build(self, config: DraftConfig, embed_tokens_weight: Tensor | None = None) -> Eagle3Draft:
        return Eagle3Draft(config, embed_tokens_weight)

    def parameter_count(self, config: DraftConfig) -> int:
        return eagle3_parameter_count(config)

    def forward(self, draft: Any, *args: Any, **kwargs: Any) -> TTTOutput:
        return ttt_forward(draft, *args, **kwargs)

    def proposer(self, draft: Any, cache: Any, spec: Any) -> Proposer:
        return StepProposer(draft, cache, spec)

    def vllm_speculative_config(self, engine_cfg: dict[str, Any], k: int) -> dict[str, Any] | None:
        return {"method": "eagle3", "num_speculative_tokens": k}  # any EAGLE-3 layout: vLLM reads the folder

    def engine_config(self, config: DraftConfig, aux_layer_ids: Any, fmt: str, dtype: str,
                      **speculators: Any) -> dict[str, Any]:
        if fmt == "vllm":
            return vllm_config(config, aux_layer_ids, dtype)
        if fmt == "sglang":
            return sglang_config(config, aux_layer_ids, dtype)
        if not speculators.get("verifier"):
            raise DraftFormatError("the speculators format needs the verifier (the target's name or path)")
        return speculators_config(config, aux_layer_ids, torch_dtype=dtype, **speculators)


class StepProposer(Proposer):
    """EAGLE-3 serving: the catch-up rows in one forward give the root state; then a chain of one draft
    step per token, or an EAGLE-2 dynamic tree (the best ``topk`` nodes of each depth expanded by
    cumulative log-prob in one forward under a tree mask; the best ``budget`` nodes kept)."""

    def propose(self, aux: Tensor, tokens: list[int], start: int, k: int, params: SamplingConfig,
                g: torch.Generator | None) -> Proposal:
        state, logits = self.catch_up(aux, tokens, start)
        n = start + len(tokens)  # tokens in the target's cache; the newest emitted one sits at n
        if self.spec.mode == "tree":
            return self.tree(state, logits, n)
        return self.chain(state, logits, n, k, params, g)

    def catch_up(self, aux: Tensor, tokens: list[int], start: int) -> tuple[Tensor, Tensor]:
        """Rows ``start..`` through the draft in one forward -> the root: the last row's state
        [1, 1, H] and logits [1, Vd]."""
        d = self.draft
        hidden = d.combine_aux(aux.to(d.fc.weight.dtype))  # [1, R, H]
        ids = torch.tensor([tokens], device=self.device)
        pos = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        state, logits = d(ids, hidden, pos, self.cache)
        return state[:, -1:], logits[0, -1:]

    def step(self, token: int, state: Tensor, position: int) -> tuple[Tensor, Tensor]:
        """One draft step over the cache -> (state [1, 1, H], logits [1, Vd])."""
        ids, pos = torch.tensor([[token]], device=self.device), torch.tensor([[position]], device=self.device)
        return self.cache.step(ids, state, pos)

    def chain(self, state: Tensor, logits: Tensor, n: int, k: int, params: SamplingConfig,
              g: torch.Generator | None) -> Proposal:
        """k tokens, each drawn from the draft's distribution after the previous one (state [1, 1, H],
        logits [1, Vd] at the root)."""
        tokens, qs = [], []
        first_p = None
        for depth in range(1, k + 1):
            token, q = self.draw(logits[0], params, g)
            tokens.append(token)
            if depth == 1:
                first_p = self.probability(self.target_logits(logits[0]), token)
            if q is not None:
                qs.append(q)
            if depth < k:
                state, logits = self.step(token, state, n - 1 + depth)
        return Proposal(tokens, list(range(-1, len(tokens) - 1)), torch.stack(qs) if qs else None, first_p)

    def tree(self, root_state: Tensor, root_logits: Tensor, n: int) -> Proposal:
        """EAGLE-2 dynamic tree: deterministic top-k children, expanded by cumulative log-prob."""
        topk, past, depth_k = self.spec.topk, len(self.cache), self.spec.k
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        cache_row: dict[int, int] = {}  # node -> its row in the draft cache (expanded nodes only)
        frontier = [(-1, root_state[0, 0], root_logits[0], 0.0)]  # (node, state [H], logits [Vd], score)
        for depth in range(1, depth_k + 1):
            children = []
            # every frontier node's top-k in one pass (one read back to the host per depth)
            logp = torch.log_softmax(self.target_logits(torch.stack([f[2] for f in frontier])).float(), dim=-1)
            best = logp.topk(topk, dim=-1)  # [F, topk]
            values, ids = torch.stack([best.values.double(), best.indices.double()]).tolist()  # exact in float64
            for (node, _state, _logits, score), lps, row_ids in zip(frontier, values, ids, strict=True):
                for lp, token in zip(lps, row_ids, strict=True):
                    tokens.append(int(token))
                    parents.append(node)
                    scores.append(score + lp)
                    children.append(len(tokens) - 1)
            if depth == depth_k:
                break
            # expand the best `topk` of this depth's nodes in one draft forward (tree mask)
            chosen = sorted(children, key=lambda i: -scores[i])[:topk]
            rows = len(self.cache)
            mask = torch.zeros(len(chosen), self.cache.mask_width(len(chosen)), dtype=torch.bool)  # on the host
            mask[:, :past] = True
            for r, node in enumerate(chosen):
                mask[r, rows + r] = True
                ancestor = parents[node]
                while ancestor >= 0:
                    mask[r, cache_row[ancestor]] = True
                    ancestor = parents[ancestor]
            mask = mask.to(self.device)
            fed = {node: state for node, state, _, _ in frontier}  # a child is fed its parent's output state
            states = torch.stack([fed[parents[node]] for node in chosen])[None]  # [1, C, H]
            ids_t = torch.tensor([[tokens[i] for i in chosen]], device=self.device)
            pos = torch.full((1, len(chosen)), n - 1 + depth, device=self.device)
            new_states, new_logits = self.cache.tree_step(ids_t, states, pos, mask)
            for r, node in enumerate(chosen):
                cache_row[node] = rows + r
            frontier = [(node, new_states[0, r], new_logits[0, r], scores[node]) for r, node in enumerate(chosen)]
        # keep the best `budget` nodes; a child never outscores its parent, so ancestors stay
        keep = sorted(sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[: self.spec.budget])
        index = {old: new for new, old in enumerate(keep)}
        return Proposal([tokens[i] for i in keep], [index[parents[i]] if parents[i] >= 0 else -1 for i in keep],
                        first_p=math.exp(scores[0]))  # node 0: the root's most likely child


EAGLE3 = register(Eagle3Family())

__all__ = ["EAGLE3", "LAYER_VARIANTS", "Eagle3Family", "StepProposer", "eagle3_parameter_count"]
