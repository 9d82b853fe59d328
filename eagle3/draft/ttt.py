"""Training-time test (TTT): the draft unrolled K steps over a packed batch, as pure functions.

Notation: one packed row holds documents back to back; ``x`` its tokens, ``a[t]`` the target's
aux states at t (they have seen x[<=t]), ``p[t]`` the target's next-token distribution at t
(over x[t+1], from its pre-norm last state via its final norm and lm_head), ``m`` the loss
mask, ``pos`` the per-document positions, ``doc`` the document ids. Rows below are indexed by
the **start position** t: the position whose tokens the target has verified when drafting
begins. Step k (k = 0..K-1) at row t is the k-th draft token after t::

    row t                    0       1       2       3     ...
    step 0  input token      x[1]    x[2]    x[3]    x[4]        token after t
            hidden           fc(a0)  fc(a1)  fc(a2)  fc(a3)      the target's states at t
            RoPE position    0       1       2       3           pos[t]
            learns           p[1]    p[2]    p[3]    p[4]        distribution of x[t+2]
            gated by         m[2]    m[3]    m[4]    m[5]        mask of the predicted token
    step 1  input token      x[2]    x[3]    x[4]    x[5]        x[t+k+1]
            hidden           h0[0]   h0[1]   h0[2]   h0[3]       step k-1's pre-norm output, same row
            RoPE position    1       2       3       4           pos[t] + k
            learns           p[2]    p[3]    p[4]    p[5]        p[t+k+1]
            gated by         m[3]    m[4]    m[5]    m[6]        m[t+k+2]
    step k  ...              shifted by k more

A step counts at row t only if x[t+k+2] lies in t's document (a shift that leaves the document
masks the position) and m[t+k+2] is set; the loss also drops positions whose target argmax is
outside the draft vocab (as EAGLE-3 and SpecForge), unless ``loss_on_oov`` trains them on the
renormalised draft-vocab distribution too (as speculators 0.9.0).

Attention. Step k at row t attends to

* the **step-0 keys of rows s <= t** of the same document (all of them, at every step), and
* the keys of **steps 1..k at row t itself** (the diagonal; step k's own key included).

This is what the draft's KV cache holds at serving time: after the target verified x[..t+1]
the draft has run step 0 over every position <= t (prefill), then appends one key per draft
step. Example, one document, t = 3, k = 2 (``#`` attended)::

    keys        step 0, rows 0..5    step 1, rows 0..5    step 2, rows 0..5
    query
    (k=2, t=3)  # # # # . .          . . . # . .          . . . # . .
    (k=1, t=3)  # # # # . .          . . . # . .          . . . . . .
    (k=0, t=3)  # # # # . .          . . . . . .          . . . . . .

The step-0 window is NOT shifted with k: EAGLE's original training code hides, at step k,
the step-0 keys of rows t-k..t-1 (its "mask shift", questioned in EAGLE #247/#299 and removed
by SpecForge #244/#245); serving never hides them. RoPE positions DO advance with k (also
added by SpecForge #244). ``tests/test_ttt.py`` decides both against the draft run token by
token with its own KV cache, as at serving time: logits agree at every step and position
(max |diff| ~3e-6 in fp32), while both negative controls (EAGLE's shifted window, RoPE
not advanced) disagree from step 1 on.

Implementation: the step-0 part is a normal causal+document attention (an [S, S] mask); the
diagonal terms are elementwise q.k products, one column per earlier step, softmaxed jointly
with the step-0 scores. No [S, (K+1)S] mask is built.

P-EAGLE drafts (``step_inputs``, :mod:`eagle3.draft.families.peagle`): steps >= 1 are fed the mask token and the draft's
mask state instead of x[t+k+1] and step k-1's output; positions, attention, targets and loss
are the same, which is what one serving forward over the context and k - 1 mask rows computes.

Loss: soft cross-entropy of the draft's logits against p restricted to the draft vocab and
renormalised (or another objective of :mod:`eagle3.draft.losses`), averaged over the step's loss
positions, weighted ``decay**k`` (0.8) and summed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from eagle3.device import sdpa, to_device
from eagle3.draft.context import ContextShard
from eagle3.draft.losses import SOFT_CE, Objective, soft_cross_entropy
from eagle3.draft.model import Attend, DraftHead, Eagle3Draft, gather_rows
from eagle3.draft.targets import TTTTargets, prepare_targets, prepare_targets_from_topk

# ---------------------------------------------------------------- shifts and masks


def shift_left(x: Tensor, n: int, fill: float | int | bool) -> Tensor:
    """y[:, t] = x[:, t + n] along dim 1, ``fill`` where t + n runs past the row. [B, S, ...]"""
    if n == 0:
        return x
    s = x.shape[1]
    pad = x.new_full((x.shape[0], min(n, s), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def step_input_ids(input_ids: Tensor, step: int) -> Tensor:
    """[B, S] token fed at row t in step k: x[t + k + 1] (0 past the row end; never counted)."""
    return shift_left(input_ids, step + 1, 0)


def step_positions(position_ids: Tensor, step: int) -> Tensor:
    """[B, S] RoPE position of step k at row t: pos[t] + k."""
    return position_ids + step


def step_counted(loss_mask: Tensor, document_ids: Tensor, step: int, own: int | None = None) -> Tensor:
    """[B, S] bool: step k at row t predicts x[t+k+2], which is loss-masked and in t's document (and,
    with ``own``, t < own: the rows after it are a context shard's halo)."""
    predicted = step + 2
    same_doc = shift_left(document_ids, predicted, -1) == document_ids  # [B, S]
    counted = shift_left(loss_mask.bool(), predicted, False) & same_doc
    if own is not None:
        counted[:, own:] = False
    return counted


