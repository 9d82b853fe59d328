"""Where a draft starts: the target-head recipe's untrained head against the target's own, and the
first training losses, on tiny random Llama and Gemma-3 targets of one shape.

    OMP_NUM_THREADS=1 .venv/bin/python bench/studies/init_check.py [--steps 40] [--out runs/init_check]

The target-head recipe copies the target's lm_head rows and final norm into the draft, so that a
draft whose pre-norm state equals the target's gives the target's logits. Gemma stores its norms as
offsets (the module computes ``x / rms(x) * (1 + weight)``); copied as stored, the draft's norm
(``x / rms(x) * weight``) is off by one in every channel. For each family, with the final norm as
initialised (Llama ones, Gemma zero offsets) and with trained-like weights (the same random
per-channel scales for both, stored in each family's convention), it prints one JSON line per
init (``raw``: the stored weight, as before; ``probe``: :meth:`eagle3.target.model.Target.final_norm_scale`):
the largest difference between the untrained draft's head and the target's on harvested states,
the training loss at a few steps, and the held-out loss and tau_sim (a fifth of the samples)
before and after.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]

from arch_check import BUILDERS  # noqa: E402


def make_target(arch: str, scales: torch.Tensor | None) -> Any:
    """A random ``arch`` target (the tests' byte-level tokenizer, weights sharpened as arch_check's);
    with ``scales``, its final norm computes ``x / rms(x) * scales`` in the family's convention."""
    from eagle3.target.model import Target
    from eagle3.tiny import sharpen, tiny_tokenizer

    torch.manual_seed(0)
    model = sharpen(BUILDERS[arch]().eval())
    if scales is not None:
        norm = model.get_decoder().norm
        with torch.no_grad():
            norm.weight.copy_(scales - 1.0 if arch.startswith("gemma") else scales)
    return Target(model, tiny_tokenizer(), aux_layer_ids=(1, 3, 6), name=arch)


def head_gap(target: Any, store: Any, init: str) -> float:
    """max |draft head - target head| over the draft vocab, on the store's first sample's states."""
    from eagle3.draft.model import DraftConfig, Eagle3Draft
    from eagle3.draft.vocab import DraftVocab

    vocab = DraftVocab.from_target_ids(torch.arange(0, target.vocab_size - 62), target.vocab_size)
    draft = Eagle3Draft(DraftConfig.from_target_config(target.config, draft_vocab_size=vocab.size),
                        target.embed_tokens.weight.detach().float())
    draft.set_draft_vocab(vocab.d2t, vocab.t2d)
    norm = target.norm.weight.detach().float() if init == "raw" else target.final_norm_scale()
    rows = target.lm_head.weight.detach().float() * target.logit_transform.scale
    draft.init_lm_head_from_target(rows, vocab.d2t, norm)
    last = store[0].last.float()  # [T, H] pre-norm
    with torch.no_grad():
        ours = draft.lm_head(draft.norm(last))
        theirs = target.head(last)[:, vocab.d2t + torch.arange(vocab.size)]
        return float((target.logit_transform(ours) - theirs).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="runs/init_check")
    args = parser.parse_args()  # the pipeline's default draft recipe (target-head), in fp32
    torch.set_num_threads(1)

    from data_gen.config import HarvestConfig
    from data_gen.harvest import run as harvest
    from eagle3.config import TargetConfig
    from eagle3.store.shards import HarvestStore
    from eagle3.target.model import Target
    from eagle3.tiny import regenerated_data as _data
    from eagle3.train.config import draft_recipe, train_config
    from eagle3.train.log import read_metrics
    from eagle3.train.loop import train

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = _data(out / "data.jsonl", 40, turns=2)
    trained_like = 0.5 + torch.rand(64, generator=torch.Generator().manual_seed(1)) * 2  # scales in [0.5, 2.5]
    for arch in ("llama", "gemma3_text"):
        for norms, scales in (("as-initialised", None), ("trained-like", trained_like)):
            target = make_target(arch, scales)
            store_dir = out / f"{arch}-{norms}" / "store"
            if not (store_dir / "manifest.json").is_file():
                harvest(HarvestConfig(data=str(data), out_dir=str(store_dir), dtype="float32"),
                        TargetConfig(name_or_path=arch), target=target, progress=False)
            store = HarvestStore(store_dir)
            for init in ("raw", "probe"):
                run = out / f"{arch}-{norms}" / init
                original = Target.final_norm_scale
                if init == "raw":  # as before: the stored weight, whatever the convention
                    Target.final_norm_scale = lambda self: self.norm.weight.detach().float().cpu()
                try:
                    cfg = train_config({**draft_recipe("target-head"), **{"data.store": str(store_dir),
                                                                          "out_dir": str(run), "steps": args.steps,
                                                                          "data.micro_batch_tokens": 512,
                                                                          "optim.warmup_steps": 2,
                                                                          "data.eval_fraction": 0.2, "eval_every": 0,
                                                                          "save_every": 0, "draft.vocab_size": 200,
                                                                          "log.wandb_mode": "disabled",
                                                                          "log.progress": False, "device": "cpu",
                                                                          "resume": False, "precision": "fp32"}})
                    summary = train(cfg, target=target)
                finally:
                    Target.final_norm_scale = original
                losses = {r["step"]: round(r["train/loss"], 3) for r in read_metrics(run) if "train/loss" in r}
                print(json.dumps({"figure": "init_check", "arch": arch, "norms": norms, "init": init,
                                  "head_gap": round(head_gap(target, store, init), 5),
                                  "first_loss": round(summary["first_loss"], 3),
                                  "loss": {s: losses[s] for s in (1, 5, 10, 20, args.steps) if s in losses},
                                  "last_loss": round(summary["last_loss"], 3),
                                  "eval_first": summary["eval_first"], "eval_last": summary["eval_last"]}), flush=True)


if __name__ == "__main__":
    main()
