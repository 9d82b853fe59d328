"""Training checkpoints that a kill never leaves half-written, the settings a resume must keep
(:meth:`eagle3.train.config.TrainConfig.pinned` and the run's data), and the exported draft.

A checkpoint is DeepSpeed's own (model, optimizer and scheduler states per rank, plus our
``client_state``: step, data position, best eval) with one ``rng-rank<r>.pt`` per rank::

    checkpoints/
        latest                  the tag of the newest *complete* checkpoint, written atomically
        step-00000200/          DeepSpeed's files + rng-rank00000.pt, rng-rank00001.pt, ...
        .step-00000300.tmp/     a save in progress (removed on the next start)

Every rank saves into the hidden ``.tmp`` folder; after a barrier rank 0 renames it to its
tag and only then points ``latest`` at it (DeepSpeed's own ``latest`` is truncated and
rewritten in place, so we keep our own and load by tag). A kill at any moment leaves
``latest`` at the previous complete checkpoint.

Export (``best/``, ``final/``): a vLLM-format draft folder (:mod:`eagle3.export`: ``config.json``,
``model.safetensors`` (the weights' dtype) with ``d2t``/``t2d`` unless the draft vocab is the whole
target vocab, no embedding) plus our ``draft.json`` with the
:class:`DraftConfig`, the target, the aux layer ids and the step/metrics it was taken at.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.atomic import atomic_write_text, remove_leftovers
from eagle3.distributed import Runtime, any_rank, barrier, print0
from eagle3.draft.formats import DraftFormatError, nonfinite_tensors
from eagle3.draft.model import DraftConfig, DraftHead, Eagle3Draft
from eagle3.errors import Eagle3Error, TrainError
from eagle3.export import export_draft_folder, load_draft
from eagle3.train.config import MOVED
from eagle3.train.data import VERIFIED

LATEST = "latest"
EXPORT_FORMAT = "eagle3-draft-2"
DRAFT_VOCAB = "draft_vocab.safetensors"
"""The run's draft vocab in its ``out_dir``: chosen once, read again on resume."""


@dataclass
class RunState:
    """Where a run is: kept in every checkpoint (as JSON, also ``trainer.json``) and restored on resume."""

    step: int = 0
    epoch: int = 0
    batch_index: int = 0  # micro-batches of the epoch read so far, every rank's
    best_tau: float | None = None  # the best held-out tau_sim so far, and its step (exported to best/)
    best_step: int | None = None
    first_eval: dict[str, float] | None = None
    last_eval: dict[str, float] | None = None
    first_loss: float | None = None  # the run's first step's, whichever process ran it
    pinned: dict[str, Any] = field(default_factory=dict)  # what a resume must share (settings, data)
    tokens: int | None = 0  # trained tokens over the whole run, across resumes

    def restore(self, saved: dict[str, Any]) -> None:
        """A checkpoint's state; one written before runs counted their tokens leaves them unknown (None)."""
        known = {f.name for f in fields(self)}
        for key, value in {"tokens": None, **saved}.items():
            if key in known:
                setattr(self, key, value)


class CheckpointError(Eagle3Error, RuntimeError):
    """A checkpoint cannot be resumed from; the message names the file."""


def tag_of(step: int) -> str:
    return f"step-{step:08d}"


# ---------------------------------------------------------------- RNG states


def rng_state() -> dict[str, Any]:
    """python, numpy and torch (CPU, and CUDA when present) generator states; loadable with
    ``torch.load(weights_only=True)`` (plain tuples, ints and tensors only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- save / load


def latest_tag(root: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint's tag under ``root``, or None."""
    path = Path(root) / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    if not tag or not (Path(root) / tag).is_dir():
        raise CheckpointError(f"{path} names {tag!r}, which is not a checkpoint folder; the checkpoint directory "
                              "was changed by hand (delete it to start over)")
    return tag


def remove_partial(root: str | os.PathLike[str]) -> list[str]:
    """Delete what a kill interrupted, rank 0 only: saves in progress (hidden ``.tmp`` folders)
    and an unfinished rewrite of ``latest`` (its hidden temporary file)."""
    root = Path(root)
    removed = []
    for path in sorted(root.glob(".step-*.tmp")):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    return removed + remove_leftovers(root, [LATEST])


def _fsync_tree(path: Path) -> None:
    for child in path.rglob("*"):
        if child.is_file():
            with open(child, "rb") as f:
                os.fsync(f.fileno())


