"""Drafts in the formats serving engines load, and back: export and import.

The formats (vLLM's plain layout, speculators', SGLang's) and their ``config.json`` are described
in :mod:`eagle3.draft.formats`. Aux layer ids inside this library always mean "the input of decoder
layer i" (HF ``hidden_states[i]``), ascending. ``load_draft`` reads all three formats and the
public ones they come from (EAGLE/SpecForge checkpoints in the plain layout, speculators
checkpoints), to evaluate a public draft or continue training it. Pickled ``.bin`` weights are
refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from eagle3.atomic import atomic_dir, holds_only
from eagle3.draft.families import family_of, family_reading
from eagle3.draft.formats import (
    FORMATS,
    MARKER,
    OUR_META,
    DraftFormatError,
    LoadedDraft,
    aux_ids_of,
    detect_format,
    draft_config_from_json,
    fill_draft,
    nonfinite_tensors,
    our_meta,
    read_json,
    specforge_ids,
)
from eagle3.draft.model import DraftConfig
from eagle3.draft.vocab import DraftVocab, read_vocab_file
from eagle3.errors import InputError, run_cli

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------- tensors


def engine_tensors(state: dict[str, Tensor], fmt: str, dtype: torch.dtype) -> dict[str, Tensor]:
    """Our state dict -> the format's tensors: no embedding, floats in ``dtype``, d2t int64, t2d bool.

    A draft over the whole target vocabulary is written without d2t/t2d: vLLM builds no mapping
    parameter when ``draft_vocab_size == vocab_size`` and refuses to load a checkpoint that has
    one (SGLang and our importer read the missing mapping as the identity)."""
    full_vocab = "d2t" in state and "t2d" in state and state["d2t"].numel() == state["t2d"].numel()
    if full_vocab and state["d2t"].any():
        raise DraftFormatError("the draft vocab is the whole target vocab but d2t is not the identity: engines read "
                               "a full-vocab draft's ids as the target's")
    out = {}
    for name, tensor in state.items():
        if name == "embed_tokens.weight" or (full_vocab and name in ("d2t", "t2d")):
            continue
        if fmt == "speculators" and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        if name == "d2t":
            tensor = tensor.to(torch.int64)
        elif name == "t2d":
            tensor = tensor.to(torch.bool)
        else:
            tensor = tensor.to(dtype)
        out[name] = tensor.detach().cpu().contiguous()
    return out


def _our_names(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """A checkpoint's names -> ours: ``layers.0.`` is the first layer (midlayer), ``model.`` dropped."""
    out = {}
    for name, tensor in tensors.items():
        if name.startswith("model."):
            name = name[len("model."):]
        if name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        out[name] = tensor
    return out


# ---------------------------------------------------------------- export


def _is_earlier_export(folder: Path) -> bool:
    """Only our files, and our mark on them (a downloaded draft has the same two file names)."""
    if not holds_only("model.safetensors", "config.json", OUR_META)(folder):
        return False
    if (folder / OUR_META).is_file():
        return True
    try:
        return MARKER in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False


def export_draft_folder(out: str | os.PathLike[str], state: dict[str, Tensor], config: DraftConfig,
                        aux_layer_ids: Sequence[int], fmt: str = "vllm", *, dtype: str = "bfloat16",
                        verifier: str | None = None, verifier_architectures: Sequence[str] = (),
                        speculative_tokens: int = 3, meta: dict[str, Any] | None = None) -> Path:
    """Write one draft folder in ``fmt`` atomically (complete or absent); returns its path.

    ``state``: an :class:`Eagle3Draft` state dict (our names). ``meta``: written as draft.json
    (our training record) next to the engine files. ``verifier`` (the target's name or path) is
    required by the speculators format, so that ``vllm serve <draft>`` knows the target.
    """
    if fmt not in FORMATS:
        raise DraftFormatError(f"format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise DraftFormatError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    extra = {} if fmt != "speculators" else {"verifier": verifier, "verifier_architectures": verifier_architectures,
                                             "speculative_tokens": speculative_tokens}
    cfg = family_of(config).engine_config(config, aux_layer_ids, fmt, dtype, **extra)
    tensors = engine_tensors(state, fmt, DTYPES[dtype])
    if nonfinite := nonfinite_tensors(tensors):
        raise DraftFormatError(f"{out}: not exported: NaN/Inf in {', '.join(nonfinite[:4])} (a diverged draft)")
    with atomic_dir(out, replaces=_is_earlier_export) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if meta is not None:
            (tmp / OUR_META).write_text(json.dumps(meta, indent=1) + "\n")
    return Path(out)


