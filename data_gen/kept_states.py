"""The states a regeneration kept (``regenerate.capture``) as a harvest's capture backend.

The regeneration's forwards computed the aux-layer inputs and the pre-norm last state of every token
it fed; with ``capture`` it kept those of each sample the harvest stores (``DIR/states/``, one file
per batch, written before the batch's part). A harvest of ``DIR/dataset/regenerated.jsonl`` then
looks each sample's token ids up there instead of running the target again (``harvest.fused``), a
sample cut at ``max_seq_len`` by its prefix. What is not found (a record edited since) is computed
by the target as usual, and counted. The regeneration's manifest says what made the states; a
harvest with another target, weights, dtype, chat template or aux layers does not use them
(``fused=on``: fails naming the key).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from data_gen.engine import Captured
from eagle3.errors import Eagle3Error
from eagle3.store.shards import HarvestSpec

_PREFIX = 32  # ids that key the index (a sample cut at max_seq_len is found by its prefix)
STATES = "states"


def states_path(out_dir: Path, batch: int) -> Path:
    """Batch ``batch``'s kept states in regeneration folder ``out_dir``."""
    return out_dir / STATES / f"part-{batch:06d}.safetensors"


def write_states(path: Path, captured: Sequence[Captured]) -> None:
    """A batch's kept states, atomically: per sample ``k``, ``k.ids`` [T], ``k.aux`` [T, A, H], ``k.last`` [T, H]."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for k, c in enumerate(captured):
        tensors[f"{k}.ids"] = torch.tensor(c.ids, dtype=torch.int64)
        tensors[f"{k}.aux"], tensors[f"{k}.last"] = c.aux.contiguous(), c.last.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)


class KeptStatesError(Eagle3Error, ValueError):
    """The kept states cannot serve this harvest (``harvest.fused=on``); the message names the key."""


def regeneration_dir(data: Path) -> Path:
    """The regeneration folder of ``DIR/dataset/regenerated.jsonl``."""
    return data.parent.parent


def check_kept(folder: Path, spec: HarvestSpec, target_dtype: str) -> str | None:
    """Why the states kept in ``folder`` cannot serve a harvest of ``spec`` (a recipe key and the
    values), or None when they can."""
    try:
        settings = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{folder}/manifest.json is missing or unreadable"
    if not settings.get("capture") or not (folder / STATES).is_dir():
        return f"{folder} was regenerated without regenerate.capture"
    wanted = {
        "target.name_or_path": (settings.get("target"), spec.target),
        "target (its weights)": (settings.get("weights_fingerprint"), spec.weights_fingerprint),
        "target.dtype": (settings.get("dtype"), target_dtype),
        "target (its chat template)": (settings.get("chat_template_sha256"), spec.chat_template_sha256),
        "target.aux_layer_ids": (settings.get("aux_layer_ids"), list(spec.aux_layer_ids)),
    }
    for key, (made, now) in wanted.items():
        if made != now:
            return f"{key}: {made!r} in the regeneration, {now!r} in this harvest"
    if spec.store != "last":
        return f"harvest.store={spec.store}: the kept states are the last state, not top-k log-probs"
    made = settings.get("capture_dtype")
    if made != "float32" and made != spec.dtype:
        return f"harvest.dtype: {spec.dtype!r} here, the states were kept in {made!r} (regenerate.capture_dtype)"
    return None


class KeptStates:
    """A capture backend (``capture(sequences)`` as :class:`eagle3.store.capture.HFCapture`) that
    reads the kept states, and runs ``fallback`` for sequences that are not there."""

    def __init__(self, folder: Path, fallback: Any) -> None:
        from safetensors import safe_open

        self.fallback = fallback
        self.found = self.computed = 0
        self._files: list[Any] = []
        self._index: dict[tuple[int, ...], list[tuple[int, str, list[int]]]] = {}
        for path in sorted((folder / STATES).glob("part-*.safetensors")):
            handle = safe_open(str(path), framework="pt")
            f = len(self._files)
            self._files.append(handle)
            for name in handle.keys():
                if name.endswith(".ids"):
                    ids = handle.get_tensor(name).tolist()
                    self._index.setdefault(tuple(ids[:_PREFIX]), []).append((f, name[:-4], ids))

    def _lookup(self, seq: Sequence[int]) -> dict[str, torch.Tensor] | None:
        seq = list(seq)
        for f, key, ids in self._index.get(tuple(seq[:_PREFIX]), []):
            if len(ids) >= len(seq) and ids[:len(seq)] == seq:
                handle, n = self._files[f], len(seq)
                return {"aux": handle.get_slice(f"{key}.aux")[:n].float(),
                        "last": handle.get_slice(f"{key}.last")[:n].float()}
        return None

    def capture(self, sequences: Sequence[Sequence[int]]) -> list[dict[str, torch.Tensor]]:
        rows = [self._lookup(seq) for seq in sequences]
        missing = [i for i, row in enumerate(rows) if row is None]
        self.found += len(rows) - len(missing)
        if missing:
            self.computed += len(missing)
            for i, row in zip(missing, self.fallback.capture([sequences[i] for i in missing]), strict=True):
                rows[i] = row
        return rows  # type: ignore[return-value]


def kept_backend(mode: str, data: Path, spec: HarvestSpec, target_dtype: str, fallback: Any) -> Any:
    """``fallback`` or, where ``mode`` (harvest.fused) allows and the states fit, :class:`KeptStates`."""
    if mode == "off":
        return fallback
    folder = regeneration_dir(data)
    why = check_kept(folder, spec, target_dtype)
    if why is None:
        return KeptStates(folder, fallback)
    if mode == "on":
        raise KeptStatesError(f"harvest.fused=on: the states kept in {folder}/states cannot be used: {why}")
    if (folder / STATES).is_dir():  # kept, but not for this harvest: said, then computed
        print(f"harvest: not reading the states kept in {folder}/states ({why}); running the target",
              file=sys.stderr)
    return fallback


__all__ = ["KeptStates", "KeptStatesError", "check_kept", "kept_backend", "regeneration_dir", "states_path",
           "write_states"]