def save_checkpoint(engine: Any, root: str | os.PathLike[str], step: int, client_state: dict[str, Any],
                    *, rank: int, keep: int, readable: dict[str, Any] | None = None) -> str:
    """Save on every rank (a collective), then publish atomically; returns the tag.

    ``readable`` (JSON) is also written as ``trainer.json``, so that a resume can check its
    settings before DeepSpeed loads anything."""
    root = Path(root)
    tag = tag_of(step)
    if (root / LATEST).is_file() and latest_tag(root) == tag:
        return tag  # resumed from this very step and not stepped since: nothing new to save
    tmp = f".{tag}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root / tmp, ignore_errors=True)
    barrier()
    # The frozen embedding (a copy of the target's, often the draft's largest tensor) is not saved.
    engine.save_checkpoint(str(root), tag=tmp, client_state=client_state, save_latest=False,
                           exclude_frozen_parameters=True)
    torch.save(rng_state(), root / tmp / f"rng-rank{rank:05d}.pt")
    barrier()
    if rank == 0:
        if readable is not None:  # with every rank's files and their sizes, checked by every rank on resume
            files = {p.relative_to(root / tmp).as_posix(): p.stat().st_size
                     for p in sorted((root / tmp).rglob("*")) if p.is_file()}
            (root / tmp / "trainer.json").write_text(json.dumps({**readable, "files": files}, indent=1) + "\n")
        _fsync_tree(root / tmp)
        if (root / tag).exists():  # renamed by a save killed before it updated `latest`: unreferenced
            shutil.rmtree(root / tag)
        os.replace(root / tmp, root / tag)
        atomic_write_text(root / LATEST, tag + "\n")
        tags = sorted(p.name for p in root.glob("step-*") if p.is_dir())
        for old in tags[:-keep]:
            if old != tag:
                shutil.rmtree(root / old, ignore_errors=True)
    barrier()
    return tag


def read_trainer_state(root: str | os.PathLike[str], tag: str) -> dict[str, Any]:
    """The ``readable`` part of a checkpoint (``trainer.json``, which every save writes)."""
    path = Path(root) / tag / "trainer.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; this checkpoint is incomplete (delete {Path(root) / tag} to "
                              "resume from an earlier one, or --no-resume to start over)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None


def _load_trainable(src: dict[str, torch.Tensor], dst: torch.nn.Module) -> None:
    """Load a module state saved without its frozen parameters; anything else missing is an error."""
    result = dst.load_state_dict(src, strict=False)
    frozen = {name for name, p in dst.named_parameters() if not p.requires_grad}
    missing = set(result.missing_keys) - frozen
    if missing or result.unexpected_keys:
        raise RuntimeError(f"checkpoint does not fit the draft: missing {sorted(missing)}, "
                           f"unexpected {sorted(result.unexpected_keys)}")


