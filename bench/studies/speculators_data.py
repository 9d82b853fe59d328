"""Convert a harvest store into the offline-training input of the speculators peer (0.9.0).

Runs in the project's main venv (no speculators needed)::

    .venv/bin/python bench/studies/speculators_data.py --store runs/quickstart/harvest --out runs/race/spec-data \\
        --draft-vocab runs/quickstart/train/draft_vocab.safetensors

What speculators' ``ArrowDataset`` + file backend read from ``--data-path`` (checked against its
0.9.0 source), and what we write there::

    OUT/                          a ``datasets`` folder (``save_to_disk``), torch format, one row per
                                  sample: input_ids int64 [T], loss_mask int64 [T], seq_len int
    OUT/hidden_states/hs_<i>.safetensors
                                  row i's states: token_ids int64 [T] (must equal the row's
                                  input_ids) and hidden_states [T, A + 1, H] = the A aux layers in
                                  ascending layer id, then the target's PRE-norm last-layer state
                                  (speculators applies the verifier's final norm + lm_head to it)
    OUT/token_freq.pt             {token id: count} over the loss-masked tokens of the training rows
    OUT/d2t-<N>.npy, t2d-<N>.npy  with --draft-vocab: our draft vocab (int64 offsets, bool mask)
    OUT/eagle3_conversion.json    ours: store, target shape, aux ids, the train/val split, options

Rows are ordered training samples first, then held-out samples, so that speculators'
``--train-data-ratio`` (a head/tail split of the rows) reproduces our split exactly; the ratio to
pass is in ``eagle3_conversion.json`` (bench/studies/speculators_train.py reads it).

Loss mask: our stores mark assistant tokens (1 on x[i] when x[i] is an assistant token), which is
the same per-token convention speculators' own preprocessing writes, so ``--loss-mask native``
(default) copies it. Note that speculators gates the loss of the prediction of x[t+2] with the
mask of x[t+1] (its ``shift_batch`` takes ``loss_mask[1:]``), one token earlier than our trainer;
``--loss-mask predicted`` writes the mask shifted left by one so that its loss is gated by the
predicted token, as ours is. The same folder feeds speculators' P-EAGLE (shifted as EAGLE-3) and
DFlash, which reads it unshifted: there the native mask already gates each slot by the token it
predicts, and ``predicted`` would be one token late. The whole folder is written under a temporary
name and renamed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]

from eagle3.atomic import atomic_dir  # noqa: E402
from eagle3.draft.vocab import DraftVocab  # noqa: E402
from eagle3.store.batches import split_by_id  # noqa: E402
from eagle3.store.shards import HarvestStore, StoreError  # noqa: E402

FORMAT = "eagle3-speculators-data-1"
SPECULATORS_VERSION = "0.9.0"
HS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class ConvertError(RuntimeError):
    """Bad input for the conversion; the message names the file."""


def read_draft_vocab_file(path: Path, vocab_size: int) -> DraftVocab:
    """Our ``draft_vocab.safetensors``, or a draft folder in any format ``eagle3.export`` reads."""
    from eagle3.export import read_draft_vocab

    try:
        return read_draft_vocab(path, vocab_size)
    except (ValueError, FileNotFoundError) as err:
        raise ConvertError(str(err)) from None


def _split(store: HarvestStore, eval_store: HarvestStore | None, eval_fraction: float
           ) -> tuple[list[tuple[HarvestStore, int]], list[tuple[HarvestStore, int]]]:
    if eval_store is not None:
        return [(store, i) for i in range(len(store))], [(eval_store, i) for i in range(len(eval_store))]
    train_idx, eval_idx = split_by_id(store.sample_ids, eval_fraction)
    return [(store, i) for i in train_idx], [(store, i) for i in eval_idx]


def _mask(loss_mask: torch.Tensor, mode: str) -> torch.Tensor:
    mask = loss_mask.long()
    if mode == "predicted":  # speculators gates with mask[t+1]; make that the mask of x[t+2]
        mask = torch.cat([mask[1:], mask.new_zeros(1)])
    return mask


def convert(store_path: Path, out: Path, *, eval_store_path: Path | None = None, eval_fraction: float = 0.1,
            draft_vocab: Path | None = None, loss_mask: str = "native", hs_dtype: str = "auto",
            max_seq_len: int | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Write ``out`` (see the module doc); returns the conversion record."""
    if out.exists() and not overwrite:
        raise ConvertError(f"{out}: exists; pass --overwrite to replace it")
    if loss_mask not in ("native", "predicted"):
        raise ConvertError(f"--loss-mask {loss_mask!r}: expected native or predicted")
    try:
        store = HarvestStore(store_path)
        eval_store = HarvestStore(eval_store_path) if eval_store_path is not None else None
    except StoreError as err:
        raise ConvertError(str(err)) from err
    spec = store.spec
    if spec.store != "last":
        raise ConvertError(f"{store_path / 'manifest.json'}: a store={spec.store!r} store keeps no last-layer "
                           "state; speculators needs it (harvest with store=last)")
    if eval_store is not None:
        e = eval_store.spec
        for key in ("store", "num_layers", "hidden_size", "vocab_size", "aux_layer_ids", "tokenizer_sha256"):
            if getattr(e, key) != getattr(spec, key):
                raise ConvertError(f"{eval_store_path / 'manifest.json'}: {key}={getattr(e, key)!r} differs from the "
                                   f"training store's {getattr(spec, key)!r}")
    if hs_dtype == "auto":  # bf16 stays exact in bf16; fp8/fp32 values are exact only in fp32
        hs_dtype = "bfloat16" if spec.dtype == "bfloat16" else "float32"
    if hs_dtype not in HS_DTYPES:
        raise ConvertError(f"--hs-dtype {hs_dtype!r}: expected auto, bfloat16 or float32")
    vocab = read_draft_vocab_file(draft_vocab, spec.vocab_size) if draft_vocab is not None else None

    train_rows, eval_rows = _split(store, eval_store, eval_fraction)
    if not train_rows:
        raise ConvertError(f"{store_path}: no training samples after the split (eval_fraction={eval_fraction})")
    rows = train_rows + eval_rows
    started = time.perf_counter()
    columns: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    ids, freq, tokens, loss_tokens, truncated = [], torch.zeros(spec.vocab_size, dtype=torch.int64), 0, 0, 0
    with atomic_dir(out) as tmp:
        hs_dir = tmp / "hidden_states"
        hs_dir.mkdir()
        for row, (src, i) in enumerate(rows):
            sample = src[i]
            if sample.last is None:
                raise ConvertError(f"{src.root}: sample {sample.id} has no last-layer state")
            n = len(sample)
            if max_seq_len is not None and n > max_seq_len:
                n, truncated = max_seq_len, truncated + 1
            input_ids = sample.input_ids[:n].long().contiguous()
            mask = _mask(sample.loss_mask, loss_mask)[:n].contiguous()
            states = torch.cat([sample.aux[:n], sample.last[:n].unsqueeze(1)], dim=1)  # [T, A + 1, H]
            save_file({"token_ids": input_ids, "hidden_states": states.to(HS_DTYPES[hs_dtype]).contiguous()},
                      str(hs_dir / f"hs_{row}.safetensors"))
            columns["input_ids"].append(input_ids.tolist())
            columns["loss_mask"].append(mask.tolist())
            columns["seq_len"].append(n)
            ids.append(sample.id)
            tokens += n
            loss_tokens += int(mask.sum())
            if row < len(train_rows):  # speculators counts the training rows' loss-masked tokens
                freq += torch.bincount(input_ids[mask.bool()], minlength=spec.vocab_size)[: spec.vocab_size]
        _write_dataset(tmp, columns)
        counts = {int(t): int(c) for t, c in enumerate(freq.tolist()) if c}
        torch.save(counts, tmp / "token_freq.pt")
        if vocab is not None:
            np.save(tmp / f"d2t-{vocab.size}.npy", vocab.d2t.numpy().astype(np.int64))
            np.save(tmp / f"t2d-{vocab.size}.npy", vocab.t2d.numpy().astype(bool))
        n_rows = len(rows)
        record = {
            "format": FORMAT,
            "for": f"speculators=={SPECULATORS_VERSION} offline EAGLE-3 training (file backend)",
            "store": str(store_path.resolve()),
            "eval_store": str(eval_store_path.resolve()) if eval_store_path is not None else None,
            "eval_fraction": None if eval_store_path is not None else eval_fraction,
            "target": spec.target,
            "num_layers": spec.num_layers,
            "hidden_size": spec.hidden_size,
            "vocab_size": spec.vocab_size,
            "aux_layer_ids": list(spec.aux_layer_ids),
            "hidden_states_layout": "[T, A+1, H]: aux layers ascending, then pre-norm last-layer state",
            "hidden_states_dtype": hs_dtype,
            "store_dtype": spec.dtype,
            "loss_mask": loss_mask,
            "rows": n_rows,
            "train_rows": len(train_rows),
            "val_rows": len(eval_rows),
            # speculators splits at int(rows * ratio); half a row of slack makes that exactly train_rows
            "train_data_ratio": (len(train_rows) + 0.5) / n_rows if eval_rows else None,
            "tokens": tokens,
            "loss_tokens": loss_tokens,
            "truncated_samples": truncated,
            "draft_vocab": None if vocab is None else {
                "source": str(draft_vocab), "size": vocab.size,
                "d2t": f"d2t-{vocab.size}.npy", "t2d": f"t2d-{vocab.size}.npy"},
            "sample_ids": ids,
        }
        (tmp / "eagle3_conversion.json").write_text(json.dumps(record, indent=1) + "\n")
    record["seconds"] = round(time.perf_counter() - started, 2)
    return record


