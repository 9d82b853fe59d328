"""The P-EAGLE family (parallel drafting): an EAGLE-3 draft whose steps after the first read a mask
token and a learned mask state (``mask_hidden``) instead of the previous step, so one forward over
the context rows and k - 1 mask rows proposes k tokens. vLLM serves it as EAGLE-3 with
``parallel_drafting`` (not SGLang)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from eagle3.distributed import print0
from eagle3.draft.families.base import Proposal, Proposer, register
from eagle3.draft.families.eagle3 import Eagle3Family
from eagle3.draft.formats import vllm_config
from eagle3.draft.model import DraftConfig, DraftHead, Eagle3Draft
from eagle3.draft.ttt import TTTOutput, ttt_forward
from eagle3.errors import ConfigError, TrainError

if TYPE_CHECKING:
    from eagle3.config import SamplingConfig


def mask_feed(draft: Eagle3Draft):
    """TTT's inputs of steps >= 1 for a P-EAGLE draft: the mask token and the mask state."""
    def feed(k: int, ids: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        return draft.mask_inputs(tuple(ids.shape), hidden.dtype, ids.device)
    return feed


class PEagleFamily(Eagle3Family):
    name = "peagle"
    reads_mask_token = True
    replays_steps = False  # one forward proposes the round

    def adopt(self, draft: DraftHead, source: str, mask_token_id: int | None, steps: int) -> DraftHead:
        """An eagle3 ``train.init.draft`` becomes a P-EAGLE draft: the same weights, a fresh mask state."""
        if draft.config.family == "eagle3":
            out = Eagle3Draft(replace(draft.config, family=self.name, mask_token_id=mask_token_id))
            missing, unexpected = out.load_state_dict(draft.state_dict(), strict=False)
            assert missing == ["mask_hidden"] and not unexpected, (missing, unexpected)
            print0(f"train.init.draft: the eagle3 draft becomes a P-EAGLE draft (mask token {mask_token_id}, fresh "
                   "mask state)")
            return out
        if draft.config.family != self.name:
            raise TrainError(f"train.init.draft: {source} is a {draft.config.family} draft; set "
                             f"train.draft.family={draft.config.family}")
        return draft

    def forward(self, draft: Any, *args: Any, **kwargs: Any) -> TTTOutput:
        return ttt_forward(draft, *args, step_inputs=mask_feed(draft), **kwargs)

    def proposer(self, draft: Any, cache: Any, spec: Any) -> Proposer:
        if spec.mode != "chain":
            raise ConfigError(f"a {self.name} draft proposes a chain in one forward: mode=tree is not supported")
        return MaskRowsProposer(draft, cache, spec)

    def vllm_speculative_config(self, engine_cfg: dict[str, Any], k: int) -> dict[str, Any] | None:
        """Ours (``parallel_drafting`` in config.json) at ``k``; speculators' (``speculators_model_type``
        peagle) at the depth it trained, as vLLM serves it alone."""
        if engine_cfg.get("speculators_model_type") == "peagle":
            methods = engine_cfg["speculators_config"]["proposal_methods"]
            return {"method": "eagle3", "parallel_drafting": True,
                    "num_speculative_tokens": int(methods[0]["speculative_tokens"])}
        if engine_cfg.get("parallel_drafting"):
            return {"method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": k}
        return None

    def engine_config(self, config: DraftConfig, aux_layer_ids: Any, fmt: str, dtype: str,
                      **speculators: Any) -> dict[str, Any]:
        """vLLM's EAGLE-3 config with the top-level ``mask_token_id`` it reads and ``parallel_drafting``
        (it is served with ``speculative_config={"method": "eagle3", "parallel_drafting": true}``)."""
        self.vllm_only(config, fmt)
        return {"parallel_drafting": True, "mask_token_id": config.mask_token_id,
                **vllm_config(config, aux_layer_ids, dtype)}


class MaskRowsProposer(Proposer):
    """P-EAGLE serving: the catch-up rows and k - 1 mask rows in one causal forward; the last catch-up
    row's logits and the mask rows' are the k draft tokens' (the mask rows leave the cache at the
    round's rollback)."""

    one_forward = True

    def propose(self, aux: Tensor, tokens: list[int], start: int, k: int, params: SamplingConfig,
                g: torch.Generator | None) -> Proposal:
        return self.draw_each(self.proposal_logits(aux, tokens, start, k), params, g)

    def proposal_logits(self, aux: Tensor, tokens: list[int], start: int, k: int) -> Tensor:
        d, masks = self.draft, max(k - 1, 0)
        hidden = d.combine_aux(aux.to(d.fc.weight.dtype))  # [1, R, H]
        ids = torch.tensor([tokens], device=self.device)
        if masks:
            mask_ids, mask_states = d.mask_inputs((1, masks), hidden.dtype, self.device)
            hidden, ids = torch.cat([hidden, mask_states], dim=1), torch.cat([ids, mask_ids], dim=1)
        pos = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        _, logits = d(ids, hidden, pos, self.cache)
        return logits[0, -1 - masks:]  # [k, Vd]: the last catch-up row's, then the mask rows'


PEAGLE = register(PEagleFamily())

__all__ = ["PEAGLE", "MaskRowsProposer", "PEagleFamily", "mask_feed"]
