"""Training step of the TTT unroll with and without the rows no step reads (`read_rows`), or with
attention over whole rows and by groups of documents (`--compare segments`), side by side.

    OMP_NUM_THREADS=1 .venv/bin/python bench/speed/ttt_rows.py --store runs/race/harvest --batches 6 \
        [--compare rows|segments] [--max-tokens 4096 --ttt-steps 7]

Packs the store's samples into rows of ``--max-tokens`` (as training does), computes the
target's distribution once per batch, then times forward + backward of a fresh draft (fp32,
the race's shape: speculators' layer, K=3, the loss on the replies) over the same batches,
alternating ``skip_unread_rows`` off and on (``--compare segments``: the rows read in both, attention
over whole rows, then by groups of documents of ``SEGMENT_MIN_TOKENS``), ``--rounds`` times. One
JSON line per mode (tokens/s) and one with their ratio; the losses of the two modes are reported
too (they agree).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from eagle3.draft.model import DraftConfig, Eagle3Draft  # noqa: E402
from eagle3.draft.ttt import SEGMENT_MIN_TOKENS, layout_rows, ttt_forward  # noqa: E402
from eagle3.draft.vocab import count_loss_tokens, select_draft_vocab  # noqa: E402
from eagle3.store.batches import epoch_batches, load_batch  # noqa: E402
from eagle3.store.shards import HarvestStore  # noqa: E402
from eagle3.target.model import load_target  # noqa: E402
from hard_mining.score import target_head  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--loss-positions", choices=["assistant", "all"], default="assistant")
    parser.add_argument("--compare", choices=["rows", "segments"], default="rows")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    store = HarvestStore(args.store)
    target = load_target(store.spec.target, dtype="float32", device="cpu")
    head = target_head(target)
    indices = list(range(len(store)))
    counts = count_loss_tokens(map(store.token_columns, indices), target.config.vocab_size)
    vocab = select_draft_vocab(counts, args.draft_vocab_size)
    config = DraftConfig.from_target_config(target.config, draft_vocab_size=vocab.size, norm_before_residual=True,
                                            norm_before_fc=True, norm_output=True)
    draft = Eagle3Draft(config, target.embed_tokens.weight.detach().clone())
    draft.set_draft_vocab(vocab.d2t, vocab.t2d)
    draft.train()
    rows = epoch_batches(store.lengths, indices, "pack", args.max_tokens, seed=0, epoch=0)[: args.batches]
    batches = []
    for row in rows:
        batch = load_batch(store, row, "pack")
        if args.loss_positions == "all":  # before the targets: the head runs only on the rows the mask reads
            batch["loss_mask"] = batch["document_ids"] >= 0
        targets = head.targets(batch, vocab.t2d)
        batches.append((batch, targets))
    tokens = sum(int((b["document_ids"] >= 0).sum()) for b, _ in batches)

    seconds = {False: 0.0, True: 0.0}
    losses: dict[bool, list[float]] = {False: [], True: []}
    segments = args.compare == "segments"
    for r in range(args.rounds):
        for on in (False, True):
            for batch, targets in batches:
                draft.zero_grad(set_to_none=True)
                start = time.perf_counter()
                skip = on or segments
                layout = layout_rows(batch["loss_mask"], batch["document_ids"], args.ttt_steps, skip,
                                 SEGMENT_MIN_TOKENS if on or not segments else None)
                out = ttt_forward(draft, batch["input_ids"], batch["aux"].float(), batch["position_ids"],
                                  batch["document_ids"], batch["loss_mask"], targets, num_steps=args.ttt_steps,
                                  weights=torch.ones(args.ttt_steps), skip_unread_rows=skip, layout=layout)
                out.loss.backward()
                seconds[on] += time.perf_counter() - start
                if r == 0:
                    losses[on].append(round(out.loss.item(), 5))
    rate = {on: args.rounds * tokens / seconds[on] for on in seconds}
    mode = "by_document_groups" if segments else "skip_unread_rows"
    for on in (False, True):
        print(json.dumps({"figure": "ttt_tokens_per_s", mode: on, "tokens_per_s": round(rate[on], 1),
                          "losses": losses[on], "loss_positions": args.loss_positions,
                          "max_tokens": args.max_tokens, "ttt_steps": args.ttt_steps}), flush=True)
    print(json.dumps({"figure": "ttt_speedup", "compare": args.compare, "ratio": round(rate[True] / rate[False], 3),
                      "batches": len(batches), "tokens": tokens, "rounds": args.rounds}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
