"""The cached regeneration engine and its fused capture: replies equal the depth-by-depth reference,
each token is the target's argmax, the kept states make the separate harvest's store, kill -9
resumes to the same store, and states made otherwise are refused naming the key."""

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

from data_gen.config import HarvestConfig, RegenerateConfig
from data_gen.engine import Engine, common_prefix, greedy_check, pick_token
from data_gen.generate import regenerate_conversations
from data_gen.harvest import run as harvest
from data_gen.kept_states import KeptStatesError
from data_gen.regenerate import run as regenerate
from eagle3.config import SamplingConfig, TargetConfig
from eagle3.store.shards import HarvestStore, compare_stores
from eagle3.target.chat import ChatFormat
from eagle3.target.model import Target
from tests.helpers import THINK_DROPPING_TEMPLATE, lively_target, save_lively

REPO = Path(__file__).resolve().parents[1]


def _pool(n: int) -> list[list[dict[str, str]]]:
    """1-3 user turns each, a system message on every third."""
    words = "alpha beta gamma sky sea code math ça über".split()
    pool = []
    for i in range(n):
        messages = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for t in range(1 + i % 3):
            text = " ".join(words[(i + t + k) % len(words)] for k in range(2 + (i * 5 + t) % 7))
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": f"ORIGINAL {i}.{t}"}]
        pool.append(messages)
    return pool


def _write_pool(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"r{i}", "messages": m}) + "\n" for i, m in enumerate(_pool(n))))
    return path


@pytest.fixture(scope="module")
def target() -> Target:
    return lively_target()


@pytest.fixture(scope="module")
def chat(target: Target) -> ChatFormat:
    return ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_cached_turns_equal_the_depth_by_depth_reference(target: Target, chat: ChatFormat, rows: int) -> None:
    """Whatever the number of rows (a row refilled as conversations end), every reply equals the one
    generated from the whole re-rendered prompt, and the history is fed once."""
    pool = _pool(10)
    reference = regenerate_conversations(target, chat, pool, 12)
    engine = Engine(target, rows, chat.stop_ids, 12)
    cached = regenerate_conversations(target, chat, pool, 12, engine=engine)
    assert [[t.token_ids for t in c.turns] for c in cached] == [[t.token_ids for t in c.turns] for c in reference]
    assert [c.prompts for c in cached] == [c.prompts for c in reference]
    written = sum(len(c.prompts[-1]) + len(c.turns[-1].token_ids) + (c.turns[-1].stop_id is not None)
                  for c in cached)
    assert engine.stats.conversation_tokens == written
    # never more than the conversations (each one's last token is not fed), bar the replies whose text
    # tokenizes otherwise in the next prompt: the row rolls back to where they differ
    assert written - len(pool) <= engine.stats.fed_tokens <= 1.2 * written
    assert engine.stats.decode_idle_rows == 0 or rows > 1


def test_every_regenerated_token_is_the_targets_argmax(target: Target, chat: ChatFormat) -> None:
    """Greedy: each reply token is the argmax of the target's logits over its prompt and the reply so
    far (one full forward of the sequence, no cache)."""
    engine = Engine(target, 4, chat.stop_ids, 10)
    checked, equal, ties = greedy_check(target, regenerate_conversations(target, chat, _pool(6), 10, engine=engine))
    assert checked > 50 and equal + ties == checked, (checked, equal, ties)


def test_sampling_is_a_property_of_the_conversation_not_of_its_batch(target: Target, chat: ChatFormat) -> None:
    sampling = SamplingConfig(temperature=1.0, top_p=0.9, top_k=20)
    pool = _pool(5)
    runs = []
    for rows in (1, 5):
        engine = Engine(target, rows, chat.stop_ids, 8, sampling)
        runs.append([[t.token_ids for t in c.turns] for c in
                     regenerate_conversations(target, chat, pool, 8, sampling, engine=engine, seed=3)])
    assert runs[0] == runs[1]
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    draws = {pick_token(logits, SamplingConfig(temperature=1.0, top_k=2), g) for _ in range(50)}
    assert draws == {1, 2}  # top-k keeps exactly the two most likely
    assert pick_token(logits, SamplingConfig(), None) == 1
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


def _regenerate(tmp: Path, model: Path, pool: Path, out: str, **kw) -> Path:
    cfg = RegenerateConfig(pool=str(pool), out_dir=str(tmp / out), batch_size=3, max_new_tokens=10, **kw)
    regenerate(cfg, TargetConfig(name_or_path=str(model)), progress=False)
    return tmp / out / "dataset/regenerated.jsonl"


def _harvest(tmp: Path, model: Path, data: Path, out: str, **kw) -> dict:
    cfg = HarvestConfig(data=str(data), out_dir=str(tmp / out), batch_size=2, **kw)
    return harvest(cfg, TargetConfig(name_or_path=str(model)), progress=False)


