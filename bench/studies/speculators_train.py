"""Train a speculators peer's draft (0.9.0: EAGLE-3, P-EAGLE or DFlash) on CPU from
bench/studies/speculators_data.py's output.

Runs in the peer's own venv (``bash scripts/setup_speculators_env.sh``)::

    OMP_NUM_THREADS=1 .venv-speculators/bin/python bench/studies/speculators_train.py \\
        --data runs/race/spec-data --target ~/.cache/eagle3/targets/smollm2-135m \\
        --out runs/race/speculators --steps 300 [--family eagle3|peagle|dflash]

It drives speculators' own trainer (``speculators.train.cli.main`` with a ``TrainConfig`` built from
the ``speculators train`` flags), leaving every recipe default of speculators as it is unless a flag
here says otherwise; more flags can follow ``--`` and are passed through verbatim. The data is the
same for every family (speculators shifts it for EAGLE-3 and P-EAGLE, not for DFlash).

``--family`` is speculators' ``--speculator-type``; ``--ttt-steps N`` (the drafted tokens per round,
our race's TTT depth) becomes the family's own depth: ``--ttt-steps N`` for eagle3, ``--num-depths N``
for peagle (its default 8; it then serves K = N), ``--block-size N+1`` for dflash (its default 16;
anchor + N masks, served as K = N, as our DFlash). Everything else is speculators' default per family
(peagle: 1 qwen3-style layer, trained embedding, kl_div, COD down-sampling 0.7/0.2; dflash: 5
qwen3-style layers, ce with D-PACE weights; both: 512 anchors, every layer sliding-window 2048, the
mask token resolved from the verifier's tokenizer: its mask token, else a new token in an unused
embedding row, else pad/eos/unk). Flags always set:
``--draft-attn-impl sdpa --loss-implementation eager`` (flex attention and the fused loss need a
GPU), ``--target-layer-ids`` from the data (the store's aux ids), ``--d2t-path/--t2d-path`` when the
data carries our draft vocab, ``--train-data-ratio`` reproducing our train/held-out split, and
``--num-workers 0``.

CPU: speculators assumes an accelerator. Monkeypatches, in this process only (site-packages is not
touched): the trainer's device is ``cpu`` instead of local rank 0 (``model.to(0)`` means cuda:0)
and its autocast device type is ``cpu`` instead of its ``cuda`` fallback; checkpoint loading on
resume maps to ``cpu`` instead of ``cuda:0``; ``torch.accelerator.synchronize`` (its step timer
calls it on every logged step) is a no-op when there is no accelerator; with ``--dtype float32``
(CPUs without bf16 units) torch's Muon iterates Newton-Schulz in fp32 instead of bf16 (see
:func:`muon_in_fp32`). One peer bug is worked
around: with ``--max-steps`` its epoch loop keeps running one extra step (plus validation and a
checkpoint) in every remaining epoch, so the epoch count is cut to what the steps need; and it
then saves a checkpoint after the first and the last of those epochs only (``checkpoint_freq``).

Output: ``OUT/checkpoints/<epoch>/`` are speculators' own checkpoints; ``OUT/draft/`` is the last one's
``config.json`` + ``model.safetensors`` (speculators format, what ``vllm serve OUT/draft`` loads) with
the aux layer ids, the norm flags (EAGLE-3, P-EAGLE) and the verifier path written explicitly. vLLM
0.32 reads the format per ``speculators_model_type`` (its ``configs/speculators/algos.py``): ``peagle``
as ``method=eagle3`` + ``parallel_drafting`` with ``mask_token_id`` as its ``pard_token`` (it drops
``fc_norm``/``norm_output``, so a P-EAGLE draft with either set is refused here), ``dflash`` as
``DFlashDraftModel`` with ``dflash_config{mask_token_id, target_layer_ids = aux ids - 1}`` and K =
block_size - 1; tools/vllm_judge.py's ``draft_family`` serves both that way. The last stdout line
is one JSON object (also in ``OUT/result.json``): training tokens/s = non-padding positions the
training loop consumed / wall seconds of the training epochs (data loading included; validation
and checkpoint saves excluded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

CONVERSION = "eagle3_conversion.json"
CONVERSION_FORMAT = "eagle3-speculators-data-1"
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
FAMILIES = ("eagle3", "peagle", "dflash")
SETTINGS = ("speculator_type", "loss_fn", "optimizer", "lr", "muon_lr", "weight_decay", "scheduler_type",
            "scheduler_warmup_steps", "total_seq_len", "hidden_states_dtype", "num_layers", "draft_arch",
            "draft_vocab_size", "target_layer_ids", "train_data_ratio", "max_steps", "epochs", "seed",
            "draft_attn_impl", "loss_implementation", "sliding_window", "full_attention_indices")
# (the trained config's mask_token_id and embed_requires_grad are in "exported": the flags' values are unresolved)
FAMILY_SETTINGS = {
    "eagle3": ("ttt_steps", "ttt_step_loss_decay", *NORM_FLAGS, "embed_requires_grad"),
    "peagle": ("num_depths", "down_sample_ratio", "down_sample_ratio_min", "max_anchors", *NORM_FLAGS),
    "dflash": ("block_size", "per_position_loss_weight", "dpace_alpha", "dflash_decay_gamma", "max_anchors",
               "sample_from_anchor", "sliding_window_non_causal"),
}
AUX_IDS_KEY = {"eagle3": "eagle_aux_hidden_state_layer_ids", "peagle": "eagle_aux_hidden_state_layer_ids",
               "dflash": "aux_hidden_state_layer_ids"}
NEEDED_TENSORS = {"eagle3": ("fc.weight", "lm_head.weight"), "peagle": ("fc.weight", "lm_head.weight", "mask_hidden"),
                  "dflash": ("fc.weight", "hidden_norm.weight")}


class RaceError(RuntimeError):
    """Bad input; the message names the file or flag."""


# ---------------------------------------------------------------- CPU patches

def install_cpu_patches(stats: dict[str, Any]) -> None:
    """Make speculators' single-process trainer run on the CPU, and measure its training loop."""
    import speculators.train.checkpointer as checkpointer_mod
    import speculators.train.cli as cli_mod
    import speculators.train.trainer as trainer_mod

    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None  # its step timer syncs every logged step
        trainer_mod.get_local_rank = lambda: "cpu"  # Trainer moves the model and batches to this device
        checkpointer_mod.get_current_device = lambda: "cpu"  # resume would map tensors to cuda:0

    base = trainer_mod.Trainer

    class CpuTrainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, model, config, train_loader, val_loader=None):
            super().__init__(model, config, train_loader, val_loader)
            if not torch.accelerator.is_available():
                self.device_type = "cpu"  # its fallback is "cuda", which disables autocast here
            steps_per_epoch = len(self.train_loader)
            if self.config.max_steps is not None and steps_per_epoch > 0:
                # the peer's loop runs one more step (+ validation + checkpoint) in every epoch after
                # reaching max_steps; run only the epochs the steps need
                needed = math.ceil(self.config.max_steps / steps_per_epoch)
                epochs = min(self.config.num_epochs, needed)
                # a checkpoint (weights and optimizer state) only after the last epoch, which is the one
                # read (its epoch 0 is always saved too): every epoch's cost minutes of GPU time
                self.config = self.config._replace(num_epochs=epochs, checkpoint_freq=max(
                    self.config.checkpoint_freq, epochs))
            stats.update(steps_per_epoch=steps_per_epoch, epochs=self.config.num_epochs,
                         train_tokens=0, train_seconds=0.0, losses=[], lr=[])
            self.model.register_forward_pre_hook(self._count_tokens, with_kwargs=True)
            logging.getLogger("speculators.metrics").addHandler(_MetricTap(stats))

        def _count_tokens(self, module, args, kwargs):
            if module.training and "document_ids" in kwargs:
                stats["train_tokens"] += int((kwargs["document_ids"] != -1).sum())

        def train_epoch(self, epoch, **kwargs):
            started = time.perf_counter()
            try:
                return super().train_epoch(epoch, **kwargs)
            finally:
                stats["train_seconds"] += time.perf_counter() - started

    cli_mod.Trainer = CpuTrainer


