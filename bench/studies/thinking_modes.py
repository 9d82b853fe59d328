"""A draft trained on thinking-on data only against one trained on a mix, each served with thinking on
and with it off: does the mix keep its acceptance in both modes, and does the on-only
draft drop with thinking off, as published drafts do (z-lab/dflash #60)?

    OMP_NUM_THREADS=1 .venv/bin/python bench/studies/thinking_modes.py --pools runs/quickstart/pools \\
        --out runs/thinking [--prompts 96] [--steps 60] [--per-set 8] [--seed 0]

The embedded target has no thinking switch, so it is served here under a template that has one,
modelled on Qwen3's (``enable_thinking``): on, the generation prompt opens ``<think>\\n``; off, it
writes the empty block ``<think>\\n\\n</think>\\n\\n``; earlier replies lose their reasoning. The
target folder is the embedded target's, its weights linked, its chat template replaced. Each arm runs
the pipeline (``pools, regenerate, harvest, val, train``) with ``regenerate.thinking`` ``on`` or
``mix`` and the same settings otherwise, then the serving evaluation twice (``eval.thinking=on``,
``off``). One JSON line per (arm, mode), then the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

THINKING_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)


def target_folder(out: Path) -> Path:
    """The embedded target's folder with the thinking template (weights linked, not copied)."""
    from eagle3.target.source import resolve_target

    source = Path(resolve_target("smollm2-135m").location)
    folder = out / "target"
    folder.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        link = folder / item.name
        if item.name in ("chat_template.jinja", "eagle3_source.json") or link.exists():
            continue
        link.symlink_to(item.resolve())
    (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE, encoding="utf-8")
    return folder


def run(args: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run([str(ROOT / ".venv/bin/eagle3-run"), *args], check=True, cwd=ROOT, env=env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", default="runs/quickstart/pools")
    parser.add_argument("--out", default="runs/thinking")
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--per-set", type=int, default=8)
    parser.add_argument("--sets", default="mtbench,gsm8k,alpaca")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="the seeds of the prompt choice, regeneration and training")
    args = parser.parse_args()
    out = (ROOT / args.out).resolve()
    target = target_folder(out)
    results: dict[tuple[str, str], float] = {}
    for arm in ("on", "mix"):
        common = [f"out_dir={out / arm}", f"target.name_or_path={target}", f"pools.out_dir={args.pools}",
                  f"select.num_prompts={args.prompts}", "select.domains=[coding,science,multilingual,general]",
                  f"regenerate.thinking={arm}", f"regenerate.max_new_tokens={args.max_new_tokens}",
                  "val.num_prompts=12", f"train.steps={args.steps}", "threads=1", f"seed={args.seed}",
                  f"select.seed={args.seed}", f"train.seed={args.seed}"]
        run([*common, "stages=[pools,regenerate,harvest,val,train]"])
        for mode in ("on", "off"):
            report = out / arm / f"eval-{mode}"
            run([*common, "stages=[eval]", f"eval.thinking={mode}", f"eval.out_dir={report}",
                 f"eval.sets=[{args.sets}]", f"eval.per_set={args.per_set}",
                 f"eval.max_new_tokens={args.max_new_tokens}"])
            overall = json.loads((report / "report.json").read_text())["overall"]
            results[arm, mode] = overall["tau"]
            print(json.dumps({"seed": args.seed, "arm": arm, "served_thinking": mode, "tau": overall["tau"],
                              "equal": overall.get("equal"), "prompts": overall["prompts"],
                              "by_part": overall.get("by_part")}), flush=True)
    print(json.dumps({
        "mix_vs_on_with_thinking_on": round(results["mix", "on"] / results["on", "on"], 4),
        "mix_off_vs_mix_on": round(results["mix", "off"] / results["mix", "on"], 4),
        "on_off_vs_on_on": round(results["on", "off"] / results["on", "on"], 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
