"""The target's frozen head in the trainer: stored pre-norm states -> the target's next-token
distribution over the draft vocabulary (the TTT targets), computed only where a loss reads it."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from eagle3.device import bf16_matmul_speedup
from eagle3.draft.targets import TTTTargets, prepare_targets, prepare_targets_from_topk
from eagle3.target.model import LogitTransform, Target


class TargetHead(nn.Module):
    """The target's frozen final norm + lm_head (+ logit transform): stored pre-norm states -> its distribution."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, transform: LogitTransform | None = None,
                 temperature: float = 1.0) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"target temperature {temperature}: must be > 0")
        self.norm, self.lm_head = norm, lm_head
        self.transform = transform or LogitTransform()
        self.temperature = temperature  # divides the (transformed) logits of the distribution, not the argmax
        self.requires_grad_(False)
        self._split: tuple[Any, ...] | None = None
        self._split_pays = True  # turned off when most rows need the full product anyway
        self._vd: tuple[Tensor, int, int, Tensor] | None = None

    @torch.no_grad()
    def targets(self, batch: dict[str, Tensor], t2d: Tensor, chunk_tokens: int = 1024,
                rows: Tensor | None = None) -> TTTTargets:
        """TTT targets [B, S, Vd] for a batch with ``last`` [B, S, H] or ``topk_ids``/``topk_logprobs``.

        The target's distribution p[t] (over x[t+1]) is only ever read where x[t+1] is a
        loss-masked token of the same document (every step's loss and metrics are gated by
        that, see :func:`eagle3.draft.ttt.step_counted`), so the head runs on those rows only
        (``rows``: :func:`needed_rows` of the batch, worked out where it was built; else here), in
        chunks: the full-vocab logits never exist for the whole batch. Other rows get zero
        probabilities and argmax -1 (never counted).
        """
        if "last" not in batch:
            return prepare_targets_from_topk(batch["topk_ids"], batch["topk_logprobs"], t2d, self.temperature,
                                             self._draft_vocab(t2d)[0])
        from_host = rows is not None  # the trainer's path, where the device is never asked for a count
        last = batch["last"]  # [B, S, H]
        b, s, h = last.shape
        if rows is None:
            rows = needed_rows(batch["loss_mask"], batch["document_ids"])  # [N]
        flat = last.reshape(b * s, h)[rows].to(self.lm_head.weight.dtype)  # [N, H]
        vd, draft_ids = self._draft_vocab(t2d)
        probs = torch.zeros(b * s, vd, dtype=torch.float32, device=last.device)  # [B*S, Vd]
        argmax = torch.full((b * s,), -1, dtype=torch.long, device=last.device)  # [B*S]
        for i in range(0, len(rows), chunk_tokens):
            x = self.norm(flat[i:i + chunk_tokens])
            # the rough pass is bf16; settling it asks the device for a count (a sync outside the CPU)
            split = (self._split_pays and self.lm_head.weight.dtype == torch.float32
                     and not (from_host and x.device.type != "cpu")
                     and getattr(self.lm_head, "bias", None) is None and bf16_matmul_speedup(x.device.type) > 1.0)
            part = (self._split_targets(x, t2d) if split
                    else prepare_targets(self.transform(self.lm_head(x)), draft_ids, temperature=self.temperature))
            probs[rows[i:i + chunk_tokens]] = part.probs
            argmax[rows[i:i + chunk_tokens]] = part.argmax
        return TTTTargets(probs=probs.view(b, s, vd), argmax=argmax.view(b, s))

    def _draft_vocab(self, t2d: Tensor) -> tuple[int, Tensor]:
        """The draft vocab's size and its [Vd] target ids, read from the device once per draft vocab
        (the trainer passes the same ``t2d`` every step)."""
        if t2d.dtype != torch.bool:
            raise TypeError(f"t2d: a [V] bool mask of the draft vocab, not {t2d.dtype}")
        # changed by an in-place write (set_draft_vocab, load_state_dict); inference tensors have none
        version = -1 if t2d.is_inference() else t2d._version
        if self._vd is None or self._vd[0] is not t2d or self._vd[1] != version:
            ids = t2d.nonzero().squeeze(1)
            self._vd = (t2d, version, len(ids), ids)
        return self._vd[2], self._vd[3]

    @classmethod
    def of_target(cls, target: Target, temperature: float = 1.0) -> TargetHead:
        """A copy of ``target``'s head (the target itself can then be freed). The capture hook on
        the target's norm is dropped: copying it would copy the whole target through the hook."""
        memo = {id(target): target}
        norm, lm_head = copy.deepcopy(target.norm, memo), copy.deepcopy(target.lm_head, memo)
        for module in (norm, lm_head):
            module._forward_pre_hooks.clear()
            module._forward_pre_hooks_with_kwargs.clear()
        return cls(norm, lm_head, target.logit_transform, temperature)

    def _split_targets(self, x: Tensor, t2d: Tensor, groups: int = 16) -> TTTTargets:
        """:func:`prepare_targets` of ``lm_head(x)`` (fp32) without most of the full-vocab product.

        The distribution needs only the draft-vocab rows of the head, computed in fp32 as
        before. The argmax needs the rest only to learn whether some token outside the draft
        vocab beats the best one inside: those logits are computed in bf16 (several times
        faster on CPUs with bf16 units; used only where bf16 is measured faster, see
        :func:`eagle3.device.bf16_matmul_speedup`) with a rigorous bound on their error,
        ``|bf16 - fp32| <= c * |x| * |w_j|`` (bf16 rounding of both operands and of the
        result, fp32 accumulation, Cauchy-Schwarz), taken per group of outside rows of similar
        norm; only the rows the bound cannot settle (~7% on the default target) get their
        outside logits recomputed in fp32. The result equals ``prepare_targets``'s, ties
        included (the lower token id wins, as in ``argmax``); the argmax is taken before the
        target's logit transform (increasing), so only logits a soft cap rounds to equal
        values could order differently.
        """
        w = self.lm_head.weight  # [V, H]
        in_ids = self._draft_vocab(t2d)[1].to(w.device)  # [Vd] target ids (read once per draft vocab)
        if self._split is None or self._split[0] is not self._vd:  # built for this draft vocab
            inside = t2d.to(w.device)
            outside = (~inside).nonzero().squeeze(1)  # [Vo] target ids
            norms = w[outside].norm(dim=-1)
            order = norms.argsort(descending=True)  # groups of similar norm: a tighter bound per group
            outside, norms = outside[order], norms[order]
            w_out = w[outside].contiguous()  # [Vo, H]
            edges = torch.linspace(0, len(outside), groups + 1).long().tolist()
            cuts = [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True) if hi > lo]
            group_norm = torch.stack([norms[lo:hi].max() for lo, hi in cuts]) if cuts else norms[:0]
            self._split = (self._vd, in_ids, outside, w[in_ids].contiguous(), w_out,
                           w_out.bfloat16(), group_norm, cuts)
        _, in_ids, out_ids, w_in, w_out, w_out_bf16, group_norm, cuts = self._split
        logits_in = x @ w_in.T  # [N, Vd] fp32, before the transform (increasing: the argmax logic holds)
        probs = torch.nan_to_num(torch.softmax(self.transform(logits_in) / self.temperature, dim=-1), nan=0.0)
        best_in, arg_in = logits_in.max(-1)  # [N]: the first maximum, i.e. the lowest id
        id_in = in_ids[arg_in]
        if len(out_ids) == 0:
            return TTTTargets(probs=probs, argmax=id_in)
        u, n = 2.0**-8, x.shape[-1]  # bf16's unit roundoff; fp32 accumulation adds n * 2^-24 twice
        c = 4 * u + 2 * n * 2.0**-24
        rough = x.bfloat16() @ w_out_bf16.T  # [N, Vo] bf16
        group_max = torch.stack([rough[:, lo:hi].amax(-1) for lo, hi in cuts], dim=-1).float()  # [N, G]
        bound = c * x.norm(dim=-1, keepdim=True) * group_norm  # [N, G]
        unsettled = ((group_max + bound).amax(-1) >= best_in).nonzero().squeeze(1)
        if len(x) >= 256 and len(unsettled) > len(x) // 2:  # e.g. a tiny draft vocab: most argmaxes outside
            self._split_pays = False
        # Settled rows: every outside logit is below the best inside one, whatever their argmax.
        argmax = id_in.clone()
        if len(unsettled):
            exact = x[unsettled] @ w_out.T  # [M, Vo] fp32, as the full product
            best_out = exact.amax(-1)
            # Among equal maxima argmax takes the lowest id; out_ids is sorted by norm, not id.
            id_out = torch.where(exact == best_out.unsqueeze(1), out_ids, out_ids.max() + 1).amin(-1)
            b_in, i_in = best_in[unsettled], id_in[unsettled]
            wins_in = (b_in > best_out) | ((b_in == best_out) & (i_in < id_out))
            argmax[unsettled] = torch.where(wins_in, i_in, id_out)
        return TTTTargets(probs=probs, argmax=argmax)


def needed_rows(loss_mask: Tensor, document_ids: Tensor) -> Tensor:
    """[N] the flat rows (of [B, S]) where a loss reads the target's distribution: x[t+1] is a
    loss-masked token of the same document."""
    mask = loss_mask.bool()
    needed = torch.zeros_like(mask)  # [B, S]
    needed[:, :-1] = mask[:, 1:] & (document_ids[:, 1:] == document_ids[:, :-1])
    return needed.flatten().nonzero().squeeze(1)


__all__ = ["TargetHead", "needed_rows"]