# ---------------------------------------------------------------- import


def load_draft(folder: str | os.PathLike[str], fmt: str = "auto", *,
               embed_tokens_weight: Tensor | None = None) -> LoadedDraft:
    """Read a draft folder (``config.json`` + ``model.safetensors``) of any supported format.

    ``fmt``: auto (from config.json; a plain folder counts as vllm) or one of FORMATS: pass
    ``sglang`` for a public SGLang-style folder whose ids follow SGLang's convention (our own
    sglang exports are recognised by their marker). ``embed_tokens_weight``: the target's
    embedding, used when the checkpoint has none (the usual case).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DraftFormatError(f"{folder}: not a draft folder")
    cfg = read_json(folder / "config.json")
    if fmt != "auto" and fmt not in FORMATS:
        raise DraftFormatError(f"format {fmt!r}: expected auto or one of {', '.join(FORMATS)}")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = (f" ({', '.join(pickles)} are pickles, never loaded here: convert them to safetensors "
                "yourself if you trust their source)") if pickles else ""
        raise DraftFormatError(f"{folder}: no .safetensors weights{hint}")
    owner = family_reading(cfg.get("architectures") or [])  # a family with its own layout reads the folder
    tensors: dict[str, Tensor] = {}
    for path in weights:
        try:
            tensors.update(load_file(str(path)) if owner else _our_names(load_file(str(path))))
        except (SafetensorError, OSError) as err:
            raise DraftFormatError(f"{path}: not a readable safetensors file ({err}); truncated or corrupt?") from None
    if owner is not None:
        if fmt not in ("auto", "vllm"):
            raise DraftFormatError(f"{folder}: a {', '.join(owner.architectures)} folder is a {owner.name} draft's own "
                                   f"layout; format {fmt!r} does not apply")
        return owner.load_folder(folder, cfg, tensors, embed_tokens_weight)
    found = detect_format(cfg, folder / "config.json", list(tensors))
    if fmt == "auto":
        fmt = found
        if fmt == "vllm" and (ids := specforge_ids(cfg)) is not None:
            fmt = "sglang"
            warnings.warn(f"{folder / 'config.json'}: eagle_config.eagle_aux_hidden_state_layer_ids={ids} only, "
                          f"starting at 1: read as SpecForge/ModelOpt/SGLang ids (layer outputs), i.e. the inputs "
                          f"of layers {[i + 1 for i in ids]}; vLLM would feed the inputs of layers {ids}. Pass "
                          "the vllm format to read them as vLLM does", stacklevel=2)
    if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise DraftFormatError(f"{folder / 'config.json'}: eagle_config.use_aux_hidden_state=false: this draft "
                               "reads the target's last hidden state, not aux layers (EAGLE-1/2 style); not "
                               "supported")
    ids = aux_ids_of(cfg, fmt, folder / "config.json")
    config = draft_config_from_json(cfg, fmt, folder / "config.json", len(ids) if ids else None,
                                    parallel="mask_hidden" in tensors)
    has_lm_head = "lm_head.weight" in tensors
    if not has_lm_head and config.draft_vocab_size != config.vocab_size:
        raise DraftFormatError(f"{folder}: no lm_head.weight and draft_vocab_size={config.draft_vocab_size} < "
                               f"vocab_size={config.vocab_size}: vLLM would give it the target's lm_head over the "
                               "whole vocabulary, which its d2t does not index; not servable")
    if not has_lm_head and config.hidden_size != config.target_hidden_size:
        raise DraftFormatError(f"{folder}: no lm_head.weight and hidden_size={config.hidden_size} != "
                               f"target_hidden_size={config.target_hidden_size}: the target's lm_head cannot "
                               "read this draft's states")
    if "fc.weight" in tensors:  # the checkpoint decides how many aux states fc reads
        width = tensors["fc.weight"].shape[1]
        if width % config.target_hidden_size:
            raise DraftFormatError(f"{folder}: fc.weight {tuple(tensors['fc.weight'].shape)} does not read a "
                                   f"multiple of target_hidden_size={config.target_hidden_size}")
        if width // config.target_hidden_size != config.num_aux_layers:
            if ids:
                raise DraftFormatError(f"{folder}: fc.weight reads {width // config.target_hidden_size} aux states,"
                                       f" the config names {len(ids)} layers {list(ids)}")
            config = DraftConfig(**{**asdict(config), "num_aux_layers": width // config.target_hidden_size})
    has_embedding = "embed_tokens.weight" in tensors
    draft = family_of(config).build(config, None if has_embedding else embed_tokens_weight)
    if "d2t" not in tensors:  # a full-vocab draft: draft id i is target id i
        if config.draft_vocab_size != config.vocab_size:
            raise DraftFormatError(f"{folder}: draft_vocab_size={config.draft_vocab_size} < vocab_size="
                                   f"{config.vocab_size} but the checkpoint has no d2t mapping")
        tensors["d2t"] = torch.zeros(config.vocab_size, dtype=torch.int64)
    if "t2d" not in tensors:  # vLLM ignores t2d; rebuild it from d2t
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(len(tensors["d2t"])) + tensors["d2t"].long()] = True
        tensors["t2d"] = t2d
    if "mask_hidden" in tensors:  # vLLM reads any layout of it as one row (view(1, -1))
        tensors["mask_hidden"] = tensors["mask_hidden"].reshape(-1)
    d2t, t2d = tensors.pop("d2t").long(), tensors.pop("t2d").bool()
    fill_draft(draft, tensors, d2t, t2d, folder)
    return LoadedDraft(draft=draft, aux_layer_ids=ids, format=fmt, path=folder, meta=our_meta(folder),
                       has_embedding=has_embedding, has_lm_head=has_lm_head)


def check_draft_fits_target(loaded: LoadedDraft, *, hidden_size: int, vocab_size: int,
                            aux_layer_ids: Sequence[int] | None = None) -> None:
    """Fail, naming the mismatch, when a draft cannot serve this target."""
    c = loaded.draft.config
    problems = []
    if c.target_hidden_size != hidden_size:
        problems.append(f"target_hidden_size {c.target_hidden_size} != the target's hidden size {hidden_size}")
    if c.vocab_size != vocab_size:
        problems.append(f"vocab_size {c.vocab_size} != the target's vocabulary {vocab_size}")
    if aux_layer_ids is not None and loaded.aux_layer_ids is not None \
            and tuple(sorted(aux_layer_ids)) != loaded.aux_layer_ids:
        problems.append(f"aux layer ids {list(loaded.aux_layer_ids)} != {sorted(aux_layer_ids)}")
    if problems:
        raise DraftFormatError(f"{loaded.path}: the draft does not fit the target: {'; '.join(problems)}")


def fit_to_target(loaded: LoadedDraft, target: Any) -> None:
    """Check a loaded draft against a loaded target (hidden size, vocabulary, aux layer ids, and the
    tokenizer where the draft recorded the fingerprint of the one it was trained with) and give it
    the target's embedding when it carries none. Mismatches raise :class:`DraftFormatError`."""
    from eagle3.fingerprint import tokenizer_fingerprint

    check_draft_fits_target(loaded, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                            aux_layer_ids=target.aux_layer_ids)
    trained_with, served = loaded.meta.get("tokenizer_sha256"), tokenizer_fingerprint(target.tokenizer)
    if trained_with and trained_with != served:
        raise DraftFormatError(f"{loaded.path}: the draft was trained with another tokenizer than {target.name}'s "
                               f"(tokenizer sha256 {trained_with[:12]}... != {served[:12]}...)")
    if not loaded.has_embedding:
        loaded.draft.load_embedding(target.embed_tokens.weight.detach().float())
    if not loaded.has_lm_head:
        give_target_lm_head(loaded, target.lm_head.weight)


