"""Conversation records and users' prompt files: every bad input is a clear error or a counted skip."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from eagle3.conversations import (
    ConversationError,
    LoadReport,
    check_messages,
    check_tools,
    iter_user_conversations,
    make_record,
    normalize_text,
    record_id,
)


def test_check_messages_accepts_sharegpt_and_openai_shapes() -> None:
    sharegpt = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]
    openai = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\r\nthere"}]
    assert check_messages(sharegpt) == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert check_messages(openai)[1] == {"role": "user", "content": "Hi\nthere"}
    # a reply stays as written: after regeneration it is the target's decoded output, its ids must match
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert check_messages(parts) == [{"role": "user", "content": "Hi\nthere"}]  # text parts, joined as vLLM does
    reply = check_messages([*openai, {"role": "assistant", "content": "a\r\nb"}])[2]
    assert reply == {"role": "assistant", "content": "a\r\nb"}


@pytest.mark.parametrize(("messages", "reason"), [
    ([], "non-empty list"),
    ([{"role": "assistant", "content": "Hi"}], "starts with assistant, not user"),
    ([{"role": "wizard", "content": "Hi"}], "unknown role 'wizard'"),
    ([{"role": "user", "content": "  "}], "message 0 (user) is empty"),
    ([{"role": "user", "content": ["a", "b"]}], "message 0 (user): content part 0 is 'str', not text"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}],
     "content part 1 is 'image_url', not text"),
    ([{"role": "user", "content": 3}], "non-text content of type int"),
    ([{"from": "human"}], "message 0 (user) has no 'value'"),  # a ShareGPT turn without its text
    ([{"role": "user"}], "message 0 (user) has no 'content'"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], "content part 0 has no string 'text'"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "system message after the start"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "message 1 is user after user (expected assistant)"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "message 1 is tool after user"),
    ([{"role": "user", "content": "a"},
      {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]},
      {"role": "user", "content": "b"}],
     "makes 1 tool call(s) but 0 tool result(s) follow it: the result of f is missing"),
    ([{"role": "user", "content": "a"},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
      {"role": "tool", "tool_call_id": "c2", "content": "r"}],
     "calls f (id c1) but no tool result with that tool_call_id"),
    ([{"role": "user", "content": "a"},
      {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]},
      {"role": "tool", "content": "r"}], "tool call 0 (f) has arguments that are not JSON"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}, {"role": "tool", "content": " "}],
     "message 2 (tool) is empty"),
    ([{"role": "system", "content": "only a system prompt"}], "no user turn"),
    (["just a string"], "message 0 is str"),
])
def test_check_messages_rejects(messages: list, reason: str) -> None:
    with pytest.raises(ConversationError, match=re.escape(reason)):
        check_messages(messages)


def test_tool_turns_are_kept_with_their_names_and_calls() -> None:
    messages = check_messages([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get", "content": "4 C"},
        {"role": "assistant", "content": "It is 4 C."},
        {"role": "user", "content": "thanks"},
    ])
    assert messages[1] == {"role": "assistant", "content": "",
                           "tool_calls": [{"type": "function", "id": "c1",
                                           "function": {"name": "get", "arguments": {"city": "Oslo"}}}]}
    assert messages[2] == {"role": "tool", "content": "4 C", "name": "get", "tool_call_id": "c1"}


@pytest.mark.parametrize(("tools", "reason"), [
    ("[{bad", "'tools' is a string that is not JSON"),
    ({"name": "f"}, "'tools' is dict: expected a list"),
    ([{"description": "no name"}], "tools[0] has no function name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tools[0] (f): 'parameters' is str"),
])
def test_bad_tool_schemas_are_named(tools: object, reason: str) -> None:
    with pytest.raises(ConversationError, match=re.escape(reason)):
        check_tools(tools)
    good = check_tools('[{"name": "f", "parameters": {"type": "object"}}]')
    assert good == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_ids_are_content_hashes_of_the_prompt() -> None:
    a = [{"role": "user", "content": "What  is\nPython?"}, {"role": "assistant", "content": "x"}]
    b = [{"role": "user", "content": "what is python?"}, {"role": "assistant", "content": "something else"}]
    assert record_id(a) == record_id(b)  # normalised user text; assistant text is not part of the prompt
    assert normalize_text("Ｆｕｌｌ  Width") == "full width"
    record = make_record(a, domain="coding", source="test", language="en")
    assert record["id"] == record_id(a) and record["messages"][0]["content"] == "What  is\nPython?"
    with pytest.raises(ConversationError, match="domain 'cooking'"):
        make_record(a, domain="cooking", source="test", language="en")


def test_jsonl_bad_rows_are_skipped_and_counted_or_raised(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "Héllo"}]}
    lines = [
        b"\xef\xbb\xbf" + json.dumps(good).encode() + b"\r\n",  # BOM + CRLF: fine
        b"{not json}\r\n",
        b"\r\n",  # blank: ignored
        json.dumps({"conversations": [{"from": "gpt", "value": "I start"}]}).encode() + b"\n",
        json.dumps({"text": "no messages"}).encode() + b"\n",
        "caf\xe9".encode("latin-1") + b"\n",
        json.dumps({"conversations": [{"from": "human", "value": "ok"}]}).encode() + b"\n",
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"".join(lines))
    report = LoadReport()
    rows = list(iter_user_conversations(path, report=report))
    assert [w for w, _ in rows] == [f"{path}:1", f"{path}:7"]
    assert rows[0][1] == [{"role": "user", "content": "Héllo"}]
    assert report.kept == 2 and sum(report.skipped.values()) == 4
    assert f"{path}:2: malformed JSON" in report.first_errors[0]
    assert any("not UTF-8" in e and ":6:" in e for e in report.first_errors)
    with pytest.raises(ConversationError, match=rf"{path}:2: malformed JSON"):
        list(iter_user_conversations(path, strict=True))


def test_datasets_folder_and_missing_path(tmp_path: Path) -> None:
    import datasets

    folder = tmp_path / "ds"
    datasets.Dataset.from_list([
        {"messages": [{"role": "user", "content": "one"}]},
        {"messages": [{"role": "assistant", "content": "bad start"}]},
    ]).save_to_disk(str(folder))
    report = LoadReport()
    rows = list(iter_user_conversations(folder, report=report))
    assert len(rows) == 1 and report.skipped == {"conversation starts with assistant, not user": 1}
    with pytest.raises(ConversationError, match=r"ds\[1\]: conversation starts with assistant"):
        list(iter_user_conversations(folder, strict=True))
    with pytest.raises(ConversationError, match="nope.jsonl: no such file"):
        list(iter_user_conversations(tmp_path / "nope.jsonl"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ConversationError, match="not an HF datasets folder"):
        list(iter_user_conversations(tmp_path / "empty_dir"))