def load_checkpoint(engine: Any, root: str | os.PathLike[str], tag: str, *, rank: int,
                    world_size: int = 1) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG; returns the client state."""
    folder = Path(root) / tag
    rng_file = folder / f"rng-rank{rank:05d}.pt"
    saved = read_trainer_state(root, tag).get("files", {}) if (folder / "trainer.json").is_file() else {}
    for name, size in saved.items():  # every rank checks every file: all refuse together, none waits in a collective
        path = folder / name
        found = path.stat().st_size if path.is_file() else None
        if found != size:
            raise CheckpointError(f"{path}: {'missing' if found is None else f'{found} bytes, saved with {size}'}; "
                                  f"this checkpoint is incomplete (delete {folder} to resume from an earlier one, "
                                  "or --no-resume to start over)")
    for r in range(0 if saved else world_size):  # an earlier version's checkpoint lists no files: its RNG states
        if not (folder / f"rng-rank{r:05d}.pt").is_file():  # without it the resume would not be exact
            raise CheckpointError(f"{folder / f'rng-rank{r:05d}.pt'}: missing; this checkpoint is incomplete (delete "
                                  f"{folder} to resume from an earlier one, or --no-resume to start over)")
    try:
        path, client_state = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                                    load_lr_scheduler_states=True, custom_load_fn=_load_trainable)
    except (AssertionError, OSError, KeyError, ValueError) as err:  # DeepSpeed's own checks are asserts
        raise CheckpointError(f"{folder}: DeepSpeed could not load this checkpoint ({type(err).__name__}: "
                              f"{err or 'a file is missing'}); delete it to resume from an earlier one") from err
    if path is None:
        raise CheckpointError(f"{folder}: DeepSpeed could not load this checkpoint")
    set_rng_state(torch.load(rng_file, weights_only=True))
    return client_state


# ---------------------------------------------------------------- export


def export_draft(out: str | os.PathLike[str], state: dict[str, torch.Tensor], config: DraftConfig,
                 info: dict[str, Any]) -> None:
    """Write a vLLM-format draft folder (config.json, ``model.safetensors`` in the weights' dtype) with our
    ``draft.json`` (config, aux layer ids, step, eval figures), atomically."""
    meta = {"format": EXPORT_FORMAT, "draft_config": asdict(config), **info}
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(state["fc.weight"].dtype, "float32")
    export_draft_folder(out, state, config, info["aux_layer_ids"], "vllm", dtype=dtype, meta=meta)


def draft_weights(draft: DraftHead, zero_stage: int) -> dict[str, torch.Tensor]:
    """The full draft state on CPU (gathered from the ranks under ZeRO-3; a collective then)."""
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(draft.parameters()), modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in draft.vllm_state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in draft.vllm_state_dict().items()}


def export_finite(out: str | os.PathLike[str], draft: DraftHead, zero_stage: int, info: dict[str, Any],
                  rank: int) -> None:
    """Export the draft as it is now (every rank calls this: under ZeRO-3 its weights are gathered), refused
    with the step named when a weight went NaN/Inf (the update after the last finite loss)."""
    weights = draft_weights(draft, zero_stage)
    if bad := nonfinite_tensors(weights):  # every rank holds the same weights: every rank stops
        raise TrainError(f"step {info['step']}: NaN/Inf in {', '.join(bad[:4])}; stopping before a non-finite "
                         "draft is exported (check the store's states, train.init.draft and train.optim.lr)")
    if rank == 0:
        export_draft(out, weights, draft.config, info)


def load_exported_draft(folder: str | os.PathLike[str],
                        embed_tokens_weight: torch.Tensor | None = None) -> tuple[Eagle3Draft, dict[str, Any]]:
    """An exported draft and its ``draft.json`` (the embedding is the target's: pass it, or it
    stays at its random init)."""
    loaded = load_draft(folder, embed_tokens_weight=embed_tokens_weight)
    if not loaded.has_lm_head:
        raise DraftFormatError(f"{folder}: no lm_head.weight: load it with its target "
                               "(eagle3.export.fit_to_target gives it the target's)")
    return loaded.draft, loaded.meta


__all__ = [
    "CheckpointError", "DRAFT_VOCAB", "EXPORT_FORMAT", "LATEST", "RunState", "draft_weights", "export_draft",
    "export_finite", "finished_earlier", "latest_tag", "load_checkpoint", "load_exported_draft",
    "read_trainer_state", "remove_partial", "resume_point", "rng_state", "save_checkpoint",
    "set_rng_state", "start_over_or_resume", "tag_of",
]


def check_pinned(saved: dict[str, Any], now: dict[str, Any], out_dir: Path) -> None:
    """A checkpoint's flat keys of an earlier version (``train.lr``) are compared under their place now
    (``train.optim.lr``); keys one side lacks (pinned by an earlier or later version) are not compared."""
    saved = {(f"train.{MOVED[k[6:]]}" if k.startswith("train.") and k[6:] in MOVED else k): v for k, v in saved.items()}
    for key in sorted(set(saved) & set(now)):
        if saved.get(key) != now.get(key):
            shown = (lambda v: f"{str(v)[:60]}...") if key.endswith(".shards") else repr
            raise TrainError(f"{out_dir} was trained with {key}={shown(saved.get(key))}, this run has "
                             f"{shown(now.get(key))}; use the same settings to resume, or another out_dir "
                             "(or --no-resume to start over)")


# ---------------------------------------------------------------- resume, or start over


def resume_point(out_dir: Path, resume: bool, pinned: dict[str, Any]) -> str | None:
    """The checkpoint tag a run resumes from (None: it starts over), checked against the settings and
    data (``pinned``) its checkpoint was saved with. Nothing is touched here."""
    ckpt_root = out_dir / "checkpoints"
    tag = latest_tag(ckpt_root) if resume and ckpt_root.is_dir() else None
    if tag is not None:
        check_pinned(read_trainer_state(ckpt_root, tag).get("pinned", {}), pinned, out_dir)
    return tag


def start_over_or_resume(out_dir: Path, engine: Any, rt: Runtime, state: RunState, tag: str | None) -> None:
    """Once the draft and the engine are built (every check passed): clear what a kill left half-written
    in ``out_dir`` (a folder killed between its two renames gets its previous version back first);
    starting over, no stale checkpoint or export survives; resuming, load ``tag`` into the engine and
    ``state``."""
    ckpt_root = out_dir / "checkpoints"
    if rt.rank == 0 and tag is not None:  # what a kill left half-written: a save in progress
        remove_partial(ckpt_root)
    if rt.rank == 0:  # and the exports, logs and records
        remove_leftovers(out_dir, ["best", "final", "summary.json", "metrics.jsonl", "wandb_run_id",
                                   DRAFT_VOCAB, VERIFIED])
    if rt.rank == 0 and tag is None:
        for old in (ckpt_root, out_dir / "best", out_dir / "final"):
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    if tag is not None:
        client = load_checkpoint(engine, ckpt_root, tag, rank=rt.rank, world_size=rt.world_size)
        saved = json.loads(client["trainer_json"]) if "trainer_json" in client else client["trainer"]
        state.restore(saved)
        print0(f"train: resumed from {ckpt_root / tag} (step {state.step})")


def finished_earlier(out_dir: Path, steps: int, rt: Runtime, resumed_step: int | None) -> dict[str, Any] | None:
    """A run of ``steps`` steps in ``out_dir`` already finished: its summary (rank 0's view decides for every
    rank), else None."""
    if resumed_step is None or resumed_step < steps:
        return None
    done = out_dir / "summary.json"
    if not any_rank(rt, rt.rank == 0 and done.is_file() and (out_dir / "final").is_dir()):
        return None
    print0(f"train: finished earlier in {out_dir} (step {resumed_step}); nothing to do")
    if rt.rank == 0:
        return json.loads(done.read_text())
    return {"stage": "train", "out": str(out_dir), "steps": resumed_step}
