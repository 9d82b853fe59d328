"""The draft a run starts from: a folder to continue (``train.init.draft``) checked against the
store and the target, the draft vocabulary (the initial draft's, a saved one, or the most frequent
training tokens), the mask token of a family that reads one, and the new or adopted draft with
the recipe's initialisation."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from eagle3.device import bf16_matmul_speedup
from eagle3.distributed import Runtime, barrier, print0
from eagle3.draft.families import get_family
from eagle3.draft.losses import Objective
from eagle3.draft.model import DraftConfig, DraftHead
from eagle3.draft.spec import DraftSpec
from eagle3.draft.target_head import TargetHead
from eagle3.draft.vocab import DraftVocab, count_loss_tokens, select_draft_vocab, write_draft_vocab
from eagle3.errors import TrainError
from eagle3.export import read_draft_vocab
from eagle3.store.batches import first_micro_batch
from eagle3.store.feed import StoreFeed
from eagle3.target.model import Target
from eagle3.train.checkpoint import DRAFT_VOCAB
from eagle3.train.config import TrainConfig
from eagle3.train.data import TrainData
from eagle3.train.fit import fit_start
from eagle3.train.step import TTTModel


@dataclass
class DraftStart:
    """The draft a run trains, as it starts: its vocab, the draft in the TTT model, the target's head
    (the only part of the target training keeps), and what :func:`fit_start` probed and set."""

    vocab: DraftVocab
    model: TTTModel
    head: TargetHead
    fit: dict[str, Any]


def start_draft(cfg: TrainConfig, data: TrainData, target: Target, resume_tag: str | None,
                rt: Runtime) -> DraftStart:
    """The run's draft, the same on every rank: the vocab chosen once (read again on resume), the draft
    new or continued (``train.init.draft``) with the recipe's initialisation, wrapped for TTT."""
    out_dir, spec = Path(cfg.out_dir), data.store.spec
    embedding = target.embed_tokens.weight.detach().float().cpu()
    initial = initial_draft(cfg.init.draft, spec, target, embedding) if cfg.init.draft else None
    if resume_tag is not None:
        vocab = read_draft_vocab(out_dir / DRAFT_VOCAB, target.vocab_size)
    else:
        eos = target.tokenizer.eos_token_id
        vocab = choose_draft_vocab(cfg.draft, data.store, data.train_idx, target.vocab_size,
                                   [] if eos is None else [eos], initial)
        if rt.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_draft_vocab(out_dir / DRAFT_VOCAB, vocab)
    barrier()
    draft = new_draft(cfg, target, len(spec.aux_layer_ids), vocab, initial, embedding, rt.device)
    head = TargetHead.of_target(target, cfg.loss.target_temperature).to(rt.device)
    loss = cfg.loss
    model = TTTModel(draft, cfg.ttt_steps, loss.step_decay, cfg.gradient_checkpointing, loss.on_oov,
                     loss.feature_noise, loss.gate_steps, Objective(loss.kind, loss.lk_eta)).to(rt.device)
    first = (lambda: first_micro_batch(cfg.data, cfg.seed, data.store, data.train_idx,
                                       data.weights_by_id)) if resume_tag is None else None
    fit = fit_start(cfg.init, cfg.loss.positions, model, head, first, vocab.t2d.to(rt.device), rt.device)
    return DraftStart(vocab, model, head, fit)


def choose_draft_vocab(spec: DraftSpec, store: StoreFeed, train_idx: Sequence[int], vocab_size: int,
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
    counts = count_loss_tokens(map(store.token_columns, train_idx), vocab_size)  # no state is read
    return select_draft_vocab(counts, min(spec.vocab_size, vocab_size), always_include)


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


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's generators (torch's on every device), the streams a
    checkpoint's ``rng-rank*.pt`` saves and a resume restores."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def new_draft(cfg: TrainConfig, target: Target, num_aux: int, vocab: DraftVocab, initial: DraftHead | None,
              embedding: Tensor, device: torch.device) -> DraftHead:
    """The draft the run starts from (``train.init.draft``'s, adopted by the run's family, or a new one
    of that family seeded as ``train.seed`` says), with the run's vocab and the recipe's initialisation of
    its head and layer."""
    seed_everything(cfg.seed)  # the same draft on every rank (loading an initial draft drew from the RNG)
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
        common = {f.name for f in fields(DraftSpec)}
        for key in (f.name for f in fields(family.spec_class) if f.name not in common):  # the family's own
            want, have = getattr(cfg.draft, key), getattr(draft.config, key, None)
            if want is not None and want != have:
                raise TrainError(f"train.draft.{key}={want}: {cfg.init.draft} was trained with {key}={have}; a "
                                 f"continued draft keeps its shape (leave train.draft.{key} unset)")
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
