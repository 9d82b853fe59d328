"""What a training run settles before its first step: its stores (opened, split into training and
held-out samples, every shard verified), the sample weights, the draft vocabulary, and the
settings a resume must keep (:func:`pinned_settings`), the target's head and the draft it starts
from."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle3.atomic import sha256_file
from eagle3.config import TargetConfig
from eagle3.device import bf16_matmul_speedup
from eagle3.distributed import Runtime, all_reduce_sum, print0
from eagle3.draft.families import get_family
from eagle3.draft.model import DraftConfig, DraftHead
from eagle3.draft.vocab import DraftVocab, select_draft_vocab
from eagle3.errors import TrainError
from eagle3.export import read_draft_vocab
from eagle3.store.batches import loss_token_counts, split_by_id
from eagle3.store.colocated import ColocatedStore
from eagle3.store.shards import HarvestStore, StoreError, StoreUnion, open_stores, store_state, verify_store
from eagle3.store.spool import SpoolStore
from eagle3.target.model import Target, load_target, load_target_head
from eagle3.train.checkpoint import seed_everything
from eagle3.train.config import TrainConfig


def choose_draft_vocab(cfg: TrainConfig, store: HarvestStore | StoreUnion, train_idx: Sequence[int], vocab_size: int,
                       always_include: Sequence[int], initial: DraftHead | None = None) -> DraftVocab:
    """The vocab of the draft training continues from (``initial``), a saved vocab
    (``cfg.draft_vocab``), or the most frequent loss-masked tokens of the training split."""
    if initial is not None:  # the draft's own vocab, whatever its format keeps of it
        try:
            return DraftVocab.from_d2t(initial.d2t, vocab_size)
        except ValueError as err:
            raise TrainError(f"train.init_draft: {err}") from None
    if cfg.draft_vocab:
        try:
            vocab = read_draft_vocab(cfg.draft_vocab, vocab_size)
        except (OSError, ValueError) as err:  # DraftFormatError is a ValueError
            raise TrainError(f"train.draft_vocab: {err}") from None
        if vocab.size != min(cfg.draft_vocab_size, vocab_size):
            print0(f"train.draft_vocab: {cfg.draft_vocab} holds {vocab.size} tokens; they replace "
                   f"train.draft_vocab_size={cfg.draft_vocab_size}")
        return vocab
    counts = loss_token_counts(store, train_idx, vocab_size)
    return select_draft_vocab(counts, min(cfg.draft_vocab_size, vocab_size), always_include)


def pinned_settings(cfg: TrainConfig, world_size: int, store: HarvestStore | StoreUnion,
                    eval_store: HarvestStore | None = None) -> dict[str, Any]:
    """What a resumed run must share with the run that saved the checkpoint: the settings that
    decide the data order, the model and how DeepSpeed sharded its states."""
    keys = ("batching", "shard_window", "micro_batch_tokens", "gradient_accumulation", "seed", "eval_fraction",
            "ttt_steps",
            "init_draft", "num_layers", "draft_intermediate_size", "draft_num_attention_heads",
            "draft_num_key_value_heads", "draft_head_dim", "draft_rope", "draft_variant", "draft_family",
            "mask_token_id", "zero_stage", "precision",
            "freeze_lm_head", "optimizer", "muon_momentum", "lm_head_init", "layer_init", "step_decay",
            "draft_vocab_size", "draft_vocab", "loss", "lk_eta",
            # a checkpoint restores the optimizer's own lr, decay, betas and eps: a change would only be logged
            "lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps")
    pinned = {f"train.{k}": getattr(cfg, k) for k in keys}
    weights = sha256_file(Path(cfg.sample_weights)) if cfg.sample_weights else None
    held_out = (eval_store.identity()  # the best draft is picked on it
                if eval_store is not None and eval_store is not store else None)
    return {**pinned, "world_size": world_size, "store.samples": len(store),
            "store.shards": store.identity(), "sample_weights": weights,
            "eval_store.shards": held_out}


def _read_sample_weights(path: str | None) -> dict[str, float]:
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise TrainError(f"train.sample_weights={path}: {err}") from None
    if not isinstance(data, dict) or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                                             for v in data.values()):
        raise TrainError(f"train.sample_weights={path}: expected a JSON object of sample id -> finite weight >= 0")
    return {str(k): float(v) for k, v in data.items()}


def check_pinned(saved: dict[str, Any], now: dict[str, Any], out_dir: Path) -> None:
    """Keys one side lacks (pinned by an earlier or later version) are not compared."""
    for key in sorted(set(saved) & set(now)):
        if saved.get(key) != now.get(key):
            shown = (lambda v: f"{str(v)[:60]}...") if key.endswith(".shards") else repr
            raise TrainError(f"{out_dir} was trained with {key}={shown(saved.get(key))}, this run has "
                             f"{shown(now.get(key))}; use the same settings to resume, or another out_dir "
                             "(or --no-resume to start over)")


VERIFIED = "verified_stores.json"
DRAFT_VOCAB = "draft_vocab.safetensors"


def verify_stores(roots: Sequence[str], record: Path, rt: Runtime) -> list[str]:
    """Every shard of ``roots`` checked against its manifest (sha256, tensor shapes) before the run
    reads a sample, the shards split over the ranks. A store this run has verified and that is
    unchanged since (its manifest, each shard's size and modification time, kept in ``record``) is
    not hashed again, so a resume costs nothing. Returns the stores hashed now."""
    try:
        known = json.loads(record.read_text()) if record.is_file() else {}
    except ValueError:
        known = {}
    states = {root: store_state(root) for root in dict.fromkeys(roots)}
    todo = [root for root, state in states.items() if not state or known.get(os.path.realpath(root)) != state]
    bad: StoreError | None = None
    for root in todo:
        try:
            verify_store(root, (rt.rank, rt.world_size))
        except StoreError as err:
            bad = err
            break
    failed = all_reduce_sum(torch.tensor([float(bad is not None)], device=rt.device))
    if bad is not None:
        raise TrainError(f"{bad}; nothing was trained (python -m data_gen.harvest verify <store> checks a store)")
    if failed.item():
        raise TrainError("a store failed its verification on another rank (its message names the shard); "
                         "nothing was trained")
    if rt.rank == 0 and todo:
        from eagle3.atomic import atomic_write_text

        record.parent.mkdir(parents=True, exist_ok=True)
        known |= {os.path.realpath(root): states[root] for root in todo if states[root]}
        atomic_write_text(record, json.dumps(known, indent=1) + "\n")
    return todo


def open_train_store(cfg: TrainConfig, rank: int = 0) -> HarvestStore | StoreUnion | SpoolStore | ColocatedStore:
    """The training store (with ``train.extra_stores``), each named by its key when it cannot be read;
    online, the spool (this rank its reader); co-located, the plan (its states captured by the trainer)."""
    if cfg.data == "colocated":
        try:
            return ColocatedStore(cfg.store)
        except StoreError as err:
            raise TrainError(f"train.store: {err}") from None
    if cfg.data in ("online", "hybrid"):
        try:
            store = SpoolStore(cfg.store, seed=cfg.seed, reader=rank, wait_s=cfg.spool_wait_s,
                               keep_first_epoch=cfg.data == "hybrid")
            store.check_budget(cfg.shard_window)
            return store
        except StoreError as err:
            raise TrainError(f"train.store: {err}") from None
    try:
        store = open_stores([cfg.store, *cfg.extra_stores])
    except StoreError as err:
        base_ok = (Path(cfg.store) / "manifest.json").is_file()
        key = "train.extra_stores" if cfg.extra_stores and base_ok else "train.store"
        raise TrainError(f"{key}: {err}") from None
    if len(set(map(os.path.realpath, [cfg.store, *cfg.extra_stores]))) <= len(cfg.extra_stores):
        raise TrainError(f"train.extra_stores={list(cfg.extra_stores)}: a store is named twice (train.store="
                         f"{cfg.store}); its samples would count double")
    return store


def sample_weights(cfg: TrainConfig, store: HarvestStore | StoreUnion) -> dict[str, float]:
    """``train.sample_weights`` read and checked against the store's sample ids."""
    weights_by_id = _read_sample_weights(cfg.sample_weights)
    sample_ids = set(store.sample_ids)
    if weights_by_id and not set(weights_by_id) & sample_ids:
        raise TrainError(f"train.sample_weights={cfg.sample_weights}: none of its ids is a sample of the training "
                         f"store (e.g. {next(iter(weights_by_id))!r}; the store's: {store.sample_ids[:1]})")
    if weights_by_id and not any(weights_by_id.get(i, 1.0) > 0 for i in sample_ids):  # unlisted: 1
        raise TrainError(f"train.sample_weights={cfg.sample_weights}: every sample's weight is 0; nothing to train on")
    if unknown := len(set(weights_by_id) - sample_ids):
        print0(f"train.sample_weights: {unknown} of {len(weights_by_id)} ids are not samples of the training store")
    return weights_by_id


def eval_split(cfg: TrainConfig, store: HarvestStore | StoreUnion,
                target: Target) -> tuple[HarvestStore | StoreUnion | None, list[int], list[int]]:
    """(eval store, training indices, eval indices): ``train.eval_store`` less the conversations it
    shares with the training store, or an id-hash split of the training store."""
    if cfg.eval_store:
        try:
            eval_store: HarvestStore | StoreUnion | None = HarvestStore(Path(cfg.eval_store))
        except StoreError as err:
            raise TrainError(f"train.eval_store: {err}") from None
        assert eval_store is not None
        if not len(eval_store):
            raise TrainError(f"train.eval_store={cfg.eval_store}: holds no sample; nothing to evaluate on")
        eval_store.check_target(target)
        if eval_store.spec.aux_layer_ids != store.spec.aux_layer_ids:
            raise TrainError(f"train.eval_store={cfg.eval_store}: aux_layer_ids {list(eval_store.spec.aux_layer_ids)}"
                             f" differ from the training store's {list(store.spec.aux_layer_ids)}")
        seen = set(store.token_digests())
        shared = [d in seen for d in eval_store.token_digests()]  # the same conversation (tokens) in both
        if all(shared):
            raise TrainError(f"train.eval_store={cfg.eval_store}: every one of its {len(eval_store)} samples is also "
                             "a training sample (same tokens): its figures and the best/ draft would be measured on "
                             "training data; evaluate on a store of other conversations")
        train_idx, eval_idx = list(range(len(store))), [i for i, dup in enumerate(shared) if not dup]
        if len(eval_idx) < len(eval_store):
            print0(f"train.eval_store: {len(eval_store) - len(eval_idx)} of its {len(eval_store)} samples are also "
                   f"training samples (same tokens); evaluating on the other {len(eval_idx)}")
    else:
        train_idx, eval_idx = split_by_id(store.sample_ids, cfg.eval_fraction)
        eval_store = store if eval_idx else None
    if not train_idx or (cfg.eval_fraction > 0 and not eval_idx):
        raise TrainError(f"train.eval_fraction={cfg.eval_fraction} leaves {len(train_idx)} training and "
                         f"{len(eval_idx)} eval samples of {len(store)} in {cfg.store}")
    return eval_store, train_idx, eval_idx


def load_target_for(target_cfg: TargetConfig, aux_layer_ids: Sequence[int], full: bool = False) -> Target:
    """The target training needs: its head only, or (``full``, co-located training) all of it,
    loaded as the harvest loads it."""
    if target_cfg.aux_layer_ids is not None and sorted(target_cfg.aux_layer_ids) != sorted(aux_layer_ids):
        raise TrainError(f"target.aux_layer_ids={target_cfg.aux_layer_ids}, but the store was harvested with "
                         f"{list(aux_layer_ids)}")
    if full:
        return load_target(target_cfg.name_or_path, dtype=target_cfg.dtype, device=target_cfg.device,
                           aux_layer_ids=aux_layer_ids, attn_implementation=target_cfg.attn_implementation,
                           trust_remote_code=target_cfg.trust_remote_code, nvfp4_mode=target_cfg.nvfp4_mode,
                           architecture=target_cfg.architecture)
    # training reads only the target's embedding, final norm and lm_head (a few GB for a 1T model)
    return load_target_head(target_cfg.name_or_path, dtype=target_cfg.dtype, aux_layer_ids=aux_layer_ids,
                            trust_remote_code=target_cfg.trust_remote_code, architecture=target_cfg.architecture)


def check_weights(target: Target, spec: Any) -> None:
    """The store's states must come from these weights: a sibling checkpoint with the same
    tokenizer and shapes (base and instruct, BF16 and NVFP4) passes every other check."""
    from eagle3.fingerprint import UNKNOWN_WEIGHTS, weights_fingerprint

    mine = weights_fingerprint(target.location)
    known = mine not in UNKNOWN_WEIGHTS and spec.weights_fingerprint not in UNKNOWN_WEIGHTS
    if known and mine != spec.weights_fingerprint:
        raise TrainError(f"target.name_or_path={target.name}: not the weights the store was harvested "
                         f"from (the store names {spec.target}, weights fingerprint {spec.weights_fingerprint[:12]}, "
                         f"these {mine[:12]}); train with the target that harvested it")


def initial_draft(folder: str, spec: Any, target: Target, embedding: Tensor) -> DraftHead:
    """A draft to continue training, checked against the store and the target."""
    from eagle3.draft.formats import DraftFormatError
    from eagle3.export import check_draft_fits_target, give_target_lm_head, load_draft

    try:  # the target's embedding goes in once the draft is known to fit it
        loaded = load_draft(folder)
        check_draft_fits_target(loaded, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                                aux_layer_ids=spec.aux_layer_ids)
    except DraftFormatError as err:
        raise TrainError(f"train.init_draft: {err}") from None
    own = loaded.draft.embed_tokens.weight.detach().clone() if loaded.has_embedding else None
    try:  # a checkpoint's own copy is kept out: the target's embedding is the one served
        loaded.draft.load_embedding(embedding)
    except ValueError as err:
        raise TrainError(f"train.init_draft: {folder}: hidden_size={loaded.draft.config.hidden_size} cannot take "
                         f"the target's embedding ({err})") from None
    if own is not None:
        served = loaded.draft.embed_tokens.weight.detach().float()
        if not any(torch.equal(own.float(), served.to(dtype).float())  # the same, stored rounded
                   for dtype in (torch.float32, torch.bfloat16, torch.float16)):
            print0(f"train.init_draft: {folder} carries its own embedding, which differs from the target's (max "
                   f"|difference| {(own.float() - served).abs().max():.3g}); the draft trains and is exported "
                   "with the target's, as engines serve a draft without one")
    if not loaded.has_lm_head:
        print0(f"train.init_draft: {folder} has no lm_head; it starts from the target's (as engines serve it)")
        try:
            give_target_lm_head(loaded, target.lm_head.weight)
        except DraftFormatError as err:
            raise TrainError(f"train.init_draft: {err}") from None
    if loaded.aux_layer_ids is None:
        print0(f"train.init_draft: {folder} names no aux layer ids; assuming the store's {list(spec.aux_layer_ids)}")
    return loaded.draft.float()


def mask_token_for(cfg: TrainConfig, target: Target) -> int:
    """The mask token of a peagle/dflash draft: ``train.mask_token_id``; else (as speculators picks
    one, but without adding a token) the tokenizer's mask token, a vocabulary row no token uses,
    the pad or unknown token when it is not the end-of-text one, else the last id."""
    vocab = target.vocab_size
    chosen = cfg.mask_token_id
    if chosen is None:
        tok = target.tokenizer
        eos: set[Any] = set()
        for ids in (getattr(tok, "eos_token_id", None), getattr(target.config, "eos_token_id", None)):
            eos |= set(ids) if isinstance(ids, list | tuple) else {ids}  # Llama-3's config lists several
        candidates = [getattr(tok, "mask_token_id", None), len(tok) if len(tok) < vocab else None,
                      getattr(tok, "pad_token_id", None), getattr(tok, "unk_token_id", None)]
        chosen = next((c for c in candidates if isinstance(c, int) and 0 <= c < vocab and c not in eos), vocab - 1)
    if not 0 <= chosen < vocab:
        raise TrainError(f"train.mask_token_id={chosen}: not a token id of the target (0..{vocab - 1})")
    return chosen


def new_draft(cfg: TrainConfig, target: Target, num_aux: int, vocab: DraftVocab, initial: DraftHead | None,
              embedding: Tensor, device: torch.device) -> DraftHead:
    """The draft the run starts from (``train.init_draft``'s, adopted by the run's family, or a new one
    of that family seeded as ``train.seed`` says), with the run's vocab and the recipe's
    initialisation of its head and layer."""
    seed_everything(cfg.seed)  # the same draft on every rank
    family = get_family(cfg.draft_family)
    own = initial.config.mask_token_id if initial is not None else None
    if own is not None and cfg.mask_token_id is not None and cfg.mask_token_id != own:
        raise TrainError(f"train.init_draft: {cfg.init_draft} was trained with mask_token_id={own}; set "
                         f"train.mask_token_id={own} (or leave it unset)")
    mask_id = (own if own is not None else mask_token_for(cfg, target)) if family.reads_mask_token else None
    if initial is None:
        try:
            draft_config = DraftConfig.from_target_config(target.config, draft_vocab_size=vocab.size,
                                                          num_aux_layers=num_aux, **cfg.draft_overrides(mask_id))
        except ValueError as err:
            raise TrainError(f"draft shape: {err}") from None
        draft = family.build(draft_config, embedding)
    else:
        draft = family.adopt(initial, cfg, mask_id)
    draft.set_draft_vocab(vocab.d2t, vocab.t2d)
    if cfg.lm_head_init == "target" and not cfg.init_draft:
        # the target's logit scale folded into the rows (a soft cap has no linear equivalent)
        rows = target.lm_head.weight.detach().float().cpu() * target.logit_transform.scale
        norm_scale = target.final_norm_scale()
        if norm_scale is None:
            print0("train.lm_head_init=target: the target's final norm is not an RMSNorm; the draft's final norm "
                   "starts at one")
        draft.init_lm_head_from_target(rows, vocab.d2t, norm_scale)
    if cfg.layer_init == "readout" and not cfg.init_draft:
        if not hasattr(draft, "init_as_readout"):
            raise TrainError(f"train.layer_init=readout: a {cfg.draft_family} draft has no readout init")
        try:
            draft.init_as_readout()
        except ValueError as err:
            raise TrainError(f"train.layer_init=readout: {err}") from None
    if cfg.freeze_lm_head:
        draft.lm_head.weight.requires_grad_(False)
    if cfg.precision == "bf16" and device.type == "cpu" and (speedup := bf16_matmul_speedup("cpu")) < 1.0:
        print0(f"train.precision=bf16: this CPU runs bf16 matmuls {1 / speedup:.0f}x slower than fp32 (no bf16 "
               f"units, measured); train.precision=fp32 will be much faster here")
    return draft
