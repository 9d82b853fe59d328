"""The draft a run starts from: a folder to continue (``train.init.draft``) checked against the
store and the target, the draft vocabulary (the initial draft's, a saved one, or the most frequent
training tokens), the mask token of a family that reads one, and the new or adopted draft with
the recipe's initialisation."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from eagle3.device import bf16_matmul_speedup
from eagle3.distributed import print0
from eagle3.draft.families import get_family
from eagle3.draft.model import DraftConfig, DraftHead
from eagle3.draft.spec import DraftSpec
from eagle3.draft.vocab import DraftVocab, select_draft_vocab
from eagle3.errors import TrainError
from eagle3.export import read_draft_vocab
from eagle3.store.batches import load_batch, loss_token_counts
from eagle3.store.shards import HarvestStore, StoreUnion
from eagle3.store.spec import StoreSpec
from eagle3.target.model import Target
from eagle3.train.checkpoint import seed_everything
from eagle3.train.config import InitSpec, TrainConfig
from eagle3.train.data import epoch_plan
from eagle3.train.step import train_forward


def choose_draft_vocab(spec: DraftSpec, store: HarvestStore | StoreUnion, train_idx: Sequence[int], vocab_size: int,
                       always_include: Sequence[int], initial: DraftHead | None = None) -> DraftVocab:
    """The vocab of the draft training continues from (``initial``), a saved vocab
    (``spec.vocab``), or the most frequent loss-masked tokens of the training split."""
    if initial is not None:  # the draft's own vocab, whatever its format keeps of it
        try:
            return DraftVocab.from_d2t(initial.d2t, vocab_size)
        except ValueError as err:
            raise TrainError(f"train.init.draft: {err}") from None
    if spec.vocab:
        try:
            vocab = read_draft_vocab(spec.vocab, vocab_size)
        except (OSError, ValueError) as err:  # DraftFormatError is a ValueError
            raise TrainError(f"train.draft.vocab: {err}") from None
        if vocab.size != min(spec.vocab_size, vocab_size):
            print0(f"train.draft.vocab: {spec.vocab} holds {vocab.size} tokens; they replace "
                   f"train.draft.vocab_size={spec.vocab_size}")
        return vocab
    counts = loss_token_counts(store, train_idx, vocab_size)
    return select_draft_vocab(counts, min(spec.vocab_size, vocab_size), always_include)


DRAFT_VOCAB = "draft_vocab.safetensors"


def initial_draft(folder: str, spec: Any, target: Target, embedding: Tensor) -> DraftHead:
    """A draft to continue training, checked against the store and the target."""
    from eagle3.draft.formats import DraftFormatError
    from eagle3.export import check_draft_fits_target, give_target_lm_head, load_draft

    try:  # the target's embedding goes in once the draft is known to fit it
        loaded = load_draft(folder)
        check_draft_fits_target(loaded, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                                aux_layer_ids=spec.aux_layer_ids)
    except DraftFormatError as err:
        raise TrainError(f"train.init.draft: {err}") from None
    own = loaded.draft.embed_tokens.weight.detach().clone() if loaded.has_embedding else None
    try:  # a checkpoint's own copy is kept out: the target's embedding is the one served
        loaded.draft.load_embedding(embedding)
    except ValueError as err:
        raise TrainError(f"train.init.draft: {folder}: hidden_size={loaded.draft.config.hidden_size} cannot take "
                         f"the target's embedding ({err})") from None
    if own is not None:
        served = loaded.draft.embed_tokens.weight.detach().float()
        if not any(torch.equal(own.float(), served.to(dtype).float())  # the same, stored rounded
                   for dtype in (torch.float32, torch.bfloat16, torch.float16)):
            print0(f"train.init.draft: {folder} carries its own embedding, which differs from the target's (max "
                   f"|difference| {(own.float() - served).abs().max():.3g}); the draft trains and is exported "
                   "with the target's, as engines serve a draft without one")
    if not loaded.has_lm_head:
        print0(f"train.init.draft: {folder} has no lm_head; it starts from the target's (as engines serve it)")
        try:
            give_target_lm_head(loaded, target.lm_head.weight)
        except DraftFormatError as err:
            raise TrainError(f"train.init.draft: {err}") from None
    if loaded.aux_layer_ids is None:
        print0(f"train.init.draft: {folder} names no aux layer ids; assuming the store's {list(spec.aux_layer_ids)}")
    return loaded.draft.float()


def mask_token_for(spec: DraftSpec, target: Target) -> int:
    """The mask token of a peagle/dflash draft: ``train.draft.mask_token_id``; else (as speculators picks
    one, but without adding a token) the tokenizer's mask token, a vocabulary row no token uses,
    the pad or unknown token when it is not the end-of-text one, else the last id."""
    vocab = target.vocab_size
    chosen = spec.mask_token_id
    if chosen is None:
        tok = target.tokenizer
        eos: set[Any] = set()
        for ids in (getattr(tok, "eos_token_id", None), getattr(target.config, "eos_token_id", None)):
            eos |= set(ids) if isinstance(ids, list | tuple) else {ids}  # Llama-3's config lists several
        candidates = [getattr(tok, "mask_token_id", None), len(tok) if len(tok) < vocab else None,
                      getattr(tok, "pad_token_id", None), getattr(tok, "unk_token_id", None)]
        chosen = next((c for c in candidates if isinstance(c, int) and 0 <= c < vocab and c not in eos), vocab - 1)
    if not 0 <= chosen < vocab:
        raise TrainError(f"train.draft.mask_token_id={chosen}: not a token id of the target (0..{vocab - 1})")
    return chosen


def new_draft(cfg: TrainConfig, target: Target, num_aux: int, vocab: DraftVocab, initial: DraftHead | None,
              embedding: Tensor, device: torch.device) -> DraftHead:
    """The draft the run starts from (``train.init.draft``'s, adopted by the run's family, or a new one
    of that family seeded as ``train.seed`` says), with the run's vocab and the recipe's
    initialisation of its head and layer."""
    seed_everything(cfg.seed)  # the same draft on every rank
    family = get_family(cfg.draft.family)
    own = initial.config.mask_token_id if initial is not None else None
    if own is not None and cfg.draft.mask_token_id is not None and cfg.draft.mask_token_id != own:
        raise TrainError(f"train.init.draft: {cfg.init.draft} was trained with mask_token_id={own}; set "
                         f"train.draft.mask_token_id={own} (or leave it unset)")
    mask_id = (own if own is not None else mask_token_for(cfg.draft, target)) if family.reads_mask_token else None
    if initial is None:
        try:
            draft_config = DraftConfig.from_target_config(target.config, draft_vocab_size=vocab.size,
                                                          num_aux_layers=num_aux, **cfg.draft_overrides(mask_id))
        except ValueError as err:
            raise TrainError(f"draft shape: {err}") from None
        draft = family.build(draft_config, embedding)
    else:
        draft = family.adopt(initial, str(cfg.init.draft), mask_id, cfg.ttt_steps)
        if cfg.draft.sliding_window is not None:  # continued training with a window: the window is the run's
            draft.config.sliding_window = cfg.draft.sliding_window
            draft.config.full_attention_layers = list(cfg.draft.full_attention_layers)
            family.check_config(draft.config)
    draft.set_draft_vocab(vocab.d2t, vocab.t2d)
    if cfg.init.lm_head == "target" and not cfg.init.draft:
        # the target's logit scale folded into the rows (a soft cap has no linear equivalent)
        rows = target.lm_head.weight.detach().float().cpu() * target.logit_transform.scale
        norm_scale = target.final_norm_scale()
        if norm_scale is None:
            print0("train.init.lm_head=target: the target's final norm is not an RMSNorm; the draft's final norm "
                   "starts at one")
        draft.init_lm_head_from_target(rows, vocab.d2t, norm_scale)
    if cfg.init.layers == "readout" and not cfg.init.draft:
        if not hasattr(draft, "init_as_readout"):
            raise TrainError(f"train.init.layers=readout: a {cfg.draft.family} draft has no readout init")
        try:
            draft.init_as_readout()
        except ValueError as err:
            raise TrainError(f"train.init.layers=readout: {err}") from None
    if cfg.init.freeze_lm_head:
        draft.lm_head.weight.requires_grad_(False)
    if cfg.precision == "bf16" and device.type == "cpu" and (speedup := bf16_matmul_speedup("cpu")) < 1.0:
        print0(f"train.precision=bf16: this CPU runs bf16 matmuls {1 / speedup:.0f}x slower than fp32 (no bf16 "
               f"units, measured); train.precision=fp32 will be much faster here")
    return draft


HEAD_SCALES = tuple(2.0 ** (-k / 2) for k in range(33))
"""The factors :func:`fit_start` tries on a copied head, in order until the loss rises: 1 down to
2^-16, half an octave apart."""


def first_micro_batch(data: StoreSpec, seed: int, store: Any, train_idx: Sequence[int],
                      weights_by_id: dict[str, float]) -> dict[str, Tensor]:
    """The run's first micro-batch (epoch 0's first, every rank's first read), as the loader builds it."""
    store.begin_epoch(0)
    return load_batch(store, epoch_plan(data, seed, store, train_idx, weights_by_id, 0)[0], data.batching)


