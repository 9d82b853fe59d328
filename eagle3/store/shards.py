"""The harvest store: the one contract between the harvester (writes) and the trainer (reads).

A store is a folder::

    manifest.json                 written last: shards, counts, sha256 per shard, harvest spec
    shard-00000.safetensors       samples [start, end) of the harvest plan, concatenated on tokens
    ...

Per shard (``T`` tokens of ``n`` samples; ``A`` aux layers; ``H`` the target's hidden size)::

    input_ids    int32   [T]
    loss_mask    uint8   [T]            1 on assistant tokens (what the draft is trained on)
    offsets      int64   [n + 1]        sample k is tokens offsets[k]:offsets[k+1]
    aux          dtype   [T, A, H]      inputs of the aux layers, ascending ids
    last         dtype   [T, H]         pre-norm output of the last decoder layer
    aux_scale    float32 [T, A]         fp8 only: per-row scales (value = q * scale)
    last_scale   float32 [T]            fp8 only
    topk_ids     int32   [T, K]         store="topk" instead of ``last``: the target's top-K
    topk_logprobs float32 [T, K]        next-token log-probs at each position

The safetensors metadata holds the sample ids (key ``eagle3``: JSON with ``samples``). ``dtype`` is bfloat16
(default) or float8_e4m3fn with one fp32 scale per row, which halves the disk.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from eagle3.atomic import atomic_write_bytes, atomic_write_text
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.fingerprint import UNKNOWN_WEIGHTS, sha256_file
from eagle3.store.feed import StoreFeed

MANIFEST = "manifest.json"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn, "float32": torch.float32}


class StoreError(Eagle3Error, RuntimeError):
    """A store is incomplete, corrupt or does not match the target; the message names the file."""


@dataclass(frozen=True)
class HarvestSpec:
    """What a store was harvested from and how; pinned in the manifest and checked by readers."""

    target: str
    weights_fingerprint: str
    tokenizer_sha256: str
    chat_template_sha256: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: tuple[int, ...]
    dtype: str = "bfloat16"
    store: str = "last"  # "last" (pre-norm last state) or "topk" (target log-probs)
    topk: int = 0
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        if self.dtype not in STORE_DTYPES:
            raise ConfigError(f"harvest dtype {self.dtype!r}: expected one of {', '.join(STORE_DTYPES)}")
        if self.store not in ("last", "topk") or (self.store == "topk") != (self.topk > 0):
            raise ConfigError(f"harvest store={self.store!r} topk={self.topk}: "
                              "use store=last, or store=topk with topk > 0")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HarvestSpec:
        return cls(**{**data, "aux_layer_ids": tuple(data["aux_layer_ids"])})

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "aux_layer_ids": list(self.aux_layer_ids)}


@dataclass
class Sample:
    """One harvested sequence, in float32 (or the stored dtype's dequantised values)."""

    id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    aux: torch.Tensor  # [T, A, H]
    last: torch.Tensor | None = None  # [T, H]
    topk_ids: torch.Tensor | None = None  # [T, K]
    topk_logprobs: torch.Tensor | None = None  # [T, K]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


# ---------------------------------------------------------------- fp8 with per-row scales

def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn values and fp32 scales, one per row (last dim): x ~= q * scale."""
    amax = x.float().abs().amax(dim=-1)  # [...]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return q.float() if scale is None else q.float() * scale.unsqueeze(-1)


def _encode(x: torch.Tensor, dtype: str, name: str) -> dict[str, torch.Tensor]:
    if dtype == "float8_e4m3fn":
        q, scale = quantize_fp8(x)
        return {name: q, f"{name}_scale": scale}
    return {name: x.to(STORE_DTYPES[dtype]).contiguous()}


def encode_shard(samples: Sequence[Sample], spec: HarvestSpec) -> tuple[bytes, int]:
    """Serialise samples as one safetensors shard; returns (bytes, tokens)."""
    if not samples:
        raise ValueError("a shard needs at least one sample")
    lengths = [len(s) for s in samples]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    tensors: dict[str, torch.Tensor] = {
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),
        "offsets": offsets,
    }
    tensors |= _encode(torch.cat([s.aux for s in samples]), spec.dtype, "aux")
    if spec.store == "last":
        tensors |= _encode(torch.cat([s.last for s in samples]), spec.dtype, "last")
    else:
        tensors["topk_ids"] = torch.cat([s.topk_ids for s in samples]).to(torch.int32)
        tensors["topk_logprobs"] = torch.cat([s.topk_logprobs for s in samples]).float()
    # One metadata key: safetensors writes its metadata map in an order that can change from
    # call to call when it has several keys, and shards must be byte-identical on rerun.
    metadata = {"eagle3": json.dumps({"format": "eagle3-harvest-1", "samples": [s.id for s in samples]})}
    return save(tensors, metadata=metadata), int(offsets[-1])


def as_stored(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """States as a reader of their shard gets them back: through the store's dtype, as fp32."""
    encoded = _encode(x, dtype, "x")
    return dequantize(encoded["x"], encoded.get("x_scale"))


def write_shard(path: Path, samples: Sequence[Sample], spec: HarvestSpec) -> int:
    data, tokens = encode_shard(samples, spec)
    atomic_write_bytes(path, data)
    return tokens


def bytes_per_token(spec: HarvestSpec) -> float:
    """Disk per stored token (input id, mask and states), before safetensors' header."""
    a, h = len(spec.aux_layer_ids), spec.hidden_size
    width = {"bfloat16": 2, "float8_e4m3fn": 1, "float32": 4}[spec.dtype]
    scales = 4 * (a + (spec.store == "last")) if spec.dtype == "float8_e4m3fn" else 0
    states = a * h * width + (h * width if spec.store == "last" else spec.topk * 8)
    return 4 + 1 + states + scales


# ---------------------------------------------------------------- the manifest

def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def shard_entry(path: Path, samples: int, tokens: int, loss_tokens: int) -> dict[str, Any]:
    """A finished shard's line in the manifest (its size and sha256 read from the file)."""
    return {"file": path.name, "samples": samples, "tokens": tokens, "loss_tokens": loss_tokens,
            "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_manifest(root: Path, spec: HarvestSpec, shards: list[dict[str, Any]], counts: dict[str, int],
                   config: dict[str, Any]) -> dict[str, Any]:
    """Written last, atomically: a store without a manifest is incomplete."""
    manifest = {
        "format": "eagle3-harvest-1",
        "spec": spec.to_json(),
        "shards": shards,
        "samples": sum(s["samples"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "loss_tokens": sum(s["loss_tokens"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
        "counts": counts,
        "config": config,
    }
    atomic_write_text(root / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(root: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(root) / MANIFEST
    if not Path(root).is_dir():
        raise StoreError(f"{root}: no such store (a folder written by the harvest)")
    if not path.is_file():
        raise StoreError(f"{path}: missing; the harvest has not finished (rerun it to complete the store)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise StoreError(f"{path}: not valid JSON ({err})") from err


def verify_store(root: str | os.PathLike[str], part: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Re-check every shard's sha256, tensor names, shapes and dtypes against the manifest;
    ``part=(i, n)``: only shards i, i+n, i+2n, ... (one worker's share)."""
    root = Path(root)
    manifest = read_manifest(root)
    spec = HarvestSpec.from_json(manifest["spec"])
    i, n = part
    for entry in manifest["shards"][i::n]:
        path = root / entry["file"]
        if not path.is_file():
            raise StoreError(f"{path}: missing shard")
        if sha256_file(path) != entry["sha256"]:
            raise StoreError(f"{path}: sha256 differs from the manifest (corrupt or truncated shard)")
        check_shard(path, spec, entry)
    return manifest


def verify_stores(roots: Sequence[str], record: Path, rank: int = 0, world_size: int = 1,
                  any_rank: Callable[[bool], bool] = bool) -> list[str]:
    """Every shard of ``roots`` checked against its manifest (sha256, tensor shapes) before a run reads
    a sample, the shards split over ``world_size`` ranks (``any_rank(flag)``: whether any rank's flag is
    set; every rank calls this). A store verified before and unchanged since (its manifest, each
    shard's size and modification time, kept in ``record``) is not hashed again, so a resume costs
    nothing. Returns the stores hashed now; a bad shard raises :class:`StoreError` naming it on the
    rank that read it (the others: that another rank failed)."""
    try:
        known = json.loads(record.read_text()) if record.is_file() else {}
    except ValueError:
        known = {}
    states = {root: store_state(root) for root in dict.fromkeys(roots)}
    todo = [root for root, state in states.items() if not state or known.get(os.path.realpath(root)) != state]
    bad: StoreError | None = None
    for root in todo:
        try:
            verify_store(root, (rank, world_size))
        except StoreError as err:
            bad = err
            break
    failed = any_rank(bad is not None)
    if bad is not None:
        raise bad
    if failed:
        raise StoreError("a store failed its verification on another rank (its message names the shard)")
    if rank == 0 and todo:
        record.parent.mkdir(parents=True, exist_ok=True)
        known |= {os.path.realpath(root): states[root] for root in todo if states[root]}
        atomic_write_text(record, json.dumps(known, indent=1) + "\n")
    return todo


def store_state(root: str | os.PathLike[str]) -> dict[str, Any]:
    """What a verification of ``root`` vouches for, without reading a shard: the manifest's sha256
    and each shard file's size and modification time (a store verified once need not be hashed
    again while this is unchanged)."""
    root = Path(root)
    files = {}
    for entry in read_manifest(root)["shards"]:
        try:
            stat = (root / entry["file"]).stat()
        except OSError:
            return {}  # a missing shard: never vouched for
        files[entry["file"]] = [stat.st_size, stat.st_mtime_ns]
    return {"manifest_sha256": sha256_file(root / MANIFEST), "shards": files}


def check_shard(path: Path, spec: HarvestSpec, entry: dict[str, Any]) -> None:
    t, n, a, h = entry["tokens"], entry["samples"], len(spec.aux_layer_ids), spec.hidden_size
    want = {"input_ids": [t], "loss_mask": [t], "offsets": [n + 1], "aux": [t, a, h]}
    want |= {"last": [t, h]} if spec.store == "last" else {"topk_ids": [t, spec.topk], "topk_logprobs": [t, spec.topk]}
    if spec.dtype == "float8_e4m3fn":
        want["aux_scale"] = [t, a]
        if spec.store == "last":
            want["last_scale"] = [t]
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            if names != set(want):
                raise StoreError(f"{path}: tensors {sorted(names)}, expected {sorted(want)}")
            for name, shape in want.items():
                got = f.get_slice(name).get_shape()
                if list(got) != shape:
                    raise StoreError(f"{path}: {name} has shape {list(got)}, expected {shape}")
    except StoreError:
        raise
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise StoreError(f"{path}: unreadable shard ({err})") from err


def check_compatible(spec: HarvestSpec, *, tokenizer_sha256: str | None = None, num_layers: int | None = None,
                     hidden_size: int | None = None, vocab_size: int | None = None, where: str = "store") -> None:
    """Raise naming the key if a store does not belong to this target."""
    for key, value in (("tokenizer_sha256", tokenizer_sha256), ("num_layers", num_layers),
                       ("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if value is not None and getattr(spec, key) != value:
            raise StoreError(f"{where}: harvested with {key}={getattr(spec, key)!r}, but the target has {value!r}")


# ---------------------------------------------------------------- reading

def _read_sample(f: Any, spec: HarvestSpec, sample_id: str, a: int, b: int, stored: bool = False) -> Sample:
    """Tokens [a, b) of an open shard as one sample: states in fp32 (fp8 dequantised), or with
    ``stored`` in the store's own dtype where it is a float one (bf16 stays bf16: half the bytes to
    copy, pin and move; the trainer converts on the device)."""
    def rows(name: str) -> torch.Tensor:
        return f.get_slice(name)[a:b]

    def states(name: str) -> torch.Tensor:
        if stored and spec.dtype != "float8_e4m3fn":
            return rows(name)
        scale = rows(f"{name}_scale") if spec.dtype == "float8_e4m3fn" else None
        return dequantize(rows(name), scale)

    sample = Sample(id=sample_id, input_ids=rows("input_ids").long(), loss_mask=rows("loss_mask").bool(),
                    aux=states("aux"))
    if spec.store == "last":
        sample.last = states("last")
    else:
        sample.topk_ids = rows("topk_ids").long()
        sample.topk_logprobs = rows("topk_logprobs")
    return sample


def read_shard(path: str | os.PathLike[str], spec: HarvestSpec) -> list[Sample]:
    """Every sample of one shard file, in order."""
    try:
        with safe_open(str(path), framework="pt") as f:
            offsets = f.get_tensor("offsets").tolist()
            ids = json.loads(f.metadata()["eagle3"])["samples"]
            return [_read_sample(f, spec, ids[j], offsets[j], offsets[j + 1]) for j in range(len(ids))]
    except StoreError:
        raise
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise StoreError(f"{path}: unreadable shard ({err})") from err


@dataclass
class _ShardIndex:
    path: Path
    offsets: list[int]
    ids: list[str]


@dataclass
class HarvestStore(StoreFeed):
    """Random access over a finished store: memory-mapped shards, one sample at a time.

    ``store[i]`` reads only sample i's rows (safetensors slices); ``lengths`` lets a
    sampler bucket by length without touching the states.
    """

    root: Path
    manifest: dict[str, Any] = field(init=False)
    spec: HarvestSpec = field(init=False)
    lengths: list[int] = field(init=False)
    _index: list[tuple[int, int]] = field(init=False)  # sample -> (shard, position in shard)
    _shards: list[_ShardIndex] = field(init=False)

    def identity(self) -> list[str]:
        return [entry["sha256"] for entry in self.manifest["shards"]]

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.manifest = read_manifest(self.root)
        self.spec = HarvestSpec.from_json(self.manifest["spec"])
        self._shards, self._index, self.lengths = [], [], []
        for k, entry in enumerate(self.manifest["shards"]):
            path = self.root / entry["file"]
            try:
                with safe_open(str(path), framework="pt") as f:
                    offsets = f.get_tensor("offsets").tolist()
                    ids = json.loads(f.metadata()["eagle3"])["samples"]
            except Exception as err:
                raise StoreError(f"{path}: unreadable shard ({err}); run verify") from err
            self._shards.append(_ShardIndex(path, offsets, ids))
            for j in range(len(ids)):
                self._index.append((k, j))
                self.lengths.append(offsets[j + 1] - offsets[j])

    def __len__(self) -> int:
        return len(self._index)

    @property
    def sample_ids(self) -> list[str]:
        """The id of every sample, in store order (no tensor is read)."""
        return [self._shards[k].ids[j] for k, j in self._index]

    def token_columns(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample i's (input_ids [T] int64, loss_mask [T] bool), without reading any state."""
        k, j = self._index[i]
        shard = self._shards[k]
        a, b = shard.offsets[j], shard.offsets[j + 1]
        with safe_open(str(shard.path), framework="pt") as f:
            return f.get_slice("input_ids")[a:b].long(), f.get_slice("loss_mask")[a:b].bool()

    def token_digests(self) -> list[bytes]:
        """A digest of each sample's token ids, in store order: equal conversations, equal digests
        (each shard's ``input_ids`` column is read once; no state is)."""
        out = []
        for shard in self._shards:
            with safe_open(str(shard.path), framework="pt") as f:
                ids = f.get_tensor("input_ids").to(torch.int64).numpy()
            out += [hashlib.blake2b(ids[a:b].tobytes(), digest_size=16).digest()
                    for a, b in zip(shard.offsets[:-1], shard.offsets[1:], strict=True)]
        return out

    def check_target(self, target: Any) -> None:
        """Raise naming the key if this store was not harvested from ``target`` (an eagle3 Target)."""
        from eagle3.fingerprint import tokenizer_fingerprint

        check_compatible(self.spec, tokenizer_sha256=tokenizer_fingerprint(target.tokenizer),
                         num_layers=target.num_layers, hidden_size=target.hidden_size,
                         vocab_size=target.vocab_size, where=str(self.root / MANIFEST))

    @property
    def shard_of(self) -> list[int]:
        """The shard of every sample, by index."""
        return [k for k, _ in self._index]

    def __getitem__(self, i: int) -> Sample:
        return self.read(i)

    def verified_files(self) -> list[str]:
        return [str(self.root)]

    def read(self, i: int, stored: bool = False) -> Sample:
        """Sample i; ``stored``: its states in the store's float dtype rather than fp32 (:func:`_read_sample`)."""
        k, j = self._index[i]
        shard = self._shards[k]
        with safe_open(str(shard.path), framework="pt") as f:
            return _read_sample(f, self.spec, shard.ids[j], shard.offsets[j], shard.offsets[j + 1], stored)

    def __iter__(self) -> Iterator[Sample]:
        """Stream every sample, shard by shard."""
        for i in range(len(self)):
            yield self[i]


class StoreUnion(StoreFeed):
    """Several finished stores of the same target and layers read as one (e.g. a base store and
    the stores mining rounds appended): indices run through the stores in order."""

    def __init__(self, roots: Sequence[str | os.PathLike[str]]) -> None:
        if not roots:
            raise StoreError("a store union needs at least one store")
        self.stores = [HarvestStore(Path(r)) for r in roots]
        self.root = self.stores[0].root
        self.spec = self.stores[0].spec
        same = ("weights_fingerprint", "tokenizer_sha256", "num_layers", "hidden_size", "vocab_size",
                "aux_layer_ids", "store", "topk")
        for other in self.stores[1:]:
            # the weights' fingerprint names the target; the typed name only where no fingerprint was taken
            unknown = self.spec.weights_fingerprint in UNKNOWN_WEIGHTS
            for key in (("target",) if unknown else ()) + same:
                if getattr(other.spec, key) != getattr(self.spec, key):
                    raise StoreError(f"{other.root / MANIFEST}: spec.{key}={getattr(other.spec, key)!r} differs from "
                                     f"{self.root / MANIFEST}'s {getattr(self.spec, key)!r}: stores cannot be combined")
        self.lengths = [n for st in self.stores for n in st.lengths]
        self._where = [(k, i) for k, st in enumerate(self.stores) for i in range(len(st))]
        self.manifest = {"spec": self.stores[0].manifest["spec"],
                         "shards": [entry for st in self.stores for entry in st.manifest["shards"]]}

    def __len__(self) -> int:
        return len(self._where)

    def identity(self) -> list[str]:
        return [entry["sha256"] for entry in self.manifest["shards"]]

    @property
    def sample_ids(self) -> list[str]:
        return [sid for st in self.stores for sid in st.sample_ids]

    @property
    def shard_of(self) -> list[int]:
        """The shard of every sample, numbered through the stores in order."""
        out, first = [], 0
        for st in self.stores:
            out += [first + k for k in st.shard_of]
            first += len(st.manifest["shards"])
        return out

    def token_columns(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, j = self._where[i]
        return self.stores[k].token_columns(j)

    def token_digests(self) -> list[bytes]:
        return [d for st in self.stores for d in st.token_digests()]

    def verified_files(self) -> list[str]:
        return [str(st.root) for st in self.stores]

    def check_target(self, target: Any) -> None:
        for st in self.stores:
            st.check_target(target)

    def __getitem__(self, i: int) -> Sample:
        return self.read(i)

    def read(self, i: int, stored: bool = False) -> Sample:
        k, j = self._where[i]
        return self.stores[k].read(j, stored)

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]


def open_stores(roots: Sequence[str | os.PathLike[str]]) -> HarvestStore | StoreUnion:
    """One store as itself, several as a :class:`StoreUnion`."""
    return HarvestStore(Path(roots[0])) if len(roots) == 1 else StoreUnion(roots)


def compare_stores(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> dict[str, float]:
    """Max relative error (max |b - a| / max |a|, per sample, worst over samples) of every
    stored state of ``b`` against ``a``: e.g. a vLLM harvest against an HF one."""
    left, right = HarvestStore(Path(a)), HarvestStore(Path(b))
    if left.lengths != right.lengths or left.spec.aux_layer_ids != right.spec.aux_layer_ids:
        raise StoreError(f"{a} and {b} hold different samples or layers")
    worst: dict[str, float] = {}

    def note(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        worst[name] = max(worst.get(name, 0.0), ((y - x).abs().max() / x.abs().max().clamp(min=1e-12)).item())

    for x, y in zip(left, right, strict=True):
        if not (torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)):
            raise StoreError(f"sample {x.id}: token ids or loss mask differ between {a} and {b}")
        for k, layer in enumerate(left.spec.aux_layer_ids):
            note(f"layer_{layer}_input", x.aux[:, k], y.aux[:, k])
        if x.last is not None and y.last is not None:
            note("last_pre_norm", x.last, y.last)
    return worst



def shard_plan(lengths: Sequence[int], bytes_per_tok: float, max_shard_bytes: int) -> list[tuple[int, int]]:
    """Cut samples ``[0, n)`` into consecutive shards of at most ``max_shard_bytes`` (a longer
    sample gets a shard of its own). Depends only on the lengths: every worker and every
    rerun computes the same plan."""
    plan: list[tuple[int, int]] = []
    start, size = 0, 0.0
    for i, n in enumerate(lengths):
        cost = n * bytes_per_tok
        if i > start and size + cost > max_shard_bytes:
            plan.append((start, i))
            start, size = i, 0.0
        size += cost
    if start < len(lengths):
        plan.append((start, len(lengths)))
    return plan


def projected_bytes(lengths: Sequence[int], spec: HarvestSpec) -> int:
    return int(math.ceil(sum(lengths) * bytes_per_token(spec)))
