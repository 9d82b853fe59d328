"""The race: our trainer against speculators==0.9.0 on the same harvested samples, both drafts
judged by real vLLM in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/studies/race_speculators.py --store runs/race/harvest \\
        --pools runs/race/pools --out runs/race/bench --steps 180 [--variant "all=--loss.positions all"] \\
        [--extra fp8=runs/race/harvest-fp8] [--extra ids=runs/race/harvest-ids] \\
        [--speculators-family eagle3|peagle|dflash]

The data: ``eagle3-run --config-name race`` (recipes/race.yaml; docs/benchmarks.md, the race).

Needs the three venvs: ``.venv`` (ours), ``.venv-speculators`` (scripts/setup_speculators_env.sh)
and ``.venv-vllm`` (scripts/setup_vllm_env.sh). Steps, one after the other so that neither trainer
shares the CPU with the other:

1. ours: ``python -m eagle3.train`` on the store (``--eval-fraction`` held out by sample-id hash),
   its draft vocab chosen from the training split;
2. speculators: the same store converted by ``bench/studies/speculators_data.py`` (the same held-out
   split, our draft vocab as its d2t/t2d), trained by ``bench/studies/speculators_train.py`` on CPU;
3. both drafts (and every ``--extra`` draft: ours on another store, e.g. fp8-stored states or
   other aux layer ids, same settings; and every ``--variant`` draft: ours on the same store with
   other training arguments, e.g. one setting ablated) served by vLLM through ``tools/vllm_judge.py``.

Equal for both: samples, TTT steps (3), draft vocab, sequence length per step (2048 tokens:
speculators packs rows of that length, ours fills length buckets of at most that many tokens),
optimizer steps. Each keeps its own optimizer, learning rate, schedule, loss weights and lm_head
init (speculators: Muon + AdamW at 1e-3, linear decay, step weights 1.0, lm_head copied from the
target and frozen, norms before the fc, the residual and the output; ours: ``--ours-recipe``, by default the
pipeline's ``target-head`` draft recipe: the same layer variant, Muon at 2e-3, cosine, step weights
1.0, lm_head started from the target's rows and trained): those are what is being compared.
``--speculators-family peagle|dflash`` trains speculators' P-EAGLE or DFlash instead of its EAGLE-3
(depth ``--ttt-steps``: P-EAGLE's depths, DFlash's block minus one; its other settings its own
defaults, see bench/studies/speculators_train.py), into ``OUT/speculators-<family>`` and judged under that
name, so that runs of different families do not collide (``--ours-recipe peagle|dflash`` races
our draft of the same family; the judge serves speculators' P-EAGLE and every DFlash draft at
K = --ttt-steps, our P-EAGLE at --k: keep them equal). Both
run in bf16 on CPUs with bf16 units (autocast for speculators, DeepSpeed's bf16 for ours) and in
fp32 on CPUs without them (AVX2 only), where bf16 matmuls are far slower than fp32.

Printed (one JSON line each): every trainer's tokens/s (training tokens / training-loop seconds)
and the ratio; every judged draft's vLLM tau per eval set and overall, and the ratio of each of
ours (``ours``, ``ours-<extra or variant>``) to speculators'. A finished run is reused when it ran
the same command (``--fresh`` retrains).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from eagle3.config import DEFAULT_TARGET

ROOT = Path(__file__).resolve().parents[2]


def run(cmd: list[str], log: Path) -> str:
    """Run from the repository root; stderr and then stdout go to ``log``; returns stdout (its last
    JSON line is the command's result)."""
    print(f"# {' '.join(cmd)}", file=sys.stderr, flush=True)
    with open(log, "w") as err:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    with open(log, "a") as out:
        out.write(done.stdout)
    if done.returncode:
        raise RuntimeError(f"failed ({done.returncode}): {' '.join(cmd)}; see {log}")
    return done.stdout


def last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"no JSON result in: {text[-500:]}")