@pytest.mark.parametrize("template", [None, THINK_DROPPING_TEMPLATE])
def test_the_fused_store_equals_a_separate_harvest(tmp_path: Path, template: str | None) -> None:
    """Ids and masks exactly, states within round-off; with a template that rewrites earlier replies
    (one sample per reply, the row rolled back between turns) too."""
    model = save_lively(tmp_path / "model")
    if template is not None:
        config = json.loads((model / "tokenizer_config.json").read_text())
        (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    pool = _write_pool(tmp_path / "pool.jsonl", 8)
    threads = torch.get_num_threads()
    try:
        data = _regenerate(tmp_path, model, pool, "regen", capture=True, capture_dtype="float32")
        fused = _harvest(tmp_path, model, data, "fused", fused="on", dtype="float32")
        separate = _harvest(tmp_path, model, data, "separate", fused="off", dtype="float32")
    finally:
        torch.set_num_threads(threads)
    assert fused["kept_states_read"] == fused["samples"] and fused["kept_states_missing"] == 0
    assert "kept_states_read" not in separate
    errors = compare_stores(tmp_path / "separate", tmp_path / "fused")  # raises if ids or masks differ
    assert max(errors.values()) < 1e-4, errors
    assert len(HarvestStore(tmp_path / "fused").lengths) == fused["samples"]
    if template is not None:
        assert any("-t1" in s.id for s in HarvestStore(tmp_path / "fused"))  # per reply: the rolled-back path


def test_states_made_otherwise_are_named_or_recomputed(tmp_path: Path, capsys) -> None:
    model = save_lively(tmp_path / "model")
    pool = _write_pool(tmp_path / "pool.jsonl", 4)
    threads = torch.get_num_threads()
    try:
        data = _regenerate(tmp_path, model, pool, "regen", capture=True)  # bfloat16 states
        with pytest.raises(KeptStatesError, match=r"harvest\.dtype: 'float32' here.*'bfloat16'"):
            _harvest(tmp_path, model, data, "h32", fused="on", dtype="float32")
        assert not list((tmp_path / "h32").glob("shard-*"))  # nothing half-written
        auto = _harvest(tmp_path, model, data, "auto32", dtype="float32")  # auto: said, then the target runs
        assert "kept_states_read" not in auto and "not reading the states kept" in capsys.readouterr().err
        other = save_lively(tmp_path / "other", seed=5)
        with pytest.raises(KeptStatesError, match=r"target\.name_or_path"):
            _harvest(tmp_path, other, data, "other", fused="on")
        plain = _regenerate(tmp_path, model, pool, "plain")
        with pytest.raises(KeptStatesError, match="without regenerate.capture"):
            _harvest(tmp_path, model, plain, "plain-h", fused="on")
        bf16 = _harvest(tmp_path, model, data, "bf16", fused="on")
        assert bf16["kept_states_read"] == bf16["samples"]
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="capture_dtype"):
        RegenerateConfig(pool="p", out_dir="o", capture=True, capture_dtype="float16")


@pytest.mark.slow
def test_kill_9_with_capture_then_rerun_gives_the_same_store(tmp_path: Path) -> None:
    model = save_lively(tmp_path / "model")
    pool = _write_pool(tmp_path / "pool.jsonl", 30)
    batches = 15
    cli = [sys.executable, "-m", "data_gen.regenerate", "--target", str(model), "--pool", str(pool), "--batch-size",
           "2", "--max-new-tokens", "40", "--threads", "1", "--no-progress", "--capture"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for name in ("killed", "straight"):
        out = tmp_path / name
        proc = subprocess.Popen([*cli, "--out", str(out)], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        if name == "killed":
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                if len(list((out / "parts").glob("part-*.jsonl"))) >= 3:
                    break
                time.sleep(0.02)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            done = len(list((out / "parts").glob("part-*.jsonl")))
            assert 3 <= done < batches, f"not killed mid-way (exit {proc.returncode})"
            rerun = subprocess.run([*cli, "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True)
            assert rerun.returncode == 0, rerun.stderr
        else:
            assert proc.wait() == 0
        data = out / "dataset/regenerated.jsonl"
        runs[name] = _harvest(tmp_path, model, data, f"{name}-harvest", fused="on")
        assert not list(out.rglob("*.tmp"))
    assert (tmp_path / "killed/dataset/regenerated.jsonl").read_bytes() == \
        (tmp_path / "straight/dataset/regenerated.jsonl").read_bytes()
    for name in ("killed", "straight"):
        assert runs[name]["kept_states_missing"] == 0
    for shard in sorted((tmp_path / "straight-harvest").glob("shard-*.safetensors")):
        assert (tmp_path / "killed-harvest" / shard.name).read_bytes() == shard.read_bytes()


@pytest.mark.integration
def test_the_default_target_regenerates_its_own_argmax() -> None:
    """On the embedded target, multi-turn conversations of the quickstart's kinds (code, maths, another
    language, a tool result): every regenerated token is the target's argmax, ties named."""
    from eagle3.config import DEFAULT_TARGET
    from eagle3.target.model import load_target

    target = load_target(DEFAULT_TARGET, dtype="float32", device="cpu")
    chat = ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)
    user, assistant = "user", "assistant"
    conversations = [
        [{"role": user, "content": "Write a Python function that checks whether a string is a palindrome."},
         {"role": assistant, "content": "x"}, {"role": user, "content": "Now make it ignore punctuation."}],
        [{"role": "system", "content": "You are a careful maths tutor."},
         {"role": user, "content": "A train travels 180 km in 2.5 hours. What is its average speed?"}],
        [{"role": user, "content": "Erkläre kurz, was Photosynthese ist."}, {"role": assistant, "content": "x"},
         {"role": user, "content": "Und warum sind Blätter grün?"}],
        [{"role": user, "content": "What is the weather in Paris?"}, {"role": assistant, "content": "x"},
         {"role": "tool", "name": "weather", "tool_call_id": "c1", "content": '{"temp_c": 14, "sky": "rain"}'}],
    ]
    engine = Engine(target, 3, chat.stop_ids, 40)
    regenerated = regenerate_conversations(target, chat, conversations, 40, engine=engine)
    checked, equal, ties = greedy_check(target, regenerated)
    assert checked > 200 and equal + ties == checked, (checked, equal, ties)
    assert engine.stats.fed_tokens <= 1.2 * engine.stats.conversation_tokens
