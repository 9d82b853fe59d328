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


def test_tokens_per_forward_counts_the_rounds_that_proposed_nothing() -> None:
    # two prompts, 10 tokens each: the prefill gives 1 each; 18 after it; 6 accepted -> 12 forwards
    assert judge.tokens_per_forward(20, 2, 6) == 1.5
    assert judge.tokens_per_forward(20, 2, 0) == 1.0  # nothing accepted: plain decoding
    assert judge.tokens_per_forward(2, 2, 0) == 1.0  # only prefills


def test_a_windowed_draft_gets_a_copy_without_its_window(tmp_path: Path) -> None:
    import json

    from eagle3.export import export_draft_folder
    from tests.helpers import tiny_draft

    draft = tiny_draft(1, sliding_window=8)
    for fmt in ("vllm", "speculators"):
        out = export_draft_folder(tmp_path / fmt, draft.state_dict(), draft.config, (1, 2, 3), fmt, dtype="float32",
                                  verifier="/models/target")
        copies = judge.window_controls(out, tmp_path / f"w-{fmt}")
        assert set(copies) == {"window-removed"}
        cfg = json.loads((copies["window-removed"] / "config.json").read_text())
        layer = cfg.get("transformer_layer_config") or cfg
        assert "layer_types" not in layer and layer["sliding_window"] == 8  # vLLM reads no window without them
    plain = tiny_draft(1)
    out = export_draft_folder(tmp_path / "plain", plain.state_dict(), plain.config, (1, 2, 3), "vllm")
    assert judge.window_controls(out, tmp_path / "w-plain") == {}