def give_target_lm_head(loaded: LoadedDraft, weight: Tensor) -> None:
    """A draft that ships without lm_head reads the target's (as vLLM shares it); no-op otherwise."""
    if loaded.has_lm_head:
        return
    try:
        loaded.draft.init_lm_head_from_target(weight.detach().float(), loaded.draft.d2t)
    except (ValueError, IndexError) as err:
        raise DraftFormatError(f"{loaded.path}: no lm_head.weight, and the target's {tuple(weight.shape)} "
                               f"does not fit it ({err})") from None
    loaded.has_lm_head = True


# ---------------------------------------------------------------- CLI


def read_draft_vocab(path: str | os.PathLike[str], vocab_size: int) -> DraftVocab:
    """A draft vocab saved by a run (``draft_vocab.safetensors``) or a draft folder in any format
    :func:`load_draft` reads (a full-vocab draft carries no d2t: the identity)."""
    path = Path(path)
    if not path.is_dir() or (path / "draft_vocab.safetensors").is_file():
        return read_vocab_file(path, vocab_size)
    draft = load_draft(path).draft
    if draft.config.vocab_size != vocab_size:
        raise InputError(f"{path}: a draft vocab over {draft.config.vocab_size} target tokens, the target has "
                         f"{vocab_size}")
    return DraftVocab.from_d2t(draft.d2t, vocab_size)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("export", _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3.export",
                                     description="Convert a draft folder (ours, vLLM/EAGLE/SpecForge, speculators, "
                                                 "SGLang) into the format an engine loads.")
    parser.add_argument("--draft", required=True, help="draft folder, e.g. runs/train/best")
    parser.add_argument("--out", required=True, help="output folder (written atomically)")
    parser.add_argument("--format", choices=FORMATS, default="vllm")
    parser.add_argument("--from-format", default="auto", choices=("auto", *FORMATS),
                        help="how to read --draft (auto: from its config.json)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--verifier", default=None,
                        help="the target's name or path (speculators format; default: draft.json's target)")
    parser.add_argument("--aux-layer-ids", default=None,
                        help="comma-separated ids, for a draft folder that names none (engine defaults)")
    parser.add_argument("--speculative-tokens", type=int, default=3)
    args = parser.parse_args(argv)
    if args.speculative_tokens < 1:
        parser.error(f"--speculative-tokens must be >= 1, got {args.speculative_tokens}")
    if Path(args.out).resolve() == Path(args.draft).resolve():
        parser.error(f"--out {args.out} is the --draft folder: an export would replace the draft it reads; "
                     "pass another --out")
    loaded = load_draft(args.draft, args.from_format)
    ids = loaded.aux_layer_ids
    if args.aux_layer_ids:
        try:
            given = tuple(int(i) for i in args.aux_layer_ids.split(","))
        except ValueError:
            parser.error(f"--aux-layer-ids={args.aux_layer_ids!r}: expected comma-separated integers")
        if ids is not None and tuple(sorted(given)) != ids:  # relabelling: the engine would feed other layers
            raise DraftFormatError(f"{args.draft}: trained on aux layers {list(ids)}; --aux-layer-ids "
                                   f"{list(given)} is only for a folder that names none")
        ids = given
    if ids is None:
        raise DraftFormatError(f"{args.draft}: names no aux layer ids; pass --aux-layer-ids (the target's "
                               "default is 2,N//2,N-3 for N decoder layers)")
    verifier = args.verifier or loaded.meta.get("target")
    meta = {k: v for k, v in loaded.meta.items() if k != "format"} or None
    state = loaded.draft.state_dict()
    if not loaded.has_lm_head:  # written without one too: engines give it the target's
        del state["lm_head.weight"]
    export_draft_folder(args.out, state, loaded.draft.config, ids, args.format, dtype=args.dtype,
                        verifier=verifier, speculative_tokens=args.speculative_tokens, meta=meta)
    print(json.dumps({"stage": "export", "from": str(args.draft), "from_format": loaded.format, "out": args.out,
                      "format": args.format, "aux_layer_ids": list(ids), "dtype": args.dtype}))
    return 0


__all__ = ["check_draft_fits_target", "engine_tensors", "export_draft_folder", "fit_to_target", "give_target_lm_head",
           "load_draft"]

if __name__ == "__main__":
    sys.exit(main())