def _write_dataset(folder: Path, columns: dict[str, list[Any]]) -> None:
    import datasets
    from datasets import Dataset, Features, Sequence, Value

    datasets.disable_progress_bars()
    features = Features({"input_ids": Sequence(Value("int64")), "loss_mask": Sequence(Value("int64")),
                         "seq_len": Value("int64")})
    dataset = Dataset.from_dict(columns, features=features)
    dataset.set_format(type="torch")  # what speculators' preprocessing saves; its reader relies on it
    dataset.save_to_disk(str(folder))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", type=Path, required=True, help="harvest store folder (manifest.json + shards)")
    p.add_argument("--out", type=Path, required=True, help="folder to write (speculators' --data-path)")
    p.add_argument("--eval-store", type=Path, default=None,
                   help="a held-out store: its samples become speculators' validation rows")
    p.add_argument("--eval-fraction", type=float, default=0.1,
                   help="without --eval-store: hold out this fraction by sample-id hash, as our trainer's "
                        "train.data.eval_fraction does (default 0.1, the quickstart's)")
    p.add_argument("--draft-vocab", type=Path, default=None,
                   help="our draft_vocab.safetensors (d2t int64 offsets, t2d bool) or an exported draft folder")
    p.add_argument("--loss-mask", choices=("native", "predicted"), default="native",
                   help="native: our per-token assistant mask as is (speculators' convention); predicted: shifted "
                        "so that speculators gates each loss by the predicted token, as our trainer does")
    p.add_argument("--hs-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="dtype of the written hidden states (auto: bfloat16 for bf16 stores, else float32)")
    p.add_argument("--max-seq-len", type=int, default=None, help="truncate longer samples")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    if not 0.0 <= args.eval_fraction < 1.0:
        p.error(f"--eval-fraction {args.eval_fraction}: must be in [0, 1)")
    try:
        record = convert(args.store, args.out, eval_store_path=args.eval_store, eval_fraction=args.eval_fraction,
                         draft_vocab=args.draft_vocab, loss_mask=args.loss_mask, hs_dtype=args.hs_dtype,
                         max_seq_len=args.max_seq_len, overwrite=args.overwrite)
    except ConvertError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in record.items() if k != "sample_ids"}
    print(json.dumps({"out": str(args.out), **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
