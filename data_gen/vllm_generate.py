"""Generation with real vLLM: the regeneration backend that batches far better than HF.

vLLM pins its own torch and transformers, so this runs from the separate venv made by
``scripts/setup_vllm_env.sh``; nothing else in the library imports vLLM. Prompts are
token ids rendered by :class:`eagle3.target.chat.ChatFormat`, exactly as for the HF backend, and
replies come back as :class:`data_gen.generate.Reply` with the same stop handling.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from data_gen.generate import Reply, derive_seed, trim_generated
from eagle3.config import SamplingConfig


def require_vllm(key: str) -> None:
    """Refuse ``key=vllm`` in an environment without vLLM, in one line saying how to get it."""
    import importlib.util
    import sys

    from eagle3.errors import ConfigError

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{key}=vllm: vLLM is not installed in this environment ({sys.executable}); install it "
                          f"with `bash scripts/setup_vllm_env.sh` and run from .venv-vllm, or set {key}=hf")


class VllmGenerator:
    """A vLLM engine over a local model folder, generating from token ids."""

    name = "vllm"

    def __init__(self, model: str, *, dtype: str = "float32", max_model_len: int = 4096, seed: int = 0,
                 **engine_args: Any) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's CPU backend needs a budget
        import torch
        from vllm import LLM

        from data_gen.nvfp4 import prepare_vllm_on_cpu

        prepare_vllm_on_cpu(model)

        on_cpu = not torch.cuda.is_available()
        settings: dict[str, Any] = dict(
            model=model, tokenizer=model, dtype=dtype, max_model_len=max_model_len, seed=seed,
            enable_prefix_caching=False,
        )
        if on_cpu:
            settings["enforce_eager"] = True
        settings.update(engine_args)
        self.llm = LLM(**settings)

    def generate(self, prompts: Sequence[Sequence[int]], stop_ids: Iterable[int], max_new_tokens: int,
                 sampling: SamplingConfig,
                 *, seed: int = 0) -> list[Reply]:
        from vllm import SamplingParams

        stops = sorted(set(int(i) for i in stop_ids))
        params = [
            SamplingParams(
                max_tokens=max_new_tokens, temperature=sampling.temperature,
                top_p=sampling.top_p, top_k=sampling.top_k, stop_token_ids=stops,
                seed=None if sampling.greedy else derive_seed(seed, row), detokenize=False,
            )
            for row in range(len(prompts))
        ]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return trim_generated([list(o.outputs[0].token_ids) for o in outs], stops)
