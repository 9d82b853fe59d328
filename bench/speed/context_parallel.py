"""Peak memory and time per rank of one training forward + backward over one long row, on one rank
and split over n ranks (``train.context_parallel``), side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/speed/context_parallel.py --tokens 16384 --ranks 1,2 \
        [--shape smollm2|llama8b|kimi] [--draft-vocab-size 32000 --ttt-steps 7 --reply 0.5]

A random draft of the target's shape (the draft's layer as speculators', fp32) and one packed row of
``--tokens`` tokens (documents of 2-6k tokens, the second ``--reply`` of each the loss-masked reply)
with random aux states and target distributions, built the same in every process, split as the
trainer splits it (ranges of equal work; ``--equal-ranges``: of equal length). Each size runs
in its own group of fresh processes (gloo); every rank reports its peak resident memory above what it
held before the forward (``rss_gib``: states, activations, logits, gradients; the row's inputs are
built before, split to the rank's share) and the seconds of forward + backward. One JSON line per
size and rank, then one per size with the largest rank's figures against one rank's, and the
loss of every size (they agree).
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]

from eagle3.distributed import shutdown  # noqa: E402
from eagle3.draft.context import split_batch  # noqa: E402
from eagle3.draft.model import DraftConfig, Eagle3Draft  # noqa: E402
from eagle3.draft.targets import TTTTargets  # noqa: E402
from eagle3.draft.ttt import read_mask, ttt_forward  # noqa: E402
from eagle3.draft.vocab import DraftVocab  # noqa: E402

SHAPES = {  # target hidden, vocab, draft heads, kv heads, head dim, intermediate
    "smollm2": dict(hidden=576, vocab=49152, heads=9, kv=3, head_dim=64, inter=1536),
    "llama8b": dict(hidden=4096, vocab=128256, heads=32, kv=8, head_dim=128, inter=14336),
    "kimi": dict(hidden=7168, vocab=163840, heads=64, kv=8, head_dim=112, inter=18432),
}


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _row(tokens: int, vocab_size: int, reply: float) -> dict:
    """The row's token ids and masks [1, S] (small; whole in every process)."""
    g = torch.Generator().manual_seed(0)
    lengths, left = [], tokens
    while left > 0:
        n = min(left, int(torch.randint(2048, 6144, (1,), generator=g)))
        lengths.append(n)
        left -= n
    return {"input_ids": torch.randint(0, vocab_size, (1, tokens), generator=g),
            "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0),
            "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0),
            "loss_mask": torch.cat([torch.arange(n) >= (1 - reply) * n for n in lengths]).unsqueeze(0)}


def _states(lo: int, hi: int, tokens: int, hidden: int, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Aux states [1, hi - lo, 3, H] and target distributions [1, hi - lo, Vd] of rows [lo, hi) (zero past
    the row), the same numbers whichever range asks: drawn per block of 256 rows from the block's seed."""
    aux, probs = [], []
    for block in range(lo // 256, -(-hi // 256)):
        g = torch.Generator().manual_seed(1 + block)
        a = torch.randn(256, 3, hidden, generator=g)
        p = torch.softmax(2 * torch.randn(256, draft_vocab, generator=g), -1)
        first, last = max(lo - block * 256, 0), min(hi - block * 256, 256)
        aux.append(a[first:last])
        probs.append(p[first:last])
    aux_t, probs_t = torch.cat(aux).unsqueeze(0), torch.cat(probs).unsqueeze(0)
    past = max(0, hi - tokens)  # rows past the row: padding
    if past:
        aux_t[:, -past:] = 0
        probs_t[:, -past:] = 0
    return aux_t, probs_t


def _worker(rank: int, size: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    config = DraftConfig(hidden_size=shape["hidden"], intermediate_size=shape["inter"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
                         head_dim=shape["head_dim"], vocab_size=shape["vocab"],
                         draft_vocab_size=args.draft_vocab_size, target_hidden_size=shape["hidden"],
                         max_position_embeddings=args.tokens, norm_before_residual=True, norm_before_fc=True,
                         norm_output=True)
    draft = Eagle3Draft(config, torch.randn(shape["vocab"], shape["hidden"]) * 0.02)
    vocab = DraftVocab.from_target_ids(torch.arange(args.draft_vocab_size), shape["vocab"])
    draft.set_draft_vocab(vocab.d2t, vocab.t2d)
    draft.train()
    batch = _row(args.tokens, shape["vocab"], args.reply)
    shard, lo = None, 0
    if size > 1:
        cost = 1 + args.ttt_steps * read_mask(batch["loss_mask"], batch["document_ids"], args.ttt_steps).long()
        batch, shard = split_batch(batch, rank, size, args.ttt_steps + 1, cost=None if args.equal_ranges else cost)
        lo = shard.lo
    width = batch["input_ids"].shape[1]
    batch["aux"], batch["probs"] = _states(lo, lo + width, args.tokens, shape["hidden"], args.draft_vocab_size)
    batch["argmax"] = torch.where(batch["probs"].sum(-1) > 0, batch["probs"].argmax(-1), -1)
    before = _rss_gib()
    started = time.perf_counter()
    out_ = ttt_forward(draft, batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"],
                       batch["loss_mask"], TTTTargets(probs=batch["probs"], argmax=batch["argmax"]),
                       num_steps=args.ttt_steps, gradient_checkpointing=args.checkpointing, shard=shard)
    out_.loss.backward()
    seconds = time.perf_counter() - started
    loss = out_.loss.detach().clone()
    if shard is not None:
        loss = shard.total(loss)
    line = {"figure": "context_parallel_rank", "shape": args.shape, "tokens": args.tokens, "ranks": size,
            "rank": rank, "rss_gib": round(_rss_gib() - before, 3), "inputs_gib": round(before, 3),
            "seconds": round(seconds, 2), "loss": round(float(loss), 6)}
    Path(f"{out}.{rank}").write_text(json.dumps(line))
    shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--draft-vocab-size", type=int, default=32000)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--reply", type=float, default=0.5)
    parser.add_argument("--checkpointing", action="store_true", help="train.gradient_checkpointing")
    parser.add_argument("--equal-ranges", action="store_true",
                        help="ranges of equal length instead of equal work (the trainer's)")
    args = parser.parse_args(argv)
    results: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in [int(x) for x in args.ranks.split(",")]:
            out = f"{tmp}/r{size}"
            mp.spawn(_worker, args=(size, f"{tmp}/store{size}", args, out), nprocs=size, join=True)
            results[size] = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(size)]
            for line in results[size]:
                print(json.dumps(line), flush=True)
    one = results.get(1)
    for size, lines in results.items():
        peak = max(lines, key=lambda x: x["rss_gib"])
        row = {"figure": "context_parallel", "shape": args.shape, "tokens": args.tokens, "ranks": size,
               "checkpointing": args.checkpointing, "equal_ranges": args.equal_ranges,
               "max_rank_rss_gib": peak["rss_gib"],
               "max_rank_seconds": max(x["seconds"] for x in lines), "loss": lines[0]["loss"]}
        if one:
            row["rss_vs_one_rank"] = round(peak["rss_gib"] / one[0]["rss_gib"], 3)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