def muon_in_fp32() -> None:
    """torch.optim.Muon (speculators' default optimizer) runs its Newton-Schulz iteration in bf16 on
    every device; on a CPU without bf16 units that made each race step ~32 s instead of ~9 (measured).
    Where the race trains in float32 (``--dtype float32``, chosen because bf16 is the slower there),
    the same quintic iteration runs in float32 instead, as ours does in DeepSpeed's Muon."""
    import torch.optim._muon as muon_mod

    def orthogonalise(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                      eps: float) -> torch.Tensor:
        a, b, c = ns_coefficients
        tall = grad.size(0) > grad.size(1)
        x = (grad.T if tall else grad).float()
        x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
        for _ in range(ns_steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if tall else x

    muon_mod._zeropower_via_newtonschulz = orthogonalise


class _MetricTap(logging.Handler):
    """Keeps the per-step training loss that speculators logs as a dict."""

    def __init__(self, stats: dict[str, Any]):
        super().__init__(level=logging.INFO)
        self.stats = stats

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if isinstance(msg, dict) and isinstance(msg.get("train"), dict):
            train = msg["train"]
            if "loss" in train:
                self.stats["losses"].append(float(train["loss"]))
                self.stats.setdefault("step_metrics", []).append(
                    {k: round(float(v), 5) for k, v in train.items()
                     if k == "loss" or k.startswith(("loss_", "full_acc", "cond_acc_", "position_"))})
                lr = msg.get("lr")
                self.stats["lr"].append(lr if isinstance(lr, (int, float)) else str(lr))
        elif isinstance(msg, dict) and isinstance(msg.get("val"), dict):
            self.stats["val"] = {k: round(float(v), 5) for k, v in msg["val"].items()
                                 if isinstance(v, (int, float))}


# ---------------------------------------------------------------- arguments

def read_conversion(data: Path) -> dict[str, Any]:
    path = data / CONVERSION
    if not path.is_file():
        raise RaceError(f"{path}: missing; make the data with bench/studies/speculators_data.py")
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RaceError(f"{path}: not valid JSON ({err})") from err
    if record.get("format") != CONVERSION_FORMAT:
        raise RaceError(f"{path}: format {record.get('format')!r}, expected {CONVERSION_FORMAT!r}")
    return record


def check_target(target: Path, record: dict[str, Any], data: Path) -> None:
    config_path = target / "config.json"
    if not config_path.is_file():
        raise RaceError(f"{config_path}: missing; --target must be the target's HF folder (config.json + weights)")
    config = json.loads(config_path.read_text())
    config = config.get("text_config", config)
    for ours, theirs in (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
                         ("vocab_size", "vocab_size")):
        if config.get(theirs) != record[ours]:
            raise RaceError(f"{config_path}: {theirs}={config.get(theirs)} but {data / CONVERSION} was harvested "
                            f"with {ours}={record[ours]}")


def longer_than(data: Path, seq_len: int) -> int:
    """Rows longer than one packed training row: speculators truncates them (their tail is never trained on)."""
    from datasets import load_from_disk

    lengths = load_from_disk(str(data)).with_format(None)["seq_len"]
    return sum(1 for n in lengths if n > seq_len)


def family_depth(family: str, drafted: int) -> list[str]:
    """The flag that makes a family draft ``drafted`` tokens per round, as our race's TTT depth does."""
    if family == "peagle":
        return ["--num-depths", str(drafted)]
    if family == "dflash":
        return ["--block-size", str(drafted + 1)]  # the anchor (bonus token) + one mask per drafted token
    return ["--ttt-steps", str(drafted)]


def speculators_argv(args: argparse.Namespace, record: dict[str, Any], save_path: Path, log_dir: Path) -> list[str]:
    if args.family == "dflash" and record.get("loss_mask") == "predicted":
        # that mask is shifted for speculators' shift_batch; DFlash reads the mask unshifted, where the
        # native one already gates each slot by the token it predicts
        raise RaceError(f"{args.data / CONVERSION}: converted with --loss-mask predicted, which DFlash (no shift) "
                        "would read one token late; convert with --loss-mask native")
    argv = [
        "--speculator-type", args.family,
        "--verifier-name-or-path", str(args.target),
        "--data-path", str(args.data),
        "--save-path", str(save_path),
        "--log-dir", str(log_dir),
        "--target-layer-ids", *[str(i) for i in record["aux_layer_ids"]],
        "--draft-attn-impl", "sdpa",
        "--loss-implementation", "eager",
        "--hidden-states-dtype", args.dtype,
        "--total-seq-len", str(args.seq_len),
        *family_depth(args.family, args.ttt_steps),
        "--epochs", str(args.epochs),
        "--num-workers", str(args.num_workers),
        "--on-missing", "raise",  # never call a vLLM endpoint for a missing sample
        "--seed", str(args.seed),
        "--no-resume-from-checkpoint",
    ]
    if args.steps is not None:
        argv += ["--max-steps", str(args.steps)]
    if args.lr is not None:
        argv += ["--lr", str(args.lr)]
    if args.optimizer is not None:
        argv += ["--optimizer", args.optimizer]
    ratio = args.train_data_ratio if args.train_data_ratio is not None else record.get("train_data_ratio")
    if ratio is None:
        raise RaceError(f"{args.data / CONVERSION}: the data has no held-out rows and speculators needs some "
                        "(its --train-data-ratio must be < 1); convert with --eval-fraction > 0 or --eval-store, "
                        "or pass --train-data-ratio")
    argv += ["--train-data-ratio", repr(float(ratio))]
    vocab = record.get("draft_vocab")
    if vocab is not None:
        d2t, t2d = args.data / vocab["d2t"], args.data / vocab["t2d"]
        for path in (d2t, t2d):
            if not path.is_file():
                raise RaceError(f"{path}: missing (named in {args.data / CONVERSION})")
        if args.draft_vocab_size is not None and args.draft_vocab_size != vocab["size"]:
            raise RaceError(f"--draft-vocab-size {args.draft_vocab_size}: the data's draft vocab "
                            f"({args.data / vocab['d2t']}) has {vocab['size']} tokens")
        argv += ["--d2t-path", str(d2t), "--t2d-path", str(t2d), "--draft-vocab-size", str(vocab["size"])]
    elif args.draft_vocab_size is not None:  # speculators builds it from OUT/token_freq.pt
        argv += ["--draft-vocab-size", str(args.draft_vocab_size)]
    return argv + list(args.passthrough)


# ---------------------------------------------------------------- the exported draft

def last_epoch_dir(save_path: Path) -> Path:
    epochs = [int(p.name) for p in save_path.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit()]
    if not epochs:
        raise RaceError(f"{save_path}: speculators saved no checkpoint")
    return save_path / str(max(epochs))


def export_draft(checkpoint: Path, out: Path, target: Path, record: dict[str, Any], family: str,
                 drafted: int) -> dict[str, Any]:
    """Copy the checkpoint's config + weights to ``out`` with the keys vLLM reads written explicitly."""
    from safetensors import safe_open

    where = checkpoint / "config.json"
    config = json.loads(where.read_text())
    if (saved := config.get("speculators_model_type")) != family:
        raise RaceError(f"{where}: speculators_model_type {saved!r}, expected {family!r}")
    ids_key = AUX_IDS_KEY[family]
    saved_ids = config.get(ids_key)
    if saved_ids is not None and list(saved_ids) != list(record["aux_layer_ids"]):
        raise RaceError(f"{where}: {ids_key} {saved_ids}, but the data was harvested at {record['aux_layer_ids']}")
    config[ids_key] = list(record["aux_layer_ids"])
    if family != "dflash":  # vLLM's defaults for missing keys differ from speculators' (e.g. norm_before_residual)
        for key in NORM_FLAGS:
            config[key] = bool(config.get(key, False))
    if family == "peagle" and (config["fc_norm"] or config["norm_output"]):
        raise RaceError(f"{where}: a P-EAGLE draft with fc_norm/norm_output, which vLLM 0.32 does not read for "
                        "peagle (configs/speculators/algos.py update_peagle): it would serve another model")
    if family != "eagle3" and config.get("mask_token_id") is None:
        raise RaceError(f"{where}: no mask_token_id (vLLM feeds it at every mask position)")
    if family == "dflash" and config.get("block_size") != drafted + 1:
        raise RaceError(f"{where}: block_size {config.get('block_size')}, expected {drafted + 1}")
    spec = config.setdefault("speculators_config", {})
    verifier = spec.setdefault("verifier", {})
    verifier["name_or_path"] = str(target)
    if not verifier.get("architectures"):
        verifier["architectures"] = json.loads((target / "config.json").read_text()).get("architectures", [])
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        names = sorted(f.keys())
        shapes = {k: list(f.get_slice(k).get_shape()) for k in names}
        dtypes = sorted({str(f.get_slice(k).get_dtype()) for k in names})
    needed = [*NEEDED_TENSORS[family], *(["lm_head.weight", "d2t"] if record.get("draft_vocab") else [])]
    if missing := sorted(set(needed) - set(names)):
        raise RaceError(f"{checkpoint / 'model.safetensors'}: no {missing} among {names}")
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        shutil.copyfile(checkpoint / "model.safetensors", tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes 0700; the folder gets the usual mode
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    keys = (*NORM_FLAGS, ids_key, "draft_vocab_size", "mask_token_id", "embed_requires_grad", "block_size")
    return {"tensors": shapes, "saved_dtypes": dtypes, **{k: config[k] for k in keys if k in config},
            "draft_arch": (config.get("transformer_layer_config") or {}).get("model_type"),
            "speculative_tokens": [m.get("speculative_tokens") for m in spec.get("proposal_methods", [])],
            "verifier": verifier}


# ---------------------------------------------------------------- main

def run(args: argparse.Namespace) -> dict[str, Any]:
    args.data, args.target, args.out = args.data.resolve(), args.target.expanduser().resolve(), args.out.resolve()
    record = read_conversion(args.data)
    check_target(args.target, record, args.data)
    if args.out.exists():
        if not args.overwrite:
            raise RaceError(f"{args.out}: exists; pass --overwrite to replace it")
        shutil.rmtree(args.out)
    save_path, log_dir = args.out / "checkpoints", args.out / "logs"
    argv = speculators_argv(args, record, save_path, log_dir)
    truncated = longer_than(args.data, args.seq_len)
    if truncated:
        print(f"warning: {truncated} samples of {args.data} are longer than --seq-len {args.seq_len}; speculators "
              "keeps only their first --seq-len tokens (a reply past that is never trained on)", file=sys.stderr)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    stats: dict[str, Any] = {}
    install_cpu_patches(stats)
    if args.dtype == "float32" and not torch.accelerator.is_available():
        muon_in_fp32()
    cfg = TrainConfig.resolve(argv)
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # its rich logs go to stdout; ours is the JSON line
        speculators_main(cfg)
    total = time.perf_counter() - started
    checkpoint = last_epoch_dir(save_path)
    draft = export_draft(checkpoint, args.out / "draft", args.target, record, args.family, args.ttt_steps)
    losses = stats.get("losses", [])
    flat = cfg.flatten()
    result = {
        "trainer": "speculators==0.9.0",
        "family": args.family,
        "out": str(args.out),
        "draft": str(args.out / "draft"),
        "checkpoint": str(checkpoint),
        "device": "cpu" if not torch.accelerator.is_available() else str(torch.accelerator.current_accelerator()),
        "threads": torch.get_num_threads(),
        "steps": len(losses),
        "epochs": stats.get("epochs"),
        "steps_per_epoch": stats.get("steps_per_epoch"),
        "train_tokens": stats.get("train_tokens", 0),
        "train_seconds": round(stats.get("train_seconds", 0.0), 3),
        "tokens_per_s": round(stats["train_tokens"] / seconds, 2) if (seconds := stats.get("train_seconds")) else None,
        "wall_seconds": round(total, 2),
        "samples_truncated_to_seq_len": truncated,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "loss_first5_mean": sum(losses[:5]) / len(losses[:5]) if losses else None,
        "loss_last5_mean": sum(losses[-5:]) / len(losses[-5:]) if losses else None,
        "last_step_metrics": (stats.get("step_metrics") or [None])[-1],
        "val": stats.get("val"),
        "settings": {k: flat.get(k) for k in (*SETTINGS, *FAMILY_SETTINGS[args.family])},
        "exported": draft,
        "speculators_argv": argv,
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "losses.json").write_text(json.dumps({"loss": losses, "lr": stats.get("lr", []),
                                                      "metrics": stats.get("step_metrics", [])}) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Flags after -- go to `speculators train` unchanged.")
    p.add_argument("--data", type=Path, required=True, help="folder written by bench/studies/speculators_data.py")
    p.add_argument("--target", type=Path, required=True, help="the target's HF folder (the verifier)")
    p.add_argument("--out", type=Path, required=True, help="output folder (checkpoints/, draft/, result.json)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (speculators' --max-steps)")
    p.add_argument("--epochs", type=int, default=20, help="epochs (speculators' default 20; --steps stops earlier)")
    p.add_argument("--family", choices=FAMILIES, default="eagle3",
                   help="speculators' draft family (its --speculator-type)")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="tokens drafted per round: eagle3's --ttt-steps (default 3), peagle's --num-depths, "
                        "dflash's --block-size minus 1")
    p.add_argument("--seq-len", type=int, default=2048,
                   help="tokens per packed training row, one row per step (speculators' --total-seq-len)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (speculators' default 1e-3)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default=None, help="speculators' default: muon")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="check against the data's draft vocab, or have speculators build one of this size from "
                        "the data's token_freq.pt")
    p.add_argument("--train-data-ratio", type=float, default=None,
                   help="override the data's split (default: ours, from eagle3_conversion.json)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="speculators' --hidden-states-dtype (its autocast dtype; default float32 on CPU)")
    p.add_argument("--num-workers", type=int, default=0, help="dataloader workers (speculators' default 12)")
    p.add_argument("--seed", type=int, default=42, help="speculators' default 42")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    args.passthrough = passthrough
    try:
        result = run(args)
    except RaceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in result.items() if k not in ("exported", "speculators_argv")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