def step0_attention_mask(document_ids: Tensor, window: int | None = None) -> Tensor:
    """[B, S, S] bool: query row t may see step-0 key row s iff s <= t in the same document (and,
    with ``window``, t - s < window: rows of one document are consecutive positions)."""
    s = document_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()  # [S, S]
    if window is not None:
        causal &= ~torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril(-window)
    return causal & (document_ids.unsqueeze(2) == document_ids.unsqueeze(1))


def layer_masks(windows: Sequence[int | None], mask_of: Callable[[int], Tensor], at: Tensor | None, step: int,
                full: tuple[Tensor, Tensor]) -> list[tuple[Tensor, Tensor]]:
    """Per draft layer, step ``step``'s (step-0 key mask [B, S, S], that of the rows read [B, M, S]):
    ``full`` for a full-attention layer. A sliding-window layer's query at step k sits k positions
    past its row, so its window over the step-0 keys is ``window - k`` rows (its diagonal keys, at
    most k positions back, stay inside). ``mask_of(window)``: the step-0 key mask of that window."""
    made: dict[int, tuple[Tensor, Tensor]] = {}
    out = []
    for window in windows:
        if window is None:
            out.append(full)
            continue
        if window - step not in made:
            mask = mask_of(window - step)
            made[window - step] = (mask, _rows(mask, at))
        out.append(made[window - step])
    return out


def step_weights(num_steps: int, decay: float = 0.8) -> Tensor:
    """[K] loss weight of each step: decay**k (0.8 in EAGLE-3; 1.0 weighs the steps equally)."""
    return decay ** torch.arange(num_steps, dtype=torch.float64)


def checked_weights(num_steps: int, weights: Sequence[float] | Tensor | None) -> Tensor:
    """[K] float64 step weights: ``weights``, or ``step_weights(num_steps)`` (0.8**k); a length other
    than K is refused."""
    w = step_weights(num_steps) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    if w.shape != (num_steps,):
        raise ValueError(f"{w.numel()} step weights for {num_steps} steps")
    return w


# ---------------------------------------------------------------- attention of one step


