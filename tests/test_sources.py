"""Source parsers on small synthetic wheels: the packaged files' quirks, reproduced."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

from data_gen.sources import (
    MMATH_LANGUAGES,
    chatterbot_conversations,
    classify_english,
    codeio_prompts,
    iter_json_array,
    mmath_problems,
    sharegpt_conversations,
    text_paragraphs,
)


def _wheel(tmp_path: Path, files: dict[str, bytes]) -> Path:
    path = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def test_json_array_stops_at_a_cut_off_tail() -> None:
    text = '[\n {"a": 1},\n {"a": [2, 3]},\n {"a": "unterminated'
    assert list(iter_json_array(text)) == [{"a": 1}, {"a": [2, 3]}]
    assert list(iter_json_array("[]")) == []


def test_sharegpt_keeps_user_first_conversations(tmp_path: Path) -> None:
    convs = [
        {"id": "a_0", "conversations": [{"from": "system", "value": "*shared from somewhere*"},
                                        {"from": "human", "value": "Write a python script"},
                                        {"from": "gpt", "value": "ok"}, {"from": "human", "value": "more"},
                                        {"from": "gpt", "value": "sure"}, {"from": "human", "value": "third"}]},
        {"id": "b_1", "conversations": [{"from": "gpt", "value": "a continuation chunk"}]},
        {"id": "c_0", "conversations": []},
        {"id": "d_0", "conversations": [{"from": "human", "value": "Tell me about your weekend"},
                                        {"from": "bing", "value": "fine"}]},
    ]
    text = json.dumps(convs, indent=2)[:-40]  # cut inside the last conversation, as the package is
    wheel = _wheel(tmp_path, {"data.json": text.encode()})
    got = list(sharegpt_conversations(wheel, "data.json", max_user_turns=2))
    assert len(got) == 1
    assert [m["role"] for m in got[0].messages] == ["user", "assistant", "user", "assistant"]
    assert got[0].domain == "coding"


def test_classify_english() -> None:
    assert classify_english("How do I fix this SQL query?") == "coding"
    assert classify_english("Solve the equation x^2 = 4") == "science"
    assert classify_english("Plan a trip to Rome") == "general"


def test_codeio_is_a_gzipped_json_array(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, {"c.jsonl.gz": gzip.compress(json.dumps([{"prompt": "P1"}, {"prompt": ""}]).encode())})
    assert [p.messages[0]["content"] for p in codeio_prompts(wheel, "c.jsonl.gz")] == ["P1"]


def test_mmath_groups_translations_by_gid(tmp_path: Path) -> None:
    files = {f"m/{lang}.json": json.dumps([{"question": f"{lang} q{g}", "answer": "1", "gid": g, "lang": lang}
                                            for g in range(2)]).encode() for lang in MMATH_LANGUAGES}
    files["mmath/mmath_eval.py"] = (b'def f():\n    LANG_TO_INSTRUCTIONS = {"en": "{question}\\nThink.", '
                                    b'"fr": "{question}\\nPensez."}\n')
    got = list(mmath_problems(_wheel(tmp_path, files), "m"))
    assert len(got) == 20 and {p.group for p in got} == {"mmath:0", "mmath:1"}
    en = [p for p in got if p.language == "en"]
    assert en[0].messages[0]["content"] == "en q0\nThink." and en[0].domain == "science"
    assert {p.domain for p in got if p.language != "en"} == {"multilingual"}
    assert [p for p in got if p.language == "ja"][0].messages[0]["content"] == "ja q0"  # no format given


def test_chatterbot_uses_the_folder_language(tmp_path: Path) -> None:
    yml = "\ufeffcategories: [x]\nconversations:\n- - Bonjour\n  - Salut\n  - Ça va ?\n- - seul\n"
    wheel = _wheel(tmp_path, {"d/french/a.yml": yml.encode(), "d/english/b.yml": b"conversations: [[a, b]]"})
    got = list(chatterbot_conversations(wheel, "d/"))
    assert len(got) == 1 and got[0].language == "fr"
    assert [m["content"] for m in got[0].messages] == ["Bonjour", "Salut"]


def test_text_paragraphs_drop_preamble_and_headers() -> None:
    body = "x" * 250
    text = f"Of course. Here is the text.\r\n\r\n1. Section\r\n\r\n{body}\r\n\r\n### Header\r\n\r\n{body}y"
    assert text_paragraphs(text) == [body, body + "y"]
