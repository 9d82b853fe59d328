"""Regeneration: multi-turn ordering, prompt limits, resumable stage, kill -9, config pinning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import data_gen.generate as generation
from data_gen.config import RegenerateConfig
from data_gen.generate import generate, regenerate_conversations
from data_gen.regenerate import ManifestMismatchError, RegenerateError, main, part_path, run
from eagle3.config import TargetConfig
from eagle3.target.chat import ChatFormat
from eagle3.target.model import Target
from eagle3.target.source import TargetSourceError
from tests.helpers import SWITCHED_TEMPLATES, THINK_DROPPING_TEMPLATE, lively_target, save_lively

REPO = Path(__file__).resolve().parents[1]


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def _record(i: int, messages: list[dict[str, str]]) -> dict:
    return {"id": f"r{i}", "domain": "general", "source": "test", "language": "en", "messages": messages}


def _write_pool(path: Path, conversations: list[list[dict[str, str]]]) -> Path:
    path.write_text("".join(json.dumps(_record(i, m)) + "\n" for i, m in enumerate(conversations)))
    return path


def _varied_pool(n: int) -> list[list[dict[str, str]]]:
    """1-3 user turns, a system message on every 4th, a trailing original assistant turn on odd ones."""
    words = "alpha beta gamma sky sea code math ça über".split()
    pool = []
    for i in range(n):
        messages = [{"role": "system", "content": "Be brief."}] if i % 4 == 0 else []
        for t in range(1 + i % 3):
            messages += [_user(" ".join(words[(i + t + k) % len(words)] for k in range(2 + (i * 7 + t) % 9))),
                         _assistant(f"ORIGINAL {i}.{t}")]
        pool.append(messages if i % 2 else messages[:-1])
    return pool


@pytest.fixture(scope="module")
def target() -> Target:
    return lively_target()


@pytest.fixture(scope="module")
def chat(target: Target) -> ChatFormat:
    return ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)


def test_turn_two_is_prompted_with_the_regenerated_turn_one(target: Target, chat: ChatFormat, monkeypatch) -> None:
    calls: list[list[list[int]]] = []

    def spy(target, prompts, stop_ids, max_new_tokens, sampling, *, seed):
        calls.append([list(p) for p in prompts])
        return generate(target, prompts, stop_ids, max_new_tokens, sampling, seed=seed)

    monkeypatch.setattr(generation, "generate", spy)
    system = {"role": "system", "content": "Be brief."}
    two_turns = [system, _user("Hi there"), _assistant("ORIGINAL ONE"), _user("And then?"), _assistant("ORIGINAL TWO")]
    one_turn = [_user("Only once")]
    [a, b] = regenerate_conversations(target, chat, [two_turns, one_turn], 8)

    assert len(calls) == 2  # depth 1: both conversations in one batch; depth 2: only the first
    assert calls[0] == [chat.prompt_ids(two_turns[:2]), chat.prompt_ids(one_turn)]
    reply1 = a.messages[2]["content"]
    assert calls[1] == [chat.prompt_ids([system, _user("Hi there"), _assistant(reply1), _user("And then?")])]
    assert "ORIGINAL" not in target.tokenizer.decode(calls[1][0])
    assert [m["role"] for m in a.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert all("ORIGINAL" not in m["content"] for m in a.messages)
    assert [m["role"] for m in b.messages] == ["user", "assistant"] and len(b.turns) == 1
    # Turn 1 is what the target says to [system, user1] alone.
    alone = generate(target, [chat.prompt_ids(two_turns[:2])], chat.stop_ids, 8)[0]
    assert a.turns[0] == alone
    assert reply1 == target.tokenizer.decode(alone.token_ids)


def test_over_long_prompts_are_skipped_or_truncated_and_counted(target: Target, tmp_path: Path) -> None:
    # Tiny byte tokenizer: a one-turn prompt is "<|user|>" + bytes + "</s><|assistant|>" = len(text) + 3 tokens.
    pool = _write_pool(tmp_path / "pool.jsonl", [
        [_user("x" * 30)],                                  # 33 tokens > 20: skipped
        [_user("hi"), _assistant("a"), _user("y" * 40)],    # turn 1 fits (5), turn 2 does not: truncated
        [_user("ok")],                                      # fits
        [_user("z" * 17)],                                  # exactly 20 tokens: fits
    ])
    cfg = RegenerateConfig(pool=str(pool), out_dir=str(tmp_path / "out"), batch_size=3, max_new_tokens=4,
                           max_prompt_tokens=20)
    summary = run(cfg, TargetConfig(name_or_path="lively"), progress=False, target=target)
    assert {k: summary[k] for k in ("records", "skipped_records", "truncated_records", "dropped_turns", "turns")} == {
        "records": 3, "skipped_records": 1, "truncated_records": 1, "dropped_turns": 2, "turns": 3}
    rows = [json.loads(line) for line in (tmp_path / "out/dataset/regenerated.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["r1", "r2", "r3"]
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant"]  # ends before the long turn
    assert rows[0]["generation"]["dropped_turns"] == 1 and rows[1]["generation"]["dropped_turns"] == 0
    skipped = json.loads(part_path(tmp_path / "out", 0).read_text().splitlines()[0])
    assert skipped["id"] == "r0" and skipped["generation"]["turns"] == []  # kept in its part, left out of the store


def test_output_records_keep_input_fields_and_describe_each_turn(target: Target, tmp_path: Path) -> None:
    pool = _write_pool(tmp_path / "pool.jsonl", _varied_pool(5))
    cfg = RegenerateConfig(pool=str(pool), out_dir=str(tmp_path / "out"), batch_size=2, max_new_tokens=6)
    summary = run(cfg, TargetConfig(name_or_path="lively"), progress=False, target=target)
    rows = [json.loads(line) for line in (tmp_path / "out/dataset/regenerated.jsonl").read_text().splitlines()]
    assert summary["batches"] == 3 and summary["records"] == 5
    first = rows[0]
    assert {k: first[k] for k in ("id", "domain", "source", "language")} == {
        "id": "r0", "domain": "general", "source": "test", "language": "en"}
    gen = first["generation"]
    assert {k: gen[k] for k in ("target", "max_new_tokens", "temperature", "seed")} == {
        "target": "lively", "max_new_tokens": 6, "temperature": 0.0, "seed": 0}
    for row in rows:
        turns = row["generation"]["turns"]
        assert len(turns) == sum(m["role"] == "assistant" for m in row["messages"])
        for turn in turns:
            assert turn["finish_reason"] in ("stop", "length")
            assert turn["new_tokens"] == 6 if turn["finish_reason"] == "length" else turn["new_tokens"] < 6
    assert summary["new_tokens"] == sum(t["new_tokens"] for r in rows for t in r["generation"]["turns"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rerun_only_regenerates_missing_batches(target: Target, tmp_path: Path, temperature: float) -> None:
    pool = _write_pool(tmp_path / "pool.jsonl", _varied_pool(7))
    out = tmp_path / "out"
    cfg = RegenerateConfig(pool=str(pool), out_dir=str(out), limit=6, batch_size=2, max_new_tokens=6,
                           temperature=temperature)
    first = run(cfg, TargetConfig(name_or_path="lively"), progress=False, target=target)
    assert (first["pool_records"], first["batches"], first["batches_run"]) == (6, 3, 3)
    store = (out / "dataset/regenerated.jsonl").read_bytes()
    part_path(out, 1).unlink()
    again = run(cfg, TargetConfig(name_or_path="lively"), progress=False, target=target)
    assert again["batches_run"] == 1
    assert (out / "dataset/regenerated.jsonl").read_bytes() == store
    cut = part_path(out, 0)  # parts changed by hand (a record gone, a record garbled) are generated again
    cut.write_text(cut.read_text().splitlines(keepends=True)[0])
    garbled = part_path(out, 2)
    garbled.write_text(garbled.read_text()[:-5] + "\n")
    assert run(cfg, TargetConfig(name_or_path="lively"), progress=False, target=target)["batches_run"] == 2
    assert (out / "dataset/regenerated.jsonl").read_bytes() == store
    manifest = json.loads((out / "manifest.json").read_text())
    for legacy, resumes in ((False, True), (True, False)):  # earlier versions pinned per_turn_samples
        (out / "manifest.json").write_text(json.dumps({**manifest, "settings": {**manifest["settings"],
                                                                                "per_turn_samples": legacy}}))
        if resumes:
            assert run(cfg, TargetConfig(name_or_path="lively"), progress=False, target=target)["batches_run"] == 0
        else:
            with pytest.raises(RegenerateError, match="split records per reply"):
                run(cfg, TargetConfig(name_or_path="lively"), progress=False, target=target)
    (out / "manifest.json").write_text("{")
    with pytest.raises(RegenerateError, match="manifest.json: not valid JSON"):
        run(cfg, TargetConfig(name_or_path="lively"), progress=False, target=target)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(RegenerateError, match="empty.jsonl: no records"):
        run(RegenerateConfig(pool=str(empty), out_dir=str(tmp_path / "e")), TargetConfig(name_or_path="lively"),
            progress=False, target=target)
    with pytest.raises(TargetSourceError, match="missing-target"):  # fails after creating out_dir: removed again
        run(RegenerateConfig(pool=str(pool), out_dir=str(tmp_path / "m")),
            TargetConfig(name_or_path=str(tmp_path / "missing-target")), progress=False)
    assert not (tmp_path / "m").exists()


def test_rerun_with_other_settings_fails_naming_the_key(target: Target, tmp_path: Path, capsys) -> None:
    pool = _write_pool(tmp_path / "pool.jsonl", _varied_pool(3))
    out = tmp_path / "out"
    cfg = RegenerateConfig(pool=str(pool), out_dir=str(out), batch_size=2, max_new_tokens=6)
    run(cfg, TargetConfig(name_or_path="lively"), progress=False, target=target)
    manifest = (out / "manifest.json").read_bytes()
    for key, value in [("max_new_tokens", 7), ("temperature", 0.5), ("seed", 1), ("batch_size", 3)]:
        changed = RegenerateConfig(**{**cfg.__dict__, key: value})
        with pytest.raises(ManifestMismatchError, match=f"{key}="):
            run(changed, TargetConfig(name_or_path="lively"), progress=False, target=target)
    with pytest.raises(ManifestMismatchError, match="target='lively'"):
        run(cfg, TargetConfig(name_or_path="other"), progress=False, target=target)
    pool.write_text(pool.read_text().replace("alpha", "omega"))
    with pytest.raises(ManifestMismatchError, match="pool_sha256="):
        run(cfg, TargetConfig(name_or_path="lively"), progress=False, target=target)
    # The CLI reports it before loading anything (there is no model named "lively" to load).
    code = main(["--target", "lively", "--pool", str(pool), "--out", str(out), "--no-progress"])
    assert code == 2 and "pool_sha256=" in capsys.readouterr().err
    assert (out / "manifest.json").read_bytes() == manifest


@pytest.mark.slow
def test_kill_9_then_rerun_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    model = save_lively(tmp_path / "model")
    pool = _write_pool(tmp_path / "pool.jsonl", _varied_pool(36))
    batches = 18
    common = ["--target", str(model), "--pool", str(pool), "--batch-size", "2", "--max-new-tokens", "40",
              "--threads", "1", "--no-progress"]
    cli = [sys.executable, "-m", "data_gen.regenerate", *common]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = tmp_path / "killed"
    proc = subprocess.Popen([*cli, "--out", str(killed)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list((killed / "parts").glob("part-*.jsonl"))) >= 3:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list((killed / "parts").glob("part-*.jsonl")))
    assert 3 <= done < batches and not (killed / "dataset").exists(), f"not killed mid-way (exit {proc.returncode})"

    rerun = subprocess.run([*cli, "--out", str(killed)], cwd=REPO, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads(rerun.stdout)["batches_run"] == batches - done

    straight = tmp_path / "straight"  # uninterrupted, in this process
    cfg = RegenerateConfig(pool=str(pool), out_dir=str(straight), batch_size=2, max_new_tokens=40, threads=1)
    threads = torch.get_num_threads()
    try:
        summary = run(cfg, TargetConfig(name_or_path=str(model)), progress=False)
    finally:
        torch.set_num_threads(threads)
    assert summary["batches_run"] == batches and summary["records"] == 36
    store = "dataset/regenerated.jsonl"
    assert (killed / store).read_bytes() == (straight / store).read_bytes()
    assert not list(killed.rglob("*.tmp"))


def test_workers_write_what_one_process_writes(tmp_path: Path) -> None:
    """regenerate.workers=3 (two spawned processes beside this one, each its own target) writes the
    dataset one process writes, byte for byte, sampling included; a rerun finds every batch done."""
    model = save_lively(tmp_path / "model")
    pool = _write_pool(tmp_path / "pool.jsonl", _varied_pool(10))
    threads = torch.get_num_threads()
    outs, tokens = {}, {}
    try:
        for workers in (1, 3):
            cfg = RegenerateConfig(pool=str(pool), out_dir=str(tmp_path / f"w{workers}"), batch_size=2,
                                   max_new_tokens=12, temperature=0.8, threads=1, workers=workers)
            summary = run(cfg, TargetConfig(name_or_path=str(model)), progress=False)
            assert summary["batches_run"] == 5 and summary["records"] == 10 and summary["workers"] == workers
            tokens[workers] = summary["generated_tokens_this_run"]
            outs[workers] = (tmp_path / f"w{workers}" / "dataset" / "regenerated.jsonl").read_bytes()
        again = run(cfg, TargetConfig(name_or_path=str(model)), progress=False)
    finally:
        torch.set_num_threads(threads)
    assert outs[3] == outs[1] and outs[1].count(b"\n") == 10
    assert tokens[3] == tokens[1] > 0  # the workers' tokens counted too
    assert again["batches_run"] == 0


def test_workers_are_at_least_one() -> None:
    with pytest.raises(ValueError, match=r"regenerate.workers=0: must be >= 1"):
        RegenerateConfig(workers=0)


@pytest.mark.integration
def test_default_target_regeneration_equals_hf_greedy() -> None:
    from eagle3.config import DEFAULT_TARGET
    from eagle3.target.model import load_target

    target = load_target(DEFAULT_TARGET, dtype="float32", device="cpu")
    chat = ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)
    conversations = [[_user("What is the capital of France?")],
                     [_user("Write a Python function that reverses a string.")]]
    results = regenerate_conversations(target, chat, conversations, 16)
    for conv, result in zip(conversations, results, strict=True):
        ids = torch.tensor([chat.prompt_ids(conv)])
        hf = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                   eos_token_id=sorted(chat.stop_ids), pad_token_id=target.tokenizer.pad_token_id)
        want = hf[0, ids.shape[1]:].tolist()
        want = want[:next((i for i, t in enumerate(want) if t in chat.stop_ids), len(want))]
        assert result.turns[0].token_ids == want
        assert result.messages[-1]["content"].strip()




def test_records_stay_whole_and_the_harvest_splits_those_the_template_rewrites(tmp_path: Path) -> None:
    from collections import Counter

    from data_gen.harvest import tokenize_records

    thinking = lively_target(chat_template=THINK_DROPPING_TEMPLATE)
    pool = _write_pool(tmp_path / "pool.jsonl", [[_user("a"), _assistant("x"), _user("b")], [_user("solo")]])
    cfg = RegenerateConfig(pool=str(pool), out_dir=str(tmp_path / "out"), batch_size=2, max_new_tokens=5)
    summary = run(cfg, TargetConfig(name_or_path="thinking"), progress=False, target=thinking)
    rows = [json.loads(line) for line in (tmp_path / "out/dataset/regenerated.jsonl").read_text().splitlines()]
    assert summary["records"] == 2 and [r["id"] for r in rows] == ["r0", "r1"]
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert len(rows[0]["generation"]["turns"]) == 2
    chat = ChatFormat.for_tokenizer(thinking.tokenizer)
    # the decision is the harvest's, per record: replies without reasoning render as they were seen ...
    tok = thinking.tokenizer
    messages = [dict(m) for m in rows[0]["messages"]]
    messages[1]["content"], messages[3]["content"] = "ok", "fine"  # text that tokenizes to the ids written
    turns = [{**t, "token_ids": tok("ok" if k == 0 else "fine", add_special_tokens=False)["input_ids"]}
             for k, t in enumerate(rows[0]["generation"]["turns"])]
    plain = {**rows[0], "messages": messages, "generation": {**rows[0]["generation"], "turns": turns}}
    assert [name for name, _, _ in tokenize_records([plain], chat, 4096, Counter())] == ["r0"]
    # ... unless a reply's ids are not what its text tokenizes to (a multi-byte character cut at
    # max_new_tokens decodes to U+FFFD) or a reply is empty (only its stop was written): then the
    # conversation is harvested one reply at a time, from the ids the target wrote
    cut = tok("ok \U0001F600", add_special_tokens=False)["input_ids"][:-1]
    broken = {**plain, "messages": [*messages[:1], {**messages[1], "content": tok.decode(cut)}, *messages[2:]],
              "generation": {**plain["generation"], "turns": [{**turns[0], "token_ids": cut}, turns[1]]}}
    samples = tokenize_records([broken], chat, 4096, Counter())
    assert [name for name, _, _ in samples] == ["r0-t0", "r0-t1"]
    ids, mask = samples[0][1], samples[0][2]
    assert [i for i, m in zip(ids, mask, strict=True) if m][: len(cut)] == cut  # the bytes it wrote, not U+FFFD's
    empty = {**plain, "messages": [*messages[:1], {**messages[1], "content": ""}, *messages[2:]],
             "generation": {**plain["generation"], "turns": [{**turns[0], "token_ids": [], "finish_reason": "stop",
                                                               "stop_id": tok.eos_token_id}, turns[1]]}}
    samples = tokenize_records([empty], chat, 4096, Counter())
    assert [name for name, _, _ in samples] == ["r0-t0", "r0-t1"]
    assert [i for i, m in zip(samples[0][1], samples[0][2], strict=True) if m] == [tok.eos_token_id]  # its stop
    # ... and a first reply with reasoning is rewritten once a later one follows: one sample per reply
    messages = [dict(m) for m in rows[0]["messages"]]
    messages[1]["content"] = "<think>q</think>" + messages[1]["content"]
    reasoned = {**rows[0], "messages": messages}
    samples = tokenize_records([reasoned], chat, 4096, Counter())
    assert [name for name, _, _ in samples] == ["r0-t0", "r0-t1"]
    ids, mask = samples[1][1], samples[1][2]
    assert "<think>" not in thinking.tokenizer.decode(ids)  # turn 2 in the context the target saw: no old reasoning
    assert sum(mask) > 0 and not any(mask[: len(chat.prompt_ids(reasoned["messages"][:3]))])


@pytest.mark.parametrize("mode", ["on", "off", "mix"])
def test_each_reply_is_trained_after_the_prompt_its_thinking_mode_served(tmp_path: Path, mode: str) -> None:
    """regenerate.thinking renders every prompt with the template's switch, keeps the mode per record,
    and the harvest trains each reply after exactly the prompt the serving template renders in that
    mode (with thinking off: the empty thinking block the template writes into the generation
    prompt, which a whole-conversation render does not show, so such records are split per reply)."""
    from collections import Counter

    from data_gen.harvest import tokenize_records

    switched = lively_target(chat_template=SWITCHED_TEMPLATES["enable_thinking"])
    pool = _write_pool(tmp_path / "pool.jsonl", [[_user(f"q{i}"), _assistant("x"), _user(f"r{i}")] for i in range(8)])
    cfg = RegenerateConfig(pool=str(pool), out_dir=str(tmp_path / "out"), batch_size=3, max_new_tokens=5,
                           thinking=mode)
    run(cfg, TargetConfig(name_or_path="switched"), progress=False, target=switched)
    rows = [json.loads(line) for line in (tmp_path / "out/dataset/regenerated.jsonl").read_text().splitlines()]
    modes = [row["generation"]["thinking"] for row in rows]
    assert modes == ([mode == "on"] * 8 if mode != "mix" else modes) and (mode != "mix" or len(set(modes)) == 2)
    chat = ChatFormat.for_tokenizer(switched.tokenizer)
    for row in rows:
        served = chat.with_thinking(row["generation"]["thinking"])
        samples = tokenize_records([row], chat, 4096, Counter())
        ends = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
        for k, end in enumerate(ends):
            prompt = served.prompt_ids(row["messages"][:end])
            reply = row["generation"]["turns"][k]["token_ids"]
            assert ("<think>" in switched.tokenizer.decode(prompt)) == (not row["generation"]["thinking"])
            assert any(ids[:len(prompt)] == prompt and ids[len(prompt):len(prompt) + len(reply)] == reply
                       and all(mask[len(prompt):len(prompt) + len(reply)]) for _, ids, mask in samples), (row["id"], k)
    if mode == "off":
        assert all(len(tokenize_records([row], chat, 4096, Counter())) == 2 for row in rows)
    # a template without a switch: refused by name, nothing written
    plain_pool = RegenerateConfig(pool=str(pool), out_dir=str(tmp_path / "plain"), max_new_tokens=5, thinking=mode)
    with pytest.raises(RegenerateError, match=rf"regenerate.thinking={mode}: the chat template .* reads no thinking "
                                              "switch"):
        run(plain_pool, TargetConfig(name_or_path="lively"), progress=False, target=lively_target())
    assert not (tmp_path / "plain").exists()


def test_pool_rows_are_validated_with_file_and_line(target: Target, tmp_path: Path) -> None:
    from data_gen.regenerate import read_pool

    pool = tmp_path / "mine.jsonl"
    pool.write_bytes(b'\xef\xbb\xbf{"conversations": [{"from": "human", "value": "hi"}]}\r\n'
                     b'{"messages": [{"role": "user", "content": "fine"}], "id": "keep"}\n')
    rows = read_pool(pool)
    assert rows[0]["messages"] == [{"role": "user", "content": "hi"}] and "conversations" not in rows[0]
    assert len(rows[0]["id"]) == 16 and rows[1]["id"] == "keep"
    for bad, reason in [(b'{"messages": [{"role": "robot", "content": "x"}]}', "unknown role 'robot'"),
                        (b'{"messages": [{"role": "assistant", "content": "x"}]}', "starts with assistant"),
                        (b'{"messages": [', "malformed JSON"), (b'\xff\xfe', "not UTF-8")]:
        pool.write_bytes(b'{"messages": [{"role": "user", "content": "ok"}]}\n' + bad + b"\n")
        with pytest.raises(ValueError, match=f"mine.jsonl:2: .*{reason}"):
            read_pool(pool)
    out = tmp_path / "out"
    code = main(["--pool", str(pool), "--out", str(out), "--target", str(tmp_path / "no-such-model")])
    assert code == 2 and not (out / "dataset").exists()


def test_duplicate_ids_and_a_wrong_pool_path_are_refused_before_any_generation(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The harvest refuses two records with one id, after the generation's time is spent: the
    pool's validation names both lines first. A folder or a missing path is named, not an errno."""
    from data_gen.regenerate import read_pool

    pool = tmp_path / "dup.jsonl"
    row = '{"messages": [{"role": "user", "content": "same question"}]}\n'
    pool.write_text(row * 5, encoding="utf-8")
    with pytest.raises(ValueError, match=r"dup.jsonl:2: record id '\w+' is also the id of .*dup.jsonl:1 \(ids "
                                         r"derived from the content: the same conversation twice\)"):
        read_pool(pool)
    pool.write_text('{"id": "a", "messages": [{"role": "user", "content": "x"}]}\n'
                    '{"id": "b", "messages": [{"role": "user", "content": "y"}]}\n'
                    '{"id": "a", "messages": [{"role": "user", "content": "z"}]}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"dup.jsonl:3: record id 'a' is also the id of .*dup.jsonl:1$"):
        read_pool(pool)
    out = tmp_path / "out"
    for where, reason in ((tmp_path, "a folder; expected a jsonl file"), (tmp_path / "nope.jsonl", "no such file")):
        capsys.readouterr()
        assert main(["--pool", str(where), "--out", str(out), "--target", "lively"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and reason in err[0] and "Errno" not in err[0], err
    assert main(["--pool", str(pool), "--out", str(out), "--target", "lively"]) == 2  # before loading any target
    assert "record id 'a'" in capsys.readouterr().err and not out.exists()


def test_the_vllm_backend_without_vllm_is_one_line_saying_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from data_gen.vllm_generate import require_vllm
    from eagle3.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match=r"regenerate.backend=vllm: vLLM is not installed .*setup_vllm_env.sh.*"
                                          r"regenerate.backend=hf"):
        require_vllm("regenerate.backend")
