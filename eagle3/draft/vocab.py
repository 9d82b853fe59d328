"""The draft vocabulary: the N target tokens the draft's ``lm_head`` can propose.

Selection: the N most frequent **loss-masked** tokens of the harvest, i.e. the tokens ``x[i]``
with ``loss_mask[i]`` set. These are exactly the tokens being *predicted* at the positions the
loss trains on (the loss at position t is gated by the mask of x[t+2], the token the target's
distribution at t+1 describes); the input tokens and the prompt are not counted. Ties go to the
lower target id; ``always_include`` ids (e.g. end-of-turn) are kept whatever their count; if
fewer than N distinct tokens were seen, the lowest unseen ids fill the rest. Draft ids are
assigned in ascending target-id order, so ``d2t`` is non-decreasing and selecting
``x[..., t2d]`` over the target vocab yields the draft order directly.

Mappings (as vLLM reads them)::

    d2t  int64 [Vd]   target_id = draft_id + d2t[draft_id]
    t2d  bool  [V]    t2d[target_id] is True iff the token is in the draft vocab
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from eagle3.errors import InputError, MissingInputError


@dataclass(frozen=True)
class DraftVocab:
    d2t: Tensor  # [Vd] int64 offsets
    t2d: Tensor  # [V] bool

    @classmethod
    def from_target_ids(cls, target_ids: Tensor, vocab_size: int) -> DraftVocab:
        """From the draft vocab's target ids (any order; stored ascending)."""
        ids = torch.unique(target_ids.long())  # sorted ascending
        if len(ids) != len(target_ids):
            raise ValueError("draft vocab target ids contain duplicates")
        if len(ids) and not 0 <= int(ids[0]) <= int(ids[-1]) < vocab_size:
            raise ValueError(f"draft vocab target ids out of range [0, {vocab_size})")
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[ids] = True
        return cls(d2t=ids - torch.arange(len(ids)), t2d=t2d)

    @classmethod
    def from_d2t(cls, d2t: Tensor, vocab_size: int) -> DraftVocab:
        return cls.from_target_ids(torch.arange(len(d2t)) + d2t.cpu(), vocab_size)

    @property
    def size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def target_ids(self) -> Tensor:
        """[Vd] target id of each draft id (ascending)."""
        return torch.arange(self.size, device=self.d2t.device) + self.d2t

    def draft_to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def target_to_draft_ids(self, target_ids: Tensor) -> Tensor:
        """Draft id of each target id, -1 where the token is outside the draft vocab."""
        t2d = self.t2d.to(target_ids.device)
        lookup = torch.cumsum(t2d.long(), 0) - 1  # [V] rank among the draft tokens
        return torch.where(t2d[target_ids], lookup[target_ids], -1)


def count_loss_tokens(samples: Iterable[tuple[Tensor, Tensor]], vocab_size: int) -> Tensor:
    """Counts [V] int64 of ``input_ids[loss_mask]`` over (input_ids [T], loss_mask [T]) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for input_ids, loss_mask in samples:
        counts += torch.bincount(input_ids.long()[loss_mask.bool()], minlength=vocab_size)[:vocab_size]
    return counts


def select_draft_vocab(counts: Tensor, draft_vocab_size: int, always_include: Sequence[int] = ()) -> DraftVocab:
    """The ``draft_vocab_size`` most frequent tokens of ``counts`` [V] (ties: lower id first)."""
    vocab_size = int(counts.shape[0])
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size}: must be in [1, {vocab_size}]")
    forced = sorted({int(i) for i in always_include})
    if len(forced) > draft_vocab_size or any(not 0 <= i < vocab_size for i in forced):
        raise ValueError(f"always_include={forced} does not fit a draft vocab of {draft_vocab_size} "
                         f"over {vocab_size} tokens")
    order = torch.sort(counts.long(), descending=True, stable=True).indices  # stable: ties keep ascending ids
    chosen = set(forced)
    for i in order.tolist():
        if len(chosen) == draft_vocab_size:
            break
        chosen.add(i)
    return DraftVocab.from_target_ids(torch.tensor(sorted(chosen)), vocab_size)


__all__ = ["DraftVocab", "count_loss_tokens", "read_vocab_file", "select_draft_vocab", "write_draft_vocab"]


def read_vocab_file(path: str | os.PathLike[str], vocab_size: int) -> DraftVocab:
    """A draft vocab saved by a run (``draft_vocab.safetensors``, or the folder holding one); a draft
    folder's own vocab: :func:`eagle3.export.read_draft_vocab`."""
    path = Path(path)
    if path.is_dir():
        path = path / "draft_vocab.safetensors"
    if not path.is_file():
        raise MissingInputError(f"{path}: no draft vocab here (expected a draft_vocab.safetensors or a draft folder)")
    try:
        tensors = load_file(str(path))
    except Exception as err:  # safetensors raises its own error types
        raise InputError(f"{path}: not a readable safetensors file ({err})") from err
    missing = [k for k in ("d2t", "t2d") if k not in tensors]
    if missing:
        raise InputError(f"{path}: missing tensor(s) {missing}; expected d2t (int64 offsets) and t2d (bool mask); "
                         "a full-vocab draft has none: pass its folder")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if d2t.dim() != 1 or d2t.dtype not in (torch.int64, torch.int32):
        raise InputError(f"{path}: d2t must be a 1-d integer tensor, got {d2t.dtype} {list(d2t.shape)}")
    if t2d.dim() != 1 or t2d.shape[0] != vocab_size:
        raise InputError(f"{path}: a draft vocab over {list(t2d.shape)} target tokens, the target has {vocab_size}")
    try:
        vocab = DraftVocab.from_d2t(d2t.long(), vocab_size)
    except ValueError as err:
        raise InputError(f"{path}: d2t does not map to valid target ids ({err})") from err
    if not torch.equal(vocab.t2d, t2d.bool()):
        raise InputError(f"{path}: t2d does not mark exactly the target ids that d2t maps to")
    return vocab

def write_draft_vocab(path: str | os.PathLike[str], vocab: DraftVocab) -> None:
    from safetensors.torch import save

    from eagle3.atomic import atomic_write_bytes

    atomic_write_bytes(path, save({"d2t": vocab.d2t.contiguous(), "t2d": vocab.t2d.contiguous()}))