class _TargetsOnce:
    """A target head whose :meth:`targets` is computed on the first call and then returned as is
    (the probes below run one batch through the draft many times)."""

    def __init__(self, head: Any) -> None:
        self.head, self.computed = head, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.head, name)

    def targets(self, *args: Any, **kwargs: Any) -> Any:
        if self.computed is None:
            self.computed = self.head.targets(*args, **kwargs)
        return self.computed


SHARP = 4.0
"""``auto`` refits a copied start when the untrained draft's logits spread (std over the draft vocab)
more than this many times the target's on the first micro-batch: measured 22x on Gemma-3-270M, whose
copied start does not learn, and 1.2-1.3x on SmolLM2-135M, whose copied start beats a refitted one at the
quickstart's scale (docs/experiments.md, 2026-11-28)."""


def _logit_spreads(model: Any, head: Any, batch: dict[str, Tensor], t2d: Tensor, device: torch.device,
                   loss_positions: str) -> tuple[float, float]:
    """(the draft's, the target's) logits' std over the draft vocab, averaged over the positions: the
    draft's as its forward computes them on ``batch``, the target's from the batch's last-layer states."""
    seen: list[Tensor] = []
    hook = model.draft.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach().float().flatten(0, -2)))
    try:
        train_forward(model, head, batch, t2d, torch.float32, device, loss_positions)
    finally:
        hook.remove()
    w = head.lm_head.weight
    x = head.norm(batch["last"][batch["document_ids"] >= 0].to(device=device, dtype=w.dtype))
    target = head.transform((x @ w[t2d.nonzero().squeeze(1).to(w.device)].T).float())
    return float(torch.cat(seen).std(-1).mean()), float(target.std(-1).mean())


