"""The vLLM judge's bookkeeping that needs no vLLM: acceptance by context from engine-wide counters."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("vllm_judge", Path(__file__).resolve().parents[1] / "tools" /
                                              "vllm_judge.py")
judge = importlib.util.module_from_spec(spec)
spec.loader.exec_module(judge)


def test_prompts_are_generated_per_context_bucket_and_their_counters_add_up() -> None:
    prompts = [[1] * 5000, [1] * 10, [1] * 1500, [1] * 900, [1] * 300000]
    assert judge.group_by_context(prompts) == {"0-1k": [1, 3], "1-2k": [2], "4-8k": [0], "256k+": [4]}
    parts = {"0-1k": {"drafts": 4, "draft_tokens": 12, "accepted": 6, "per_pos": [3, 2, 1]},
             "4-8k": {"drafts": 2, "draft_tokens": 6, "accepted": 0, "per_pos": []},
             "1-2k": {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0, 0, 0]}}
    assert judge.merge_counters(list(parts.values())) == {"drafts": 6, "draft_tokens": 18, "accepted": 6,
                                                          "per_pos": [3, 2, 1]}
    assert judge.by_context({"by_context": parts}) == {  # a bucket that never drafted is left out
        "0-1k": {"drafts": 4, "tau": 2.5, "accept_per_pos": [0.75, 0.5, 0.25]},
        "4-8k": {"drafts": 2, "tau": 1.0, "accept_per_pos": []}}