def recipe_flags(name: str) -> list[str]:
    """A draft recipe (:func:`eagle3.train.config.draft_recipe`) as ``eagle3.train.loop`` flags."""
    from eagle3.train.config import draft_recipe

    try:
        settings = draft_recipe(name)
    except ValueError as err:
        raise SystemExit(f"--ours-recipe: {err}") from None
    flags = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def train_ours(name: str, store: str, args: argparse.Namespace) -> dict[str, Any]:
    """Our trainer: the race's fixed settings, then the ``--ours-recipe`` flags, ``--lr`` if given,
    then ``args.ours_args`` (later flags win)."""
    out = Path(args.out) / name
    cmd = [str(ROOT / ".venv/bin/python"), "-m", "eagle3.train", "--store", store, "--target", args.target,
           "--out", str(out), "--steps", str(args.steps), "--ttt-steps", str(args.ttt_steps),
           "--data.micro-batch-tokens", str(args.seq_len), "--data.batching", "buckets", "--precision", "auto",
           "--zero-stage", "1", "--optim.warmup-steps", str(max(1, args.steps // 50)),
           "--data.eval-fraction", str(args.eval_fraction), "--eval-every", "0", "--no-eval-at-start",
           "--save-every", "0", "--log.wandb-mode", "disabled", "--no-log.progress", "--no-resume"]
    if args.draft_vocab:
        cmd += ["--draft.vocab", args.draft_vocab]
    else:
        cmd += ["--draft.vocab-size", str(args.draft_vocab_size)]
    cmd += recipe_flags(args.ours_recipe)
    if args.lr is not None:
        cmd += ["--optim.lr", str(args.lr)]
    cmd += shlex.split(args.ours_args)
    return reused(out / "summary.json", cmd, args) or ran(out, cmd, Path(args.out) / f"{name}.log")


def reused(result: Path, cmd: list[str], args: argparse.Namespace) -> dict[str, Any] | None:
    """A finished run's result, when it ran this very command (``race_command.json`` beside it)."""
    saved = result.parent / "race_command.json"
    if args.fresh or not result.is_file() or not saved.is_file() or json.loads(saved.read_text()) != cmd:
        return None
    return json.loads(result.read_text())


def ran(out: Path, cmd: list[str], log: Path) -> dict[str, Any]:
    """Run ``cmd`` (it writes ``out``) and record it for :func:`reused`."""
    result = last_json(run(cmd, log))
    (out / "race_command.json").write_text(json.dumps(cmd) + "\n")
    return result


def cpu_dtype() -> str:
    """bfloat16 where this CPU's bf16 matmuls beat fp32 (AMX, AVX512-BF16), float32 on CPUs without
    bf16 units, where bf16 ran ~170x slower: what ``--precision auto`` picks for ours."""
    from eagle3.device import bf16_matmul_speedup

    return "bfloat16" if bf16_matmul_speedup("cpu") > 1.0 else "float32"


def speculators_name(family: str) -> str:
    """The folder and judged name of speculators' draft: ``speculators`` for its EAGLE-3 (as before)."""
    return "speculators" if family == "eagle3" else f"speculators-{family}"


def train_speculators(args: argparse.Namespace, vocab: Path) -> dict[str, Any]:
    from eagle3.target.source import resolve_target

    name = speculators_name(args.speculators_family)
    out, data = Path(args.out) / name, Path(args.out) / "speculators-data"  # the data is the same for every family
    cmd = [str(ROOT / ".venv-speculators/bin/python"), "bench/studies/speculators_train.py", "--data", str(data),
           "--target", str(resolve_target(args.target).location), "--out", str(out), "--steps", str(args.steps),
           "--ttt-steps", str(args.ttt_steps), "--seq-len", str(args.seq_len), "--dtype", cpu_dtype()]
    if args.speculators_family != "eagle3":  # (eagle3 is its default: an earlier EAGLE-3 run's command still matches)
        cmd += ["--family", args.speculators_family]
    if args.speculators_lr is not None:
        cmd += ["--lr", str(args.speculators_lr)]
    if (done := reused(out / "result.json", cmd, args)) is not None:
        return done
    if not data.is_dir() or args.fresh:
        shutil.rmtree(data, ignore_errors=True)
        run([str(ROOT / ".venv/bin/python"), "bench/studies/speculators_data.py", "--store", args.store,
             "--out", str(data), "--draft-vocab", str(vocab), "--eval-fraction", str(args.eval_fraction)],
            Path(args.out) / "speculators-data.log")
    shutil.rmtree(out, ignore_errors=True)
    return ran(out, cmd, Path(args.out) / f"{name}.log")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="harvest store both trainers read")
    parser.add_argument("--extra", action="append", default=[],
                        help="NAME=STORE: also train ours on another store (same settings) and judge it")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=ARGS: also train ours on --store with these eagle3.train.loop arguments in place of "
                             "--ours-args (same recipe, vocab, steps and lr) and judge it, e.g. "
                             "'all=--loss.positions all' or an ablation of one setting")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--pools", default="runs/pools")
    parser.add_argument("--out", default="runs/race/bench")
    parser.add_argument("--steps", type=int, default=180)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--draft-vocab", default=None, help="reuse this draft vocab (else chosen by our run)")
    parser.add_argument("--ours-recipe", default="target-head",
                        help="recipes/draft/NAME.yaml for our runs (the pipeline's default draft recipe), "
                             "or none for the library's defaults")
    parser.add_argument("--lr", type=float, default=None, help="ours (default: the recipe's; speculators: its own)")
    parser.add_argument("--speculators-lr", type=float, default=None, help="speculators' (default: its own, 1e-3)")
    parser.add_argument("--speculators-family", choices=("eagle3", "peagle", "dflash"), default="eagle3",
                        help="speculators' draft family (its --speculator-type), trained with --ttt-steps drafted "
                             "tokens per round; written to OUT/speculators-<family> unless eagle3")
    parser.add_argument("--eval-fraction", type=float, default=0.1)
    parser.add_argument("--per-set", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--ours-args", default="", help="more eagle3.train.loop arguments for our runs, after the "
                        "recipe's, e.g. '--loss.positions all'")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)

    ours = train_ours("ours", args.store, args)
    vocab = Path(args.out) / "ours" / "draft_vocab.safetensors"
    spec = train_speculators(args, vocab)
    extras = {}
    for item in args.extra:
        name, _, store = item.partition("=")
        same_vocab = argparse.Namespace(**{**vars(args), "draft_vocab": str(vocab)})
        extras[name] = train_ours(f"ours-{name}", store, same_vocab)
    for item in args.variant:
        name, _, ours_args = item.partition("=")
        variant = argparse.Namespace(**{**vars(args), "draft_vocab": str(vocab), "ours_args": ours_args})
        extras[name] = train_ours(f"ours-{name}", args.store, variant)

    peer = speculators_name(args.speculators_family)
    rows = [("ours", ours["tokens_per_s"]), (peer, spec["tokens_per_s"]),
            *((f"ours-{name}", summary["tokens_per_s"]) for name, summary in extras.items())]
    for name, value in rows:
        print(json.dumps({"figure": "race_train_tokens_per_s", "trainer": name, "tokens_per_s": value}), flush=True)
    print(json.dumps({"figure": "race_train_tokens_per_s_ratio", "speculators": peer, "ours_over_speculators":
                      round(ours["tokens_per_s"] / spec["tokens_per_s"], 3)}), flush=True)

    drafts = ["--draft", f"ours={Path(args.out) / 'ours' / 'final'}", "--draft", f"{peer}={spec['draft']}"]
    for name in extras:
        drafts += ["--draft", f"ours-{name}={Path(args.out) / f'ours-{name}' / 'final'}"]
    judge_cmd = [".venv-vllm/bin/python", "tools/vllm_judge.py", *drafts, "--pools", args.pools,
                 "--per-set", str(args.per_set), "--k", str(args.k), "--max-new-tokens", str(args.max_new_tokens),
                 "--target", args.target, *(["--controls"] if args.extra else [])]
    # vLLM's CPU settings (scripts/vllm_env.sh) only for the judge: its OpenMP preload is not for our venv
    judge = run(["bash", "-c", 'source scripts/vllm_env.sh && exec "$@"', "judge", *judge_cmd],
                Path(args.out) / "judge.log")
    lines = [json.loads(line) for line in judge.splitlines() if line.startswith("{")]
    (Path(args.out) / "judge.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    for line in lines:
        print(json.dumps(line), flush=True)
    overall = {x["draft"]: x["tau"] for x in lines if x["figure"] == "vllm_judge_overall"}
    for draft in ["ours", *(f"ours-{name}" for name in extras)]:  # every draft of ours against speculators'
        print(json.dumps({"figure": "race_tau_ratio", "draft": draft, "speculators": peer, "ours_tau": overall[draft],
                          "speculators_tau": overall[peer],
                          "ours_over_speculators": round(overall[draft] / overall[peer], 3),
                          "steps": args.steps, "ttt_steps": args.ttt_steps, "seq_len": args.seq_len}), flush=True)


if __name__ == "__main__":
    main()
