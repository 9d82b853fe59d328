"""Long-context eval sets: the same request short and at each length, its focus text kept whole."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from data_gen import long_context
from data_gen.long_context import Task, build, fill
from eagle3.errors import ConfigError


def _words(prompt: str | list[dict], tools: list | None = None) -> int:  # a stand-in tokenizer: a token a word,
    extra = 10 + 20 * len(tools or [])                                     # ten for the template, twenty a tool
    if isinstance(prompt, list):  # a chat: four more a turn, eight more a call
        return extra + sum(4 + len(m["content"].split()) + 8 * len(m.get("tool_calls", [])) for m in prompt)
    return extra + len(prompt.split())


def _task(i: int) -> Task:
    others = [f"other text {i}.{j} " + "word " * (20 + j) for j in range(40)]
    return Task(f"t{i}", f"FOCUS {i} " + "kept " * 30, f"Repeat the focus {i}.", others, "en")


def test_fill_keeps_the_focus_whole_and_stays_within_the_length() -> None:
    task = _task(0)
    for length in (100, 300, 600):
        message, tokens = fill(task, length, _words, random.Random(1))
        assert message.count(task.focus) == 1 and message.endswith(task.request)
        assert tokens == _words(message) and length - 60 < tokens <= length  # full up to one more text
    short, _ = fill(task, 10, _words, random.Random(1))  # nothing fits: the focus alone
    assert short == task.focus + "\n\n" + task.request


def test_build_writes_each_task_short_then_at_each_length(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(long_context, "code_tasks", lambda n, seed: [_task(i) for i in range(n)])
    monkeypatch.setattr(long_context, "docs_tasks", lambda n, seed: [_task(10 + i) for i in range(n)])
    assert build(tmp_path, _words, [600, 300], tasks=2) == {"long_code": 6, "long_docs": 6, "long_chat": 6,
                                                             "long_edit": 6}
    records = [json.loads(line) for line in (tmp_path / "eval" / "long_code.jsonl").read_text().splitlines()]
    assert [r["meta"]["variant"] for r in records] == ["short", "300", "600"] * 2
    assert [r["meta"]["task"] for r in records] == ["t0"] * 3 + ["t1"] * 3
    for r in records:
        text = r["messages"][0]["content"]
        assert r["meta"]["prompt_tokens"] == _words(text)
        assert text.endswith(f"Repeat the focus {r['meta']['task'][1:]}.")
    again = tmp_path / "again"
    build(again, _words, [300, 600], tasks=2)  # seeded: the same sets again
    for name in ("long_code", "long_chat", "long_edit"):
        assert (again / "eval" / f"{name}.jsonl").read_text() == (tmp_path / "eval" / f"{name}.jsonl").read_text()
    with pytest.raises(ConfigError, match="--lengths"):
        build(tmp_path, _words, [100], tasks=1)


def test_the_chat_set_shares_each_text_in_a_turn_and_asks_last(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(long_context, "code_tasks", lambda n, seed: [_task(i) for i in range(n)])
    monkeypatch.setattr(long_context, "docs_tasks", lambda n, seed: [_task(10 + i) for i in range(n)])
    build(tmp_path, _words, [300, 600], tasks=3)
    records = [json.loads(line) for line in (tmp_path / "eval" / "long_chat.jsonl").read_text().splitlines()]
    # past the tasks the other sets ask (code 3-4, docs 13), code and docs in turn
    assert [r["meta"]["task"] for r in records[::3]] == ["t3", "t13", "t4"]
    assert [r["domain"] for r in records[::3]] == ["coding", "multilingual", "coding"]
    for r in records:
        turns = r["messages"]
        assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2) + ["user"]
        assert r["meta"]["prompt_tokens"] == _words(turns) and r["meta"]["turns"] == len(turns)
        assert turns[-1]["content"] == f"Repeat the focus {r['meta']['task'][1:]}."
        shared = [m["content"] for m in turns[0:-1:2]]
        assert sum(text.endswith(f"FOCUS {r['meta']['task'][1:]} " + "kept " * 30) for text in shared) == 1
        if r["meta"]["variant"] == "short":
            assert len(turns) == 3
        else:
            assert int(r["meta"]["variant"]) - 80 < r["meta"]["prompt_tokens"] <= int(r["meta"]["variant"])


def _code_task(i: int) -> Task:  # a code task's texts: a "# file:" line, then what read_file returns
    others = [f"# file: other_{i}_{j}.py\n" + "word " * (20 + j) for j in range(40)]
    return Task(f"mod_{i}.py:fn_{i}", f"# file: mod_{i}.py\ndef fn_{i}():\n" + "    kept\n" * 30, "", others, "en")


def test_the_edit_set_reads_files_through_the_tool_and_asks_for_the_function_back(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    from data_gen.long_edit import TOOLS

    monkeypatch.setattr(long_context, "code_tasks", lambda n, seed: [_code_task(i) for i in range(n)])
    monkeypatch.setattr(long_context, "docs_tasks", lambda n, seed: [_task(10 + i) for i in range(n)])
    build(tmp_path, _words, [300, 600], tasks=2)
    records = [json.loads(line) for line in (tmp_path / "eval" / "long_edit.jsonl").read_text().splitlines()]
    assert [r["meta"]["task"] for r in records[::3]] == ["mod_4.py:fn_4", "mod_5.py:fn_5"]  # past the other sets'
    assert [r["meta"]["variant"] for r in records] == ["short", "300", "600"] * 2
    for r in records:
        m, i = r["messages"], r["meta"]["task"][4]
        assert r["tools"] == TOOLS and r["domain"] == "agent"
        assert m[0]["role"] == "user" and m[0]["content"].startswith(f"In `mod_{i}.py`, ")
        assert f"fn_{i}" in m[0]["content"] and m[0]["content"].endswith("show me the whole updated function.")
        assert [x["role"] for x in m[1:-1]] == ["assistant", "tool"] * r["meta"]["reads"]
        assert m[-1] == {"role": "assistant", "content": ""}  # the reply left to write
        assert m[-3]["tool_calls"][0]["function"] == {"name": "read_file", "arguments": {"path": f"mod_{i}.py"}}
        assert m[-2]["content"] == f"def fn_{i}():\n" + "    kept\n" * 30  # the focus read last, whole
        assert r["meta"]["prompt_tokens"] == _words(m[:-1], TOOLS)
        if r["meta"]["variant"] == "short":
            assert r["meta"]["reads"] == 1
        else:
            assert r["meta"]["reads"] > 1
            assert int(r["meta"]["variant"]) - 80 < r["meta"]["prompt_tokens"] <= int(r["meta"]["variant"])


def test_the_cli_refuses_a_length_beyond_the_targets_context(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(long_context, "prompt_counter", lambda target: (_words, 8192))
    assert long_context.main(["--pools", str(tmp_path), "--lengths", "4096,8192"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("long_context: error: --lengths: 8192 tokens do not fit") and len(err.splitlines()) == 1
    assert not (tmp_path / "eval").exists()


@pytest.mark.slow
def test_the_sets_from_the_real_wheels_reach_each_length(tmp_path: Path) -> None:
    """Jinja2's and dataset-build's wheels, measured in the embedded target's chat template."""
    count, room = long_context.prompt_counter("smollm2-135m")
    assert room == 8192
    assert build(tmp_path, count, [2048, 4096], tasks=2) == {"long_code": 6, "long_docs": 6, "long_chat": 6,
                                                              "long_edit": 6}
    chat = [json.loads(line) for line in (tmp_path / "eval" / "long_chat.jsonl").read_text().splitlines()]
    for short, mid, long in zip(chat[0::3], chat[1::3], chat[2::3], strict=True):  # a turn's own tokens leave slack
        assert short["meta"]["prompt_tokens"] < 2048 and 1200 < mid["meta"]["prompt_tokens"] <= 2048
        assert 3000 < long["meta"]["prompt_tokens"] <= 4096 and long["meta"]["prompt_tokens"] == count(long["messages"])
        assert short["messages"][-1] == mid["messages"][-1] == long["messages"][-1]  # the same request
    for name in ("long_code", "long_docs"):
        records = [json.loads(line) for line in (tmp_path / "eval" / f"{name}.jsonl").read_text().splitlines()]
        for short, mid, long in zip(records[0::3], records[1::3], records[2::3], strict=True):
            assert short["meta"]["prompt_tokens"] < 2048 and 1500 < mid["meta"]["prompt_tokens"] <= 2048
            assert 3500 < long["meta"]["prompt_tokens"] <= 4096
            request = short["messages"][0]["content"].rsplit("\n\n", 1)[1]
            assert all(r["messages"][0]["content"].endswith(request) for r in (mid, long))
