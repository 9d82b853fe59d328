"""Pool building on small synthetic sources (unit) and on the real packaged sources (integration)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from data_gen import pools
from data_gen.config import PoolsConfig
from data_gen.pools import build_pools, check_no_overlap, read_jsonl
from data_gen.sources import Prompt


def _u(*turns: str) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    for t in turns:
        if messages:
            messages.append({"role": "assistant", "content": "earlier answer"})
        messages.append({"role": "user", "content": t})
    return messages


def fake_sources(name: str, **options) -> list[Prompt]:
    english = [f"Please describe the history of the city number {i} in a few paragraphs." for i in range(6)]
    data = {
        "mtbench": [Prompt("mtbench", "general", _u("Write a poem about rain.", "Now shorter."), "en")],
        "humaneval": [Prompt("humaneval", "coding", _u("Complete def add(a, b):"), "en")],
        "gsm_symbolic": [Prompt("gsm_symbolic", "science", _u(f"Tom has {i} apples. How many?"), "en")
                         for i in range(3)],
        "mmath": [Prompt("mmath", "science" if lang == "en" else "multilingual", _u(f"[{lang}] problem {gid}"),
                         lang, group=f"mmath:{gid}", meta={"gid": gid})
                  for lang in ("en", "fr") for gid in range(8)],
        "sharegpt": [Prompt("sharegpt", "general", _u(t)) for t in english]
        + [Prompt("sharegpt", "coding", _u("complete   DEF add(a, b):")),  # an eval prompt, re-spelled
           Prompt("sharegpt", "general", _u(english[0])),  # duplicate
           Prompt("sharegpt", "general", _u("Wie funktioniert ein Kühlschrank eigentlich genau im Alltag?"))],
        "long_reuse": [Prompt("long_reuse", "long", _u("a long file " * 700 + "Copy `f` above."), "en")],
        "codeio": [Prompt("codeio", "coding", _u("x" * 7000), "en"), Prompt("codeio", "coding", _u("?"), "en"),
                   Prompt("codeio", "coding", _u("Write a function that reverses a list."), "en")],
        "bfcl": [Prompt("bfcl", "tool_use", _u(f"What is the weather in city {i}?"), "en", group=f"bfcl:simple_{i}",
                        tools=[TOOL]) for i in range(4)],
        "bfcl_agent": [Prompt("bfcl_agent", "agent", _agent(i, options.get("max_user_turns", 2)), "en",
                              group=f"bfcl:multi_turn_base_{i}", tools=[TOOL]) for i in range(4)],
    }
    return list(data[name])


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def _agent(i: int, turns: int) -> list[dict]:
    """A BFCL-like conversation: a call and its result, an answer, and a second turn."""
    messages: list[dict] = [{"role": "user", "content": f"Weather in town {i}, then advise me."},
                            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather"}}]},
                            {"role": "tool", "content": f"{i} C"}, {"role": "assistant", "content": ""}]
    later = [{"role": "user", "content": "And tomorrow?"}, {"role": "assistant", "content": ""}]
    return messages + later[: 2 * (turns - 1)]


def fake_code_agent_eval(tasks: int, seed: int = 0) -> list[Prompt]:
    return [Prompt("code_agent_eval", "agent", _agent(100 + i, 1), "en", tools=[TOOL]) for i in range(tasks)]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pools, "read_source", fake_sources)
    monkeypatch.setattr(pools, "code_agent_eval", fake_code_agent_eval)
    monkeypatch.setattr(pools, "_source_versions", lambda: {})


def _cfg(out: Path) -> PoolsConfig:
    return PoolsConfig(out_dir=str(out), sources=["sharegpt", "codeio", "mmath", "bfcl", "bfcl_agent"], eval_math=2,
                       eval_multilingual=1, eval_gsm8k=2, eval_alpaca=1, eval_tool_use=1, eval_agent=2,
                       val_fraction=0.3, max_chars=6000)


def test_pools_hold_out_eval_sets_and_count_skips(tmp_path: Path, fake: None) -> None:
    manifest = build_pools(_cfg(tmp_path / "p"))
    out = tmp_path / "p"
    evals = {name: read_jsonl(out / "eval" / f"{name}.jsonl") for name in pools.EVAL_SETS}
    assert {k: len(v) for k, v in evals.items()} == {
        "mtbench": 1, "humaneval": 1, "gsm8k": 2, "math": 2, "multilingual": 1, "alpaca": 1, "tool_use": 1,
        "agent": 2}
    assert {r["language"] for r in evals["multilingual"]} == {"fr"}
    held = {r["meta"]["gid"] for r in evals["math"] + evals["multilingual"]}
    assert len(held) == 3
    train = read_jsonl(out / "train.jsonl") + read_jsonl(out / "val.jsonl")
    assert not {r["meta"]["gid"] for r in train if r["source"] == "mmath"} & held
    assert manifest["skipped"] == {"held-out MMATH problem (gid)": 6, "in an eval set": 2, "duplicate": 1,
                                   "too long": 1, "too short": 1, "held-out BFCL entry (id)": 2}
    # tools travel with their records; an agent eval record ends at a tool result, its reply left to write
    assert all(r["tools"] == [TOOL] for r in evals["tool_use"] + evals["agent"])
    assert [m["role"] for m in evals["agent"][0]["messages"]] == ["user", "assistant", "tool", "assistant"]
    held_first_turns = {r["messages"][0]["content"] for r in evals["tool_use"] + evals["agent"]}
    assert len(held_first_turns) == 3 and not held_first_turns & {r["messages"][0]["content"] for r in train}
    assert sum(r["domain"] == "agent" for r in train) == 3 and sum(r["domain"] == "tool_use" for r in train) == 3
    # The German ShareGPT prompt is detected and counted as multilingual.
    german = [r for r in train if r["messages"][0]["content"].startswith("Wie")]
    assert german and german[0]["language"] == "de" and german[0]["domain"] == "multilingual"
    assert check_no_overlap(out) == dict.fromkeys(pools.EVAL_SETS, 0)
    # Translations of one MMATH problem land on the same side of the train/val split.
    sides: dict[int, set[str]] = {}
    for side in ("train", "val"):
        for r in read_jsonl(out / f"{side}.jsonl"):
            if r["source"] == "mmath":
                sides.setdefault(r["meta"]["gid"], set()).add(side)
    assert all(len(s) == 1 for s in sides.values())


def test_pools_are_deterministic_and_atomic(tmp_path: Path, fake: None, monkeypatch: pytest.MonkeyPatch) -> None:
    build_pools(_cfg(tmp_path / "a"))
    build_pools(_cfg(tmp_path / "b"))
    for name in ("train.jsonl", "val.jsonl", "eval/alpaca.jsonl", "eval/math.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()

    def broken_writer(path: Path, records: list) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(pools, "_write_jsonl", broken_writer)
    with pytest.raises(OSError, match="disk full"):
        build_pools(_cfg(tmp_path / "c"))
    assert not (tmp_path / "c").exists()
    with pytest.raises(OSError):
        build_pools(_cfg(tmp_path / "a"))  # a failed rebuild leaves the previous pools intact
    assert read_jsonl(tmp_path / "a" / "train.jsonl")


def test_a_long_source_is_not_cut_at_max_chars(tmp_path: Path, fake: None) -> None:
    cfg = _cfg(tmp_path / "p")
    assert "long_reuse" not in pools.pools_config_of(cfg)  # its settings shape no pool without it
    cfg.sources = [*cfg.sources, "long_reuse"]
    manifest = build_pools(cfg)
    train = read_jsonl(tmp_path / "p" / "train.jsonl") + read_jsonl(tmp_path / "p" / "val.jsonl")
    long = [r for r in train if r["source"] == "long_reuse"]
    assert len(long) == 1 and long[0]["domain"] == "long" and len(long[0]["messages"][0]["content"]) > cfg.max_chars
    assert manifest["skipped"]["too long"] == 1  # codeio's 7,000 characters still are
    assert manifest["config"]["long_reuse"] == {"tasks": 400, "context_chars": [0, 8000, 16000], "turns_every": 3}


def test_user_files_join_the_pool(tmp_path: Path, fake: None) -> None:
    from data_gen.config import UserFileConfig

    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"messages": [{"role": "user", "content": "Explain Rust lifetimes with an example."}]}\n'
                    '{"broken\n', encoding="utf-8")
    cfg = _cfg(tmp_path / "p")
    cfg.user_files = [UserFileConfig(path=str(mine), domain="coding", language="en")]
    manifest = build_pools(cfg)
    train = read_jsonl(tmp_path / "p" / "train.jsonl") + read_jsonl(tmp_path / "p" / "val.jsonl")
    assert [r["domain"] for r in train if r["source"] == "user:mine.jsonl"] == ["coding"]
    assert manifest["skipped"][f"user file {mine}: malformed JSON"] == 1
    assert pools.pools_config_of(tmp_path / "p") == pools.pools_config_of(cfg)  # up to date ...
    with mine.open("a", encoding="utf-8") as f:
        f.write('{"messages": [{"role": "user", "content": "And in C++?"}]}\n')
    assert pools.pools_config_of(tmp_path / "p") != pools.pools_config_of(cfg)  # ... until the file changes


def test_an_empty_user_file_is_named_in_strict_mode_and_counted_otherwise(tmp_path: Path, fake: None,
                                                                        capsys: pytest.CaptureFixture) -> None:
    from data_gen.config import UserFileConfig
    from eagle3.conversations import ConversationError

    for text in ("", "\n  \n\n"):
        blank = tmp_path / "blank.jsonl"
        blank.write_text(text, encoding="utf-8")
        cfg = _cfg(tmp_path / "s")
        cfg.user_files, cfg.strict_user_files = [UserFileConfig(path=str(blank))], True
        with pytest.raises(ConversationError, match=r"blank.jsonl: no prompts in it \(empty, or blank lines only\)"):
            build_pools(cfg)
        assert not (tmp_path / "s").exists()
        cfg = _cfg(tmp_path / "n")
        cfg.user_files = [UserFileConfig(path=str(blank))]
        assert build_pools(cfg)["skipped"][f"user file {blank}: empty (no prompts)"] == 1
        assert "no prompts in it" in capsys.readouterr().out
        shutil.rmtree(tmp_path / "n")


def test_the_pools_cli_takes_user_files(tmp_path: Path, fake: None, capsys: pytest.CaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    small = {k: v for k, v in vars(_cfg(tmp_path)).items() if k not in ("out_dir", "user_files")}

    class Small(PoolsConfig):  # the fake sources' sizes, whatever the CLI sets
        def __init__(self, **kw: object) -> None:
            super().__init__(**{**small, **kw})

    monkeypatch.setattr(pools, "PoolsConfig", Small)
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"messages": [{"role": "user", "content": "Explain Rust lifetimes with an example."}]}\n',
                    encoding="utf-8")
    assert pools.main(["--out", str(tmp_path / "p"), "--user-file", str(mine), "--user-domain", "coding"]) == 0
    train = read_jsonl(tmp_path / "p" / "train.jsonl") + read_jsonl(tmp_path / "p" / "val.jsonl")
    assert [r["domain"] for r in train if r["source"] == "user:mine.jsonl"] == ["coding"]
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    for args, reason in ((["--user-file", str(tmp_path / "none.jsonl")], "--user-file .*none.jsonl: no such file"),
                         (["--user-file", str(tmp_path / "empty.jsonl"), "--strict-user-files"],
                          "empty.jsonl: no prompts in it"),
                         (["--user-file", str(mine), "--user-domain", "cooking"], "--user-domain='cooking'")):
        try:  # a bad flag: the parser's usage and exit 2; a bad file: run_cli's one line and 2
            code = pools.main(["--out", str(tmp_path / "q"), *args])
        except SystemExit as exit_:
            code = exit_.code
        said = capsys.readouterr().err
        assert code == 2 and re.search(reason, said), said
        assert not (tmp_path / "q").exists()


def test_an_out_folder_that_is_not_a_pool_is_refused_before_any_work(tmp_path: Path, fake: None) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    (tmp_path / "data").mkdir()  # a user's data folder with a pool's file name in it
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    for folder in ("mine", "data"):
        with pytest.raises(FileExistsError, match="not an earlier output"):
            build_pools(_cfg(tmp_path / folder))
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    assert (tmp_path / "data" / "train.jsonl").read_text() == "{}\n"
    build_pools(_cfg(tmp_path / "pool"))
    build_pools(_cfg(tmp_path / "pool"))  # an earlier pool is replaced


@pytest.mark.slow
@pytest.mark.integration
def test_real_pools_meet_the_counts(tmp_path: Path) -> None:
    manifest = build_pools(PoolsConfig(out_dir=str(tmp_path / "pools")))
    counts = manifest["counts"]
    assert counts["train"] >= 5000
    for domain in ("coding", "science", "multilingual"):
        assert counts["train_by_domain"][domain] >= 1000, domain
    assert counts["eval"] == {"mtbench": 80, "humaneval": 164, "gsm8k": 150, "math": 100,
                              "multilingual": 180, "alpaca": 100, "tool_use": 100, "agent": 40}
    assert counts["train_by_domain"]["tool_use"] >= 1000 and counts["train_by_domain"]["agent"] >= 300
    assert check_no_overlap(tmp_path / "pools") == dict.fromkeys(pools.EVAL_SETS, 0)
    multilingual = read_jsonl(tmp_path / "pools" / "eval" / "multilingual.jsonl")
    assert Counter(r["language"] for r in multilingual) == dict.fromkeys(
        ("ar", "es", "fr", "ja", "ko", "pt", "th", "vi", "zh"), 20)
    mtbench = read_jsonl(tmp_path / "pools" / "eval" / "mtbench.jsonl")
    assert all(sum(m["role"] == "user" for m in r["messages"]) == 2 for r in mtbench)
    # Same bytes from another process with another hash seed: nothing depends on set order or addresses.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-m", "data_gen.pools", "--out", str(tmp_path / "again")], check=True,
                   env=env, capture_output=True)
    for name in ("train.jsonl", "val.jsonl", "eval/gsm8k.jsonl", "eval/alpaca.jsonl", "eval/multilingual.jsonl",
                 "eval/agent.jsonl"):
        assert (tmp_path / "pools" / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def test_select_balanced_takes_domains_in_turn() -> None:
    records = [{"id": f"{d}{i}", "domain": d} for d in ("coding", "science", "general") for i in range(5)]
    records += [{"id": "m0", "domain": "multilingual"}]
    got = pools.select_balanced(records, 9, ["coding", "science", "multilingual", "general"], seed=0)
    assert [r["domain"] for r in got[:4]] == ["coding", "science", "multilingual", "general"]
    assert Counter(r["domain"] for r in got) == {"coding": 3, "science": 3, "general": 2, "multilingual": 1}
    assert got == pools.select_balanced(list(reversed(records)), 9, ["coding", "science", "multilingual", "general"], 0)
    assert got != pools.select_balanced(records, 9, ["coding", "science", "multilingual", "general"], seed=1)