@torch.no_grad()
def fit_start(init: InitSpec, positions: str, model: Any, head: Any,
              first_batch: Callable[[], dict[str, Tensor]] | None, t2d: Tensor, device: torch.device) -> dict[str, Any]:
    """A fresh draft's start, set on the run's first micro-batch (``first_batch()``, read only when
    something may be set: host tensors, as the loader builds them; every rank reads the same one, so
    every rank starts the same draft). Nothing is set for a resumed run (``first_batch`` None: the
    checkpoint holds the weights) or one continuing ``train.init.draft``:

    - ``train.init.aux_scale=unit``: each channel of what ``fc`` reads at unit RMS over the batch's
      tokens (:meth:`DraftHead.scale_aux_inputs`);
    - ``train.init.head_scale=fit`` (with ``init.lm_head=target``): the copied head rows times the
      factor of :data:`HEAD_SCALES` whose untrained draft has the lowest loss on the batch (the
      loss is convex in that factor, so the search stops once it rises). A head copied from the
      target is as sharp as the target's on the target's own states; on an untrained draft's
      states it can be far sharper (Gemma-3's final norm scales some channels by 300), and a start
      that confident and wrong learns slowly;
    - ``auto`` (either key, with ``init.lm_head=target``): ``unit`` / ``fit`` when the copied start's
      logits spread more than :data:`SHARP` times the target's, else ``none`` / ``one``.

    Returns what was probed and set, for the run's summary. ``model`` is the :class:`TTTModel`
    before the engine wraps it (fp32 weights); no random number is drawn."""
    draft = model.draft
    out: dict[str, Any] = {}
    if first_batch is None or init.draft or (init.aux_scale == "none" and init.head_scale == "one"):
        return out
    batch = first_batch()
    head = _TargetsOnce(head)  # the batch's target distribution, computed once for every forward below
    was_training = model.training
    model.eval()  # no feature noise: nothing random is drawn
    sharp = False
    if "auto" in (init.aux_scale, init.head_scale) and init.lm_head == "target":
        if "last" in batch:
            spread, target = _logit_spreads(model, head, batch, t2d, device, positions)
            sharp = spread > SHARP * target
            out["logit_std"] = {"copied": round(spread, 4), "target": round(target, 4), "refit": sharp}
        else:
            print0("train: a top-k store has no last-layer states to probe the copied head with; auto keeps it")
    if init.aux_scale == "unit" or (init.aux_scale == "auto" and sharp):
        real = batch["document_ids"] >= 0
        factor = draft.scale_aux_inputs(batch["aux"][real].to(device))
        out["aux_scale"] = {"min": round(float(factor.min()), 6), "median": round(float(factor.median()), 6),
                            "max": round(float(factor.max()), 6)}
    if init.lm_head == "target" and (init.head_scale == "fit" or (init.head_scale == "auto" and sharp)):
        weight = draft.lm_head.weight
        copied = weight.detach().clone()
        losses: list[float] = []
        for scale in HEAD_SCALES:  # convex in the factor: past the minimum the loss only rises
            weight.copy_(copied * scale)
            result, _ = train_forward(model, head, batch, t2d, torch.float32, device, positions)
            losses.append(float(result.loss))
            if len(losses) > 1 and losses[-1] >= losses[-2]:
                break
        best = min(range(len(losses)), key=lambda i: (losses[i], i))
        weight.copy_(copied * HEAD_SCALES[best])
        out["head_scale"] = round(HEAD_SCALES[best], 6)
        out["first_batch_loss"] = {"copied": round(losses[0], 4), "fitted": round(losses[best], 4)}
    model.train(was_training)
    print0(f"train: the draft's start, probed on the first micro-batch: {json.dumps(out)}")
    return out
