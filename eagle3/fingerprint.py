"""Identities of files: a whole file's sha256 (shards, manifests, the weights files a run pins), and
cheap, stable ones of a target's weights and tokenizer, pinned in harvest manifests.

Hashing a frontier checkpoint (hundreds of GB) on every harvest is not an option, so the
weights fingerprint covers each safetensors file's name, size, header (names, dtypes,
shapes, offsets) and first MiB of data: any re-export, re-quantisation or different
checkpoint changes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

_DATA_BYTES = 1 << 20
UNKNOWN_WEIGHTS = ("in-memory", "no-local-weights")
"""What :func:`weights_fingerprint` returns where it could hash no weights: such values identify nothing."""


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a whole file, read in chunks (a shard, a manifest, a weights file a run pins)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def weights_fingerprint(folder: str | Path | None) -> str:
    """Of the safetensors files in ``folder``; ``"in-memory"`` for a model not loaded from a folder."""
    if not folder or not Path(folder).is_dir():
        return UNKNOWN_WEIGHTS[0]
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return UNKNOWN_WEIGHTS[1]
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = f.read(header_len)
            digest.update(f"{path.name}:{path.stat().st_size}:".encode())
            digest.update(header)
            digest.update(f.read(_DATA_BYTES))
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the vocabulary (token -> id) and the special tokens."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    return hashlib.sha256(json.dumps([vocab, special], ensure_ascii=False).encode("utf-8")).hexdigest()