def _grouped(q: Tensor, num_kv: int) -> Tensor:
    """q [B, S, nh, d] -> [B, nkv, g, S, d]; query head h uses kv head h // g (as HF/vLLM)."""
    b, s, nh, d = q.shape
    return q.view(b, s, num_kv, nh // num_kv, d).permute(0, 2, 3, 1, 4)


BLOCKED_ATTENTION_MIN_LEN = 256
"""Rows at least this long take :func:`_blocked_attention` at steps >= 1 (2-2.5x faster than the
explicit softmax here from 1000 tokens, ~1.3x at 256; slower at 128)."""


def _blocked_attention(q: Tensor, step0: tuple[Tensor, Tensor], diagonal: Sequence[tuple[Tensor, Tensor]],
                       mask0: Tensor, block: int) -> Tensor:
    """:func:`ttt_attention` at steps >= 1 through fused SDPA, query rows in blocks of ``block``.

    A diagonal key belongs to one query row only, so one SDPA over all keys would need one more
    key per query row and step. Per block of query rows the keys are instead the whole step-0
    window plus the block's own diagonal keys (``block`` per step), masked ``mask0`` | identity:
    each row sees exactly the keys of the explicit version, at (S + k * block) / S of step 0's cost.
    """
    k0, v0 = step0
    b, sq, nh, d = q.shape
    sk, nkv, k = k0.shape[1], k0.shape[2], len(diagonal)
    nb = -(-sq // block)
    pad = nb * block - sq

    def blocks(x: Tensor) -> Tensor:  # [B, Sq, n, d] -> [B, nb, n, block, d]
        return F.pad(x, (0, 0, 0, 0, 0, pad)).view(b, nb, block, x.shape[2], d).transpose(2, 3)

    keys = torch.cat([k0.transpose(1, 2).unsqueeze(1).expand(b, nb, nkv, sk, d),
                      *[blocks(kj) for kj, _ in diagonal]], dim=3)  # [B, nb, nkv, Sk + k*block, d]
    values = torch.cat([v0.transpose(1, 2).unsqueeze(1).expand(b, nb, nkv, sk, d),
                        *[blocks(vj) for _, vj in diagonal]], dim=3)
    window = F.pad(mask0, (0, 0, 0, pad)).view(b, nb, block, sk)  # padded query rows see no step-0 key
    own = torch.eye(block, dtype=torch.bool, device=q.device).repeat(1, k).expand(b, nb, block, k * block)
    mask = torch.cat([window, own], dim=-1)  # [B, nb, block, Sk + k*block]; every row sees its diagonal
    out = sdpa(blocks(q).reshape(b * nb, nh, block, d),
                                         keys.reshape(b * nb, nkv, -1, d), values.reshape(b * nb, nkv, -1, d),
                                         attn_mask=mask.reshape(b * nb, 1, block, -1), enable_gqa=nkv != nh)
    return out.view(b, nb, nh, block, d).permute(0, 1, 3, 2, 4).reshape(b, nb * block, nh, d)[:, :sq]


def ttt_attention(q: Tensor, step0: tuple[Tensor, Tensor], diagonal: Sequence[tuple[Tensor, Tensor]],
                  mask0: Tensor) -> Tensor:
    """One step's attention (module docstring): step-0 keys under ``mask0`` plus the diagonal.

    q [B, Sq, nh, d] (rotated); step0 = (k0, v0) [B, S, nkv, d]; diagonal: (k_j, v_j) of steps
    1..k at the query rows, [B, Sq, nkv, d] each; mask0 [B, Sq, S]. Returns [B, Sq, nh, d].
    The query rows are all S rows or a subset of them (:func:`read_rows`; ``mask0``'s rows for it).
    """
    k0, v0 = step0
    b, sq, nh, d = q.shape
    s, nkv = k0.shape[1], k0.shape[2]
    if not diagonal:  # step 0: plain masked attention, fused (every row sees itself, so none is empty)
        out = sdpa(q.transpose(1, 2), k0.transpose(1, 2), v0.transpose(1, 2),
                                             attn_mask=mask0.unsqueeze(1), enable_gqa=nkv != nh)
        return out.transpose(1, 2)
    if s >= BLOCKED_ATTENTION_MIN_LEN:
        return _blocked_attention(q, step0, diagonal, mask0, 64 if s < 1024 else 128)
    qg = _grouped(q, nkv) * d**-0.5  # [B, nkv, g, Sq, d]
    keys0 = k0.permute(0, 2, 1, 3).unsqueeze(2)  # [B, nkv, 1, S, d]
    values0 = v0.permute(0, 2, 1, 3).unsqueeze(2)  # [B, nkv, 1, S, d]
    scores = (qg @ keys0.transpose(-1, -2)).masked_fill(~mask0.unsqueeze(1).unsqueeze(1), float("-inf"))
    diag_k = [kj.permute(0, 2, 1, 3).unsqueeze(2) for kj, _ in diagonal]  # [B, nkv, 1, Sq, d] each
    diag_v = [vj.permute(0, 2, 1, 3).unsqueeze(2) for _, vj in diagonal]
    diag_scores = [(qg * kj).sum(-1, keepdim=True) for kj in diag_k]  # [B, nkv, g, Sq, 1] each
    weights = torch.softmax(torch.cat([scores, *diag_scores], dim=-1).float(), dim=-1).to(q.dtype)  # [.., Sq, S+k]
    out = weights[..., :s] @ values0  # [B, nkv, g, Sq, d]
    for j, vj in enumerate(diag_v):
        out = out + weights[..., s + j : s + j + 1] * vj
    return out.permute(0, 3, 1, 2, 4).reshape(b, sq, nh, d)


Segment = tuple[int, int, int, int, int]  # (batch row, first key, end key, first query, end query)

SEGMENT_MIN_TOKENS = 512
"""Attention runs per group of whole documents at least this long (:func:`layout_rows`): no query sees
another document's keys, so a row of several documents costs the sum of its groups' squares rather
than the row's square; smaller groups would cost more calls than they save."""


def _segmented(q: Tensor, step0: tuple[Tensor, Tensor], diagonal: Sequence[tuple[Tensor, Tensor]], mask: Tensor,
               segments: Sequence[Segment] | None) -> Tensor:
    """:func:`ttt_attention` (its arguments) one segment at a time: each a range of query rows and the
    step-0 keys they can see, in order over every batch row's queries (None or one segment a row: whole)."""
    if segments is None or len(segments) <= q.shape[0]:
        return ttt_attention(q, step0, diagonal, mask)
    k0, v0 = step0
    rows: list[list[Tensor]] = [[] for _ in range(q.shape[0])]
    for b, s0, s1, m0, m1 in segments:
        rows[b].append(ttt_attention(q[b:b + 1, m0:m1], (k0[b:b + 1, s0:s1], v0[b:b + 1, s0:s1]),
                                     [(kj[b:b + 1, m0:m1], vj[b:b + 1, m0:m1]) for kj, vj in diagonal],
                                     mask[b:b + 1, m0:m1, s0:s1]))
    return torch.cat([torch.cat(parts, dim=1) for parts in rows], dim=0)


def layout_segments(document_ids: Tensor, at: Tensor | None, live: Tensor | None,
                  min_tokens: int) -> tuple[tuple[Segment, ...], tuple[Segment, ...] | None]:
    """The segments of a batch (:func:`_segmented`): consecutive documents grouped until a group holds
    ``min_tokens``; for queries at every row, and (``at``) at the rows read, whose padding (position 0)
    sees the first key only. A document's rows are contiguous (as ``pack`` and ``collate`` build
    them: an id never comes back later in a row). Read on the host (from the device: a sync on CUDA)."""
    doc = document_ids.cpu()
    every: list[Segment] = []
    read: list[Segment] = []
    for b in range(doc.shape[0]):
        cuts = [0, *((doc[b, 1:] != doc[b, :-1]).nonzero().squeeze(1) + 1).tolist(), doc.shape[1]]
        groups = [[0, 0]]
        for end in cuts[1:]:
            if groups[-1][1] - groups[-1][0] >= min_tokens:
                groups.append([groups[-1][1], end])
            groups[-1][1] = end
        every += [(b, s0, s1, s0, s1) for s0, s1 in groups]
        if at is not None and live is not None:
            n = int(live[b].sum())
            bounds = torch.searchsorted(at[b, :n].cpu(), torch.tensor([g[0] for g in groups] + [doc.shape[1]]))
            read += [(b, s0, s1, int(m0), int(m1)) for (s0, s1), m0, m1 in zip(groups, bounds[:-1], bounds[1:],
                                                                                strict=True) if m1 > m0]
            read += [(b, 0, 1, n, at.shape[1])] if n < at.shape[1] else []
    return tuple(every), (tuple(read) if at is not None else None)


# ---------------------------------------------------------------- the unroll


@dataclass
class TTTOutput:
    loss: Tensor  # scalar: sum_k w_k * loss_sum[k] / max(count[k], 1)
    loss_sum: Tensor  # [K] the objective (soft cross-entropy by default) summed over each step's loss positions
    count: Tensor  # [K] loss positions per step
    match: Tensor  # [K, B, S] bool: draft argmax (as a target id) == target argmax
    counted: Tensor  # [K, B, S] bool: positions the metrics count (step_counted)
    valid: Tensor  # [K, B, S] bool: loss positions (counted; target argmax in the draft vocab unless loss_on_oov)
    logits: list[Tensor] | None = None  # K x [B, S, Vd] with return_logits


def read_mask(loss_mask: Tensor, document_ids: Tensor, num_steps: int, own: int | None = None) -> Tensor:
    """[B, S] bool: the rows where some step 0..K-1 counts (:func:`read_rows`)."""
    needed = torch.zeros_like(loss_mask, dtype=torch.bool)
    for k in range(num_steps):
        needed |= step_counted(loss_mask, document_ids, k, own)
    return needed


def read_rows(loss_mask: Tensor, document_ids: Tensor, num_steps: int, own: int | None = None) -> tuple[Tensor, Tensor]:
    """The rows whose draft outputs the unroll reads: those where some step 0..K-1 counts
    (:func:`step_counted`).

    Step k at row t feeds only step k+1 at row t (its hidden state and its diagonal key) and its
    own logits, so no other row's output at any step is ever read; step 0's keys and values are
    still needed at every row (every later query's window). Returns ``idx`` [B, M] (each batch
    row's read positions, ascending, padded with position 0) and ``live`` [B, M] bool (False on the
    padding); M is the largest count over the batch. ``own``: only rows before it count (a context
    shard's own rows, :mod:`eagle3.draft.context`).
    """
    needed = read_mask(loss_mask, document_ids, num_steps, own)
    m = max(int(needed.sum(1).max()), 1) if needed.numel() else 1
    # a stable sort puts each row's needed positions first, in order
    order = torch.sort((~needed).to(torch.int8), dim=1, stable=True).indices[:, :m]  # [B, M]
    live = needed.gather(1, order)
    return torch.where(live, order, 0), live


@dataclass(frozen=True)
class RowLayout:
    """The data-dependent shapes of a training forward, which depend on ``loss_mask`` and
    ``document_ids`` alone: the rows the unroll reads (:func:`read_rows`) and, per step, where its
    loss and metrics are read. Worked out where those masks are built (the trainer: on the host,
    :func:`layout_rows`), the device never has to report a count back, a host sync on CUDA."""

    at: Tensor | None  # [B, M] the rows every step's output is read at (None: all rows)
    live: Tensor | None  # [B, M] False on the padding of ``at``
    counted: tuple[tuple[Tensor, Tensor], ...]  # per step, its counted positions: (batch row, forward row) [M_k]
    shape: tuple[int, ...]  # the batch's [B, S], checked against the batch it meets
    # layout_segments' (None: whole rows)
    segments: tuple[tuple[Segment, ...], tuple[Segment, ...] | None] | None = None

    def to(self, device: torch.device) -> RowLayout:
        def move(x: Tensor | None) -> Tensor | None:
            return None if x is None else to_device(x, device)

        return RowLayout(move(self.at), move(self.live), tuple((move(r), move(c)) for r, c in self.counted),
                         self.shape, self.segments)


def layout_rows(loss_mask: Tensor, document_ids: Tensor, num_steps: int, skip_unread_rows: bool = True,
              segment_tokens: int | None = SEGMENT_MIN_TOKENS, own: int | None = None) -> RowLayout:
    """The :class:`RowLayout` of a batch ([B, S] masks, on whichever device holds them); attention by
    groups of documents of ``segment_tokens`` (None: whole rows; always, for a context shard's ``own`` rows)."""
    at, live = read_rows(loss_mask, document_ids, num_steps, own) if skip_unread_rows else (None, None)
    segment_tokens = None if own is not None else segment_tokens
    counted = []
    for k in range(num_steps):
        counted_k = _rows(step_counted(loss_mask, document_ids, k, own), at)  # [B, R]
        if live is not None:
            counted_k = counted_k & live
        counted.append(counted_k.nonzero(as_tuple=True))
    segments = None if segment_tokens is None else layout_segments(document_ids, at, live, segment_tokens)
    return RowLayout(at, live, tuple(counted), tuple(loss_mask.shape), segments)


def layout_of(layout: RowLayout | None, loss_mask: Tensor, document_ids: Tensor, num_steps: int,
            skip_unread_rows: bool, own: int | None = None) -> RowLayout:
    """``layout`` (checked against the forward's settings), else the batch's own on its device."""
    if layout is None:
        return layout_rows(loss_mask, document_ids, num_steps, skip_unread_rows, own=own)
    if (len(layout.counted) != num_steps or (layout.at is not None and not skip_unread_rows)
            or layout.shape != tuple(loss_mask.shape)):
        over = " over read rows" if layout.at is not None else ""
        raise ValueError(f"a row layout of {len(layout.counted)} steps{over} "
                         f"for a {list(layout.shape)} batch, given a forward of {num_steps} steps"
                         f"{'' if skip_unread_rows else ' over every row'} on a {list(loss_mask.shape)} batch")
    return layout


def _rows(x: Tensor, idx: Tensor | None) -> Tensor:
    """x [B, S, ...] at the rows ``idx`` [B, M] -> [B, M, ...] (all of x without idx)."""
    return x if idx is None else gather_rows(x, idx)


class StepTally:
    """The per-step bookkeeping every family's training forward shares: which positions step k
    counts and trains (:meth:`step`, as the forward's rows), then its loss sum and matches
    (:meth:`add`), summed into one :class:`TTTOutput` (:meth:`output`)."""

    def __init__(self, weights: Tensor, loss_mask: Tensor, document_ids: Tensor, targets: TTTTargets, t2d: Tensor,
                 *, loss_on_oov: bool, gate_steps: bool, at: Tensor | None, live: Tensor | None,
                 shard: ContextShard | None = None) -> None:
        self.weights, self.loss_mask, self.document_ids, self.targets, self.t2d = (
            weights, loss_mask, document_ids, targets, t2d)
        self.gate_steps, self.at, self.live, self.shard = gate_steps, at, live, shard
        # loss_on_oov: every counted row whose target puts mass on the draft vocab (all, with full logits)
        self.has_mass = targets.probs.sum(-1) > 0 if loss_on_oov else None  # [B, S]
        self.reached = torch.ones_like(loss_mask, dtype=torch.bool)  # [B, S]: steps so far all matched
        self.loss: Tensor | None = None
        self.loss_sums: list[Tensor] = []
        self.counts: list[Tensor] = []
        self.matches: list[Tensor] = []
        self.counted: list[Tensor] = []
        self.valid: list[Tensor] = []
        self.logits: list[Tensor] = []

    def step(self, k: int) -> Tensor:
        """Step k's trained positions at the forward's rows [B, R] (padding rows off)."""
        counted = step_counted(self.loss_mask, self.document_ids, k, self.shard and self.shard.own)
        self._target_argmax = shift_left(self.targets.argmax, k + 1, -1)  # the target's argmax at t+k+1
        in_vocab = (shift_left(self.has_mass, k + 1, False) if self.has_mass is not None
                    else self.t2d[self._target_argmax.clamp_min(0)] & (self._target_argmax >= 0))
        valid = counted & in_vocab  # counted, and the target's argmax in the draft vocab (or mass on it)
        trained = valid & self.reached if self.gate_steps else valid  # [B, S]: the positions the loss sums
        self.counted.append(counted)
        self.valid.append(valid)
        trained_k = _rows(trained, self.at)  # [B, R]
        return trained_k if self.live is None else trained_k & self.live

    def add(self, loss_sum: Tensor, draft_argmax: Tensor, logits: Tensor | None = None) -> None:
        """The step's objective summed over its loss positions and its argmax [B, S] (target ids)."""
        k = len(self.loss_sums)
        count = self.valid[k].sum()
        weight = self.targets.weight  # weights: the loss averages over the weights of its positions
        norm = count if weight is None else torch.where(self.valid[k], shift_left(weight, k + 1, 0.0), 0.0).sum()
        whole = norm if self.shard is None else self.shard.total(norm)  # a shard's loss: over the row's count
        loss = loss_sum.new_zeros((), dtype=torch.float32) if self.loss is None else self.loss
        floor = 1 if weight is None else 1e-6  # weights: a weighted mean (all 0: no loss)
        self.loss = loss + float(self.weights[k]) * loss_sum / whole.clamp_min(floor)
        self.loss_sums.append(loss_sum)
        self.counts.append(count)
        self.matches.append(draft_argmax == self._target_argmax)
        self.reached = self.reached & self.matches[-1]
        if logits is not None:
            self.logits.append(logits)

    def output(self, return_logits: bool) -> TTTOutput:
        assert self.loss is not None
        return TTTOutput(loss=self.loss, loss_sum=torch.stack(self.loss_sums), count=torch.stack(self.counts),
                         match=torch.stack(self.matches), counted=torch.stack(self.counted),
                         valid=torch.stack(self.valid), logits=self.logits if return_logits else None)


def step_loss(draft: DraftHead, prenorm: Tensor, k: int, valid: Tensor, counted: tuple[Tensor, Tensor],
              at: Tensor | None, targets: TTTTargets, input_ids: Tensor, return_logits: bool,
              objective: Objective = SOFT_CE) -> tuple[Tensor, Tensor, Tensor | None]:
    """Step k's objective summed over ``valid`` and the draft's argmax [B, S] in target ids, from its
    pre-norm outputs [B, R, H] at the rows ``at`` (all rows: None); with ``return_logits`` also the
    logits [B, S, Vd], else logits only on the ``counted`` positions ((batch row, forward row), the
    step's entry of :attr:`RowLayout.counted`; the lm_head is most of a step's compute, and under
    half the rows are counted; uncounted rows never match)."""
    if return_logits:
        logits = draft.compute_logits(prenorm)  # [B, S, Vd]
        ce = objective(logits, shift_left(targets.probs, k + 1, 0.0))  # [B, S] against p[t+k+1]
        ce = ce if targets.weight is None else ce * shift_left(targets.weight, k + 1, 0.0)
        loss_sum = torch.where(valid, ce, 0.0).sum()
        return loss_sum, draft.draft_to_target_ids(logits.detach().argmax(-1)), logits
    rows, cols = counted  # [M] each
    t = cols if at is None else at[rows, cols]  # start positions
    logits = draft.compute_logits(prenorm[rows, cols])  # [M, Vd]
    ce = objective(logits, targets.probs[rows, t + k + 1])  # [M]: p[t+k+1]
    ce = ce if targets.weight is None else ce * targets.weight[rows, t + k + 1]
    loss_sum = torch.where(valid[rows, cols], ce, 0.0).sum()
    draft_argmax = torch.full_like(input_ids, -2)  # [B, S]
    draft_argmax[rows, t] = draft.draft_to_target_ids(logits.detach().argmax(-1))
    return loss_sum, draft_argmax, None


def ttt_forward(
    draft: Eagle3Draft,
    input_ids: Tensor,  # [B, S]
    aux: Tensor,  # [B, S, A, H_t]
    position_ids: Tensor, document_ids: Tensor, loss_mask: Tensor,  # [B, S] each
    targets: TTTTargets,
    *,
    num_steps: int = 7,
    weights: Sequence[float] | Tensor | None = None,
    gradient_checkpointing: bool = False,
    return_logits: bool = False,
    loss_on_oov: bool = False,
    skip_unread_rows: bool = True,
    gate_steps: bool = False,
    objective: Objective = SOFT_CE,
    layout: RowLayout | None = None,
    step_inputs: Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
    shard: ContextShard | None = None,
) -> TTTOutput:
    """Unroll the draft ``num_steps`` steps over a packed batch; loss and per-step matches.

    ``step_inputs(k, ids, hidden) -> (ids, hidden)`` replaces what steps k >= 1 are fed (the shifted
    tokens [B, R] and the previous step's states [B, R, H]); P-EAGLE feeds its mask token and state.

    ``weights`` defaults to ``step_weights(num_steps)`` (0.8**k). With ``gradient_checkpointing``
    each step's forward (logits and loss included) is recomputed in backward; steps are pure
    functions of their inputs, so replay appends nothing twice.

    With ``skip_unread_rows`` (unless ``return_logits``) the unroll runs only over the rows some
    step counts (:func:`read_rows`; with the loss on the replies, prompts drop out): step 0 still
    computes keys and values at every row (the window of every later query), but queries,
    attention output and MLP of its last layer, and all of steps >= 1, only at those rows. No
    loss, match or gradient changes. Logits are computed only on each step's counted rows.

    With ``shard`` the inputs are this rank's rows of a row split over a context-parallel group
    (:mod:`eagle3.draft.context`): its own rows are the queries, step 0's keys are the whole row's.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps}: must be >= 1")
    w = checked_weights(num_steps, weights)
    t2d = draft.t2d
    mask_of = functools.partial(step0_attention_mask if shard is None else shard.attention_mask, document_ids)
    mask0 = mask_of(None)  # [B, S, S] (a shard's: [B, L, whole row])
    hidden = draft.combine_aux(aux)  # [B, S, H]
    num_layers = len(draft.decoder_layers)
    step0_kv: list[tuple[Tensor, Tensor]] = []  # per layer (k0, v0) [B, S, nkv, d]
    diagonal: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(num_layers)]  # per layer, steps 1..k-1
    layout = layout_of(layout, loss_mask, document_ids, num_steps, skip_unread_rows and not return_logits,
                       own=shard and shard.own)
    at, live = layout.at, layout.live  # [B, M]: the output rows of every step (None: all); step 0 still reads all
    read_mask = _rows(mask0, at)  # [B, M, S]: the step-0 window of those rows
    windows = [draft.layer_window(i) for i in range(num_layers)]  # sliding-window layers: their own masks
    if any(w is not None and w <= num_steps for w in windows):
        raise ValueError(f"draft.sliding_window={draft.config.sliding_window}: must exceed the {num_steps} "
                         "unrolled steps")

    tally = StepTally(w, loss_mask, document_ids, targets, t2d, loss_on_oov=loss_on_oov, gate_steps=gate_steps,
                      at=at, live=live, shard=shard)
    for k in range(num_steps):
        inputs_at = at if k > 0 else None  # step 0 reads every row (keys and values)
        ids_k = _rows(step_input_ids(input_ids, k), inputs_at)  # [B, S] at step 0, else [B, R]
        pos_k = _rows(step_positions(position_ids, k), inputs_at)
        if step_inputs is not None and k > 0:  # e.g. P-EAGLE: the mask token and mask state instead
            ids_k, hidden = step_inputs(k, ids_k, hidden)
        valid_k = tally.step(k)  # [B, R]

        # A snapshot of the keys so far: a checkpointed step replays against exactly these.
        earlier = ([list(d) for d in diagonal], list(step0_kv))
        run_step = functools.partial(_unroll_step, draft, k=k, ids_k=ids_k, pos_k=pos_k, valid=valid_k,
                                     counted=layout.counted[k], at=at, earlier=earlier,
                                     masks=layer_masks(windows, mask_of, at, k, (mask0, read_mask)),
                                     targets=targets, input_ids=input_ids, return_logits=return_logits,
                                     objective=objective, segments=layout.segments,
                                     gather=shard and shard.gather)

        if gradient_checkpointing and torch.is_grad_enabled():
            out = checkpoint(run_step, hidden, use_reentrant=False)
        else:
            out = run_step(hidden)
        hidden, loss_sum, draft_argmax = out[0], out[1], out[2]
        new_kv = [(out[3 + 2 * i], out[4 + 2 * i]) for i in range(num_layers)]
        if k == 0:
            step0_kv = new_kv
        else:
            for i in range(num_layers):
                diagonal[i].append(new_kv[i])
        tally.add(loss_sum, draft_argmax, out[-1] if return_logits else None)
    return tally.output(return_logits)


def _unroll_step(draft: Eagle3Draft, hidden_prev: Tensor, *, k: int, ids_k: Tensor, pos_k: Tensor, valid: Tensor,
                 counted: tuple[Tensor, Tensor], at: Tensor | None, earlier: tuple,
                 masks: Sequence[tuple[Tensor, Tensor]],
                 targets: TTTTargets, input_ids: Tensor, return_logits: bool,
                 objective: Objective = SOFT_CE, segments: tuple | None = None,
                 gather: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, ...]:
    """One step of :func:`ttt_forward`, a pure function of its inputs (what checkpointing replays):
    the next hidden state, the step's loss sum, its argmax in target ids, each layer's new keys and
    values, and (``return_logits``) the logits. ``gather``: a context shard's step-0 keys -> the row's."""
    diag_before, window = earlier
    every, read = segments or (None, None)  # the segments of queries at every row, at the rows read
    read = every if at is None else read
    num_layers = len(draft.decoder_layers)
    new_kv: list[tuple[Tensor, Tensor]] = []

    def attend_for(layer: int) -> Attend:
        mask0, read_mask = masks[layer]  # [B, S, S] the step-0 keys' mask; [B, M, S] that of the rows read

        def attend(q: Tensor, key: Tensor, value: Tensor) -> Tensor:
            if k == 0 and gather is not None:
                key, value = gather(key), gather(value)
            new_kv.append((key, value))
            if k == 0:  # step 0's keys are the step-0 window itself; the last layer's queries at `at`
                last = layer == num_layers - 1
                return _segmented(q, (key, value), [], read_mask if last else mask0, read if last else every)
            return _segmented(q, window[layer], [*diag_before[layer], (key, value)], read_mask, read)
        return attend

    prenorm = draft.decode(hidden_prev, draft.embed(ids_k), pos_k, [attend_for(i) for i in range(num_layers)],
                           at if k == 0 else None)  # [B, R, H]
    flat_kv = [t for kv in new_kv for t in kv]
    # every row's hidden state goes on; logits only where step_loss needs them
    loss_sum, draft_argmax, logits = step_loss(draft, prenorm, k, valid, counted, at, targets, input_ids,
                                               return_logits, objective)
    return (draft.next_hidden(prenorm), loss_sum, draft_argmax, *flat_kv, *([logits] if return_logits else []))


__all__ = [
    "RowLayout", "StepTally", "TTTOutput", "TTTTargets", "layout_rows", "layout_segments", "layout_of", "read_mask",
    "read_rows", "step_loss",
    "prepare_targets",
    "prepare_targets_from_topk", "shift_left", "soft_cross_entropy", "step0_attention_mask",
    "step_counted", "step_input_ids", "step_positions", "step_weights", "ttt_attention", "layer_masks",
    "ttt_forward",
]

