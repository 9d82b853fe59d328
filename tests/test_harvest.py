"""The harvester on tiny random models: the harvester -> trainer contract, resume, bad input."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from data_gen import harvest
from data_gen.config import HarvestConfig
from data_gen.harvest import HarvestError, run
from eagle3.config import TargetConfig
from eagle3.store.shards import HarvestStore, StoreError, verify_store
from eagle3.target.chat import ChatFormat
from eagle3.target.model import Target
from tests.helpers import (
    SYSTEM_IN_LAST_USER,
    THINK_DROPPING_TEMPLATE,
    conversation,
    lively_target,
    regenerated_data,
    save_lively,
    tiny_tokenizer,
)

REPO = Path(__file__).resolve().parents[1]






def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max relative error: max |a - b| / max |b| (fp32)."""
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def target() -> Target:
    return lively_target()


def test_loss_mask_is_exactly_the_assistant_tokens(target: Target) -> None:
    chat = ChatFormat.for_tokenizer(target.tokenizer)
    tok = target.tokenizer
    ids, mask = chat.tokenize_conversation([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    # <|user|> h i </s> <|assistant|> y o </s>: the reply and its end-of-turn token
    assert tok.convert_ids_to_tokens(ids) == ["<|user|>", "h", "i", "</s>", "<|assistant|>", "y", "o", "</s>"]
    assert mask == [0, 0, 0, 0, 0, 1, 1, 1]
    multi = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
             {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
             {"role": "assistant", "content": "dd"}]
    ids, mask = chat.tokenize_conversation(multi)
    pieces = tok.convert_ids_to_tokens(ids)
    assert [p for p, m in zip(pieces, mask, strict=True) if m] == ["b", "</s>", "d", "d", "</s>"]
    assert pieces.count("</s>") == 5  # the system and user turns' ends stay unmasked


def test_store_holds_the_targets_own_states(target: Target, tmp_path: Path) -> None:
    data = regenerated_data(tmp_path / "data.jsonl", 6, turns=2)
    cfg = HarvestConfig(data=str(data), out_dir=str(tmp_path / "h"), dtype="float32", batch_size=4)
    summary = run(cfg, TargetConfig(name_or_path="lively"), target=target, progress=False)
    assert summary["complete"] and summary["samples"] == 6
    store = HarvestStore(tmp_path / "h")
    assert store.spec.aux_layer_ids == (2, 4, 5) and store.spec.hidden_size == 64
    store.check_target(target)
    with pytest.raises(StoreError, match=r"manifest.json: harvested with num_layers=8, but the target has 9"):
        store.check_target(lively_target(num_layers=9))
    seen: list[torch.Tensor] = []
    hook = target.norm.register_forward_hook(lambda m, a, o: seen.append(a[0]))
    for sample in store:
        ids = sample.input_ids[None]
        seen.clear()
        with torch.no_grad():
            ref = target.model(ids, output_hidden_states=True)
        for k, i in enumerate((2, 4, 5)):
            assert _rel(sample.aux[:, k], ref.hidden_states[i][0]) < 1e-5
        assert _rel(sample.last, seen[0][0]) < 1e-5  # the pre-norm last state
    hook.remove()


def test_batch_of_eight_equals_batch_of_one(target: Target, tmp_path: Path) -> None:
    data = regenerated_data(tmp_path / "data.jsonl", 8, turns=3)
    stores = []
    for batch in (1, 8):
        cfg = HarvestConfig(data=str(data), out_dir=str(tmp_path / f"b{batch}"), dtype="float32", batch_size=batch)
        run(cfg, TargetConfig(name_or_path="lively"), target=target, progress=False)
        stores.append(HarvestStore(tmp_path / f"b{batch}"))
    assert len(set(stores[1].lengths)) > 3  # real padding in the batch of 8
    for one, eight in zip(*stores, strict=True):
        assert torch.equal(one.input_ids, eight.input_ids) and torch.equal(one.loss_mask, eight.loss_mask)
        assert _rel(eight.aux, one.aux) < 1e-5 and _rel(eight.last, one.last) < 1e-5


def test_workers_split_shards_and_the_last_one_writes_the_manifest(target: Target, tmp_path: Path) -> None:
    data = regenerated_data(tmp_path / "data.jsonl", 12)
    common = dict(data=str(data), max_shard_mb=0.05, batch_size=2)
    whole = HarvestConfig(out_dir=str(tmp_path / "whole"), **common)
    run(whole, TargetConfig(name_or_path="lively"), target=target, progress=False)
    for worker in ("1/2", "0/2"):
        cfg = HarvestConfig(out_dir=str(tmp_path / "split"), shard=worker, **common)
        summary = run(cfg, TargetConfig(name_or_path="lively"), target=target, progress=False)
        assert summary["complete"] == (worker == "0/2")
    for name in sorted(p.name for p in (tmp_path / "whole").iterdir() if p.suffix in (".safetensors", ".json")):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "split" / name).read_bytes(), name


def test_a_local_target_typed_two_ways_resumes(target: Target, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    save_lively(tmp_path / "model")
    cfg = HarvestConfig(data=str(regenerated_data(tmp_path / "data.jsonl", 3)), out_dir=str(tmp_path / "h"))
    first = run(cfg, TargetConfig(name_or_path="model"), target=target, progress=False)
    assert HarvestStore(tmp_path / "h").spec.target == str(tmp_path / "model")
    plan = tmp_path / "h" / "plan.json"  # as an earlier version wrote it: the path as typed
    plan.write_text(plan.read_text().replace(json.dumps(str(tmp_path / "model")), '"model"'))
    assert json.loads(plan.read_text())["spec"]["target"] == "model"
    again = run(cfg, TargetConfig(name_or_path=str(tmp_path / "model")), target=target, progress=False)
    assert again["samples"] == first["samples"] == 3


def test_bad_input_is_counted_or_named(target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "data.jsonl"
    rows = [{"id": "long", "messages": [{"role": "user", "content": "q" * 50}, {"role": "assistant", "content": "a"}]},
            {"id": "no-reply", "messages": [{"role": "user", "content": "only a question"}]},
            {"id": "fine", "messages": conversation(1)}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = HarvestConfig(data=str(data), out_dir=str(tmp_path / "h"), max_seq_len=40)
    summary = run(cfg, TargetConfig(name_or_path="lively"), target=target, progress=False)
    # "long" loses its reply to truncation and is then skipped too: its loss mask is empty.
    assert (summary["truncated"], summary["skipped_empty_loss_mask"], summary["samples"]) == (1, 2, 1)

    twice = tmp_path / "twice.jsonl"  # samples are looked up by id: two records with one id are refused
    twice.write_text("".join(json.dumps({**rows[2], "messages": conversation(k)}) + "\n" for k in (1, 2)))
    with pytest.raises(HarvestError, match=r"twice.jsonl:2: record id 'fine' is also the id of .*twice.jsonl:1$"):
        run(HarvestConfig(data=str(twice), out_dir=str(tmp_path / "t")), TargetConfig(name_or_path="lively"),
            target=target, progress=False)
    long = tmp_path / "long.jsonl"  # the target attends over 256 positions: a longer sample is cut there
    long.write_text(json.dumps({"id": "long", "messages": [{"role": "user", "content": "q"},
                                                           {"role": "assistant", "content": "a" * 400}]}) + "\n")
    clamped = run(HarvestConfig(data=str(long), out_dir=str(tmp_path / "c")), TargetConfig(name_or_path="lively"),
                  target=target, progress=False)
    store = HarvestStore(tmp_path / "c")
    assert clamped["truncated"] == 1 and store.lengths == [256] and store.spec.max_seq_len == 256
    # a cut sample is named, on stderr and in the plan, with its length before the cut
    err = capsys.readouterr().err
    assert "harvest: 1 sample(s) longer than max_seq_len=256 are cut to it: long (" in err
    cut = json.loads((tmp_path / "c" / "plan.json").read_text())["cut"]
    assert len(cut) == 1 and cut[0]["sample"] == "long" and cut[0]["tokens"] > 256

    unanswered = tmp_path / "unanswered.jsonl"  # a pool that was never regenerated: nothing to train on
    unanswered.write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(HarvestError, match="unanswered.jsonl: no sample to harvest"):
        run(HarvestConfig(data=str(unanswered), out_dir=str(tmp_path / "u")), TargetConfig(name_or_path="lively"),
            target=target, progress=False)

    plan = tmp_path / "h" / "plan.json"
    saved = plan.read_text()
    plan.write_text(saved[: len(saved) // 2])  # cut: the settings a resume checks are unreadable
    with pytest.raises(HarvestError, match=r"h/plan.json: not readable JSON"):
        run(cfg, TargetConfig(name_or_path="lively"), target=target, progress=False)
    plan.write_text(saved)

    changed = HarvestConfig(data=str(data), out_dir=str(tmp_path / "h"), max_seq_len=40, dtype="float8_e4m3fn")
    with pytest.raises(HarvestError, match=r"harvested with spec.dtype='bfloat16', this run has 'float8_e4m3fn'"):
        run(changed, TargetConfig(name_or_path="lively"), target=target, progress=False)

    from eagle3.store.capture import CaptureError

    real_capture = harvest.HFCapture.capture

    def poisoned(self, sequences):
        rows = real_capture(self, sequences)
        rows[0]["aux"][0, 0, 0] = float("nan")
        return rows

    monkeypatch.setattr(harvest.HFCapture, "capture", poisoned)
    fresh = HarvestConfig(data=str(data), out_dir=str(tmp_path / "nan"), max_seq_len=40)
    with pytest.raises(CaptureError, match="sample fine: the target produced NaN/Inf in aux"):
        run(fresh, TargetConfig(name_or_path="lively"), target=target, progress=False)
    assert not list((tmp_path / "nan").glob("shard-*")) and not (tmp_path / "nan" / "manifest.json").exists()


@pytest.mark.slow
def test_kill_9_at_three_points_then_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    model = save_lively(tmp_path / "model", num_layers=8)
    data = regenerated_data(tmp_path / "data.jsonl", 48, turns=3)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cli = [sys.executable, "-m", "data_gen.harvest", "--data", str(data), "--target", str(model),
           "--max-shard-mb", "0.03", "--batch-size", "1", "--no-progress"]
    straight = tmp_path / "straight"
    subprocess.run([*cli, "--out", str(straight)], cwd=REPO, env=env, check=True, capture_output=True)
    shards = len(list(straight.glob("shard-*.safetensors")))
    assert shards >= 6

    killed = tmp_path / "killed"
    rng = random.Random(0)
    for _ in range(3):
        proc = subprocess.Popen([*cli, "--out", str(killed)], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        have = len(list(killed.glob("shard-*.safetensors")))
        goal = min(shards - 1, have + rng.randint(1, 2))
        deadline = time.monotonic() + 60
        while len(list(killed.glob("shard-*.safetensors"))) < goal and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.random() * 0.05)  # land anywhere, mid-shard included
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (killed / "manifest.json").exists() or len(list(killed.glob("shard-*"))) == shards
    for leftover in (".manifest.json.a1b2.tmp", ".plan.json.c3d4.tmp"):  # what a kill while writing them leaves
        (killed / leftover).write_text("{")
    subprocess.run([*cli, "--out", str(killed)], cwd=REPO, env=env, check=True, capture_output=True)
    names = sorted(p.name for p in straight.iterdir() if p.suffix in (".safetensors", ".json"))
    assert names == sorted(p.name for p in killed.iterdir() if p.suffix in (".safetensors", ".json"))
    for name in names:
        assert (straight / name).read_bytes() == (killed / name).read_bytes(), name
    assert not [p for p in killed.iterdir() if p.name.endswith(".tmp")]
    assert verify_store(killed)["samples"] == 48


def test_reasoning_templates_train_each_turn_once_in_the_context_the_target_saw() -> None:
    """Under a template that drops earlier replies' <think> (Qwen3-like), a regenerated per-turn
    sample masks only its own reply (the earlier ones are rendered rewritten, as the target saw
    them), and a multi-turn record that did not come through regeneration is split the same way."""
    from collections import Counter


    chat = ChatFormat.for_tokenizer(tiny_tokenizer(THINK_DROPPING_TEMPLATE))
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>r</think>x"},
                {"role": "user", "content": "b"}, {"role": "assistant", "content": "<think>s</think>y"}]
    regenerated = [{"id": f"r0-t{k}", "messages": messages[: 2 * k + 2], "generation": {"turns": [{}], "turn_index": k}}
                   for k in range(2)]  # as an earlier version's regeneration split it
    plain = {"id": "p0", "messages": messages}
    counts: Counter[str] = Counter()
    out = harvest.tokenize_records([*regenerated, plain], chat, 4096, counts)
    assert [sample_id for sample_id, _, _ in out] == ["r0-t0", "r0-t1", "p0-t0", "p0-t1"]
    decode = chat.tokenizer.decode
    for (_, ids, mask), want_text, want_masked in zip(out, [
            "<|user|>a</s><|assistant|><think>r</think>x</s>",
            "<|user|>a</s><|assistant|>x</s><|user|>b</s><|assistant|><think>s</think>y</s>"] * 2,
            ["<think>r</think>x</s>", "<think>s</think>y</s>"] * 2, strict=True):
        assert decode(ids) == want_text
        assert decode([t for t, m in zip(ids, mask, strict=True) if m]) == want_masked


def test_records_become_the_samples_the_target_saw() -> None:
    """One-reply records are the generation prompt + the generated ids + their stop; a trailing
    user turn is dropped; multi-turn records split per reply only where the rendering is not the
    context (a Mistral-like template: the system prompt moves into the last user turn)."""
    from collections import Counter


    chat = ChatFormat.for_tokenizer(tiny_tokenizer(SYSTEM_IN_LAST_USER))
    tok = chat.tokenizer
    hi = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    generated = [tok.convert_tokens_to_ids("Y"), tok.convert_tokens_to_ids("o")]
    regenerated = {"id": "g", "messages": [*hi, {"role": "user", "content": "more?"}],
                   "generation": {"turns": [{"token_ids": generated, "stop_id": 0, "finish_reason": "stop"}]}}
    system = {"role": "system", "content": "Be brief."}
    two = [*hi, {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "No"}]
    records = [regenerated, {"id": "plain", "messages": two}, {"id": "sys", "messages": [system, *two]}]
    out = {name: (ids, mask) for name, ids, mask in harvest.tokenize_records(records, chat, 4096, Counter())}
    assert list(out) == ["g", "plain", "sys-t0", "sys-t1"]
    ids, mask = out["g"]
    assert ids == [*chat.prompt_ids(hi[:1]), *generated, 0] and sum(mask) == 3  # its own stop (id 0), no 'more?'
    assert tok.decode(out["plain"][0]) == "<s>[INST] Hi[/INST] Yo</s>[INST] Bye[/INST] No</s>"
    for name, upto in (("sys-t0", 2), ("sys-t1", 4)):  # the system prompt in the last user turn, as generated
        ids, mask = out[name]
        assert ids[: mask.index(1)] == chat.prompt_ids([system, *two][:upto])
        assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == two[upto - 1]["content"] + "</s>"


DATED_TEMPLATE = (  # writes the date and trims the messages, as Llama 3.2's template does
    "<|system|>Today is {{ strftime_now('%d %b %Y') }}</s>"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_a_dated_template_is_harvested_with_the_prompt_the_target_was_fed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regenerated on one day and harvested on the next, each reply's sample starts with the prompt
    ids regeneration fed the target (its date), not a rendering of today's; an edited record
    falls back to rendering."""
    from collections import Counter
    from datetime import datetime

    import transformers.utils.chat_template_utils as templates

    from data_gen.config import RegenerateConfig
    from data_gen.generate import regenerate_conversations
    from data_gen.regenerate import output_record

    def clock(day: int) -> type:
        class Frozen(datetime):
            @classmethod
            def now(cls, tz=None):  # noqa: ANN001, ANN206
                return datetime(2026, 11, day, 23, 59)
        return Frozen

    target = lively_target(DATED_TEMPLATE)
    chat = ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)
    assert chat.renders_time
    conversation = [{"role": "user", "content": "Hi\n"}, {"role": "assistant", "content": "x"},
                    {"role": "user", "content": "More"}]
    monkeypatch.setattr(templates, "datetime", clock(24))
    [result] = regenerate_conversations(target, chat, [conversation], 4)
    fed = [chat.prompt_ids(result.messages[:1]), chat.prompt_ids(result.messages[:3])]
    assert result.prompts == fed
    record = output_record({"id": "r", "messages": conversation}, result, RegenerateConfig(), "t", chat.renders_time)
    assert [turn["prompt_ids"] for turn in record["generation"]["turns"]] == fed

    monkeypatch.setattr(templates, "datetime", clock(25))  # the harvest, a day later
    assert chat.prompt_ids(result.messages[:1]) != fed[0]
    shortened = [{"role": "user", "content": "H"}, *record["messages"][1:]]  # its text inside the old one
    edited = {**record, "id": "e", "messages": shortened}
    out = {name: ids for name, ids, _ in harvest.tokenize_records([record, edited], chat, 4096, Counter())}
    assert list(out) == ["r-t0", "r-t1", "e-t0", "e-t1"]  # kept prompts: one sample per reply
    for k in range(2):
        assert out[f"r-t{k}"][: len(fed[k])] == fed[k]
    for k in range(2):  # not the messages the kept ids were rendered from: rendered now
        assert "25 Nov 2026" in chat.tokenizer.decode(out[f"e-t{k}"])
    # a template without the date keeps no prompts

    assert not ChatFormat.for_tokenizer(tiny_tokenizer()).renders_time
    assert "prompt_ids" not in output_record(record, result, RegenerateConfig(), "t")["generation"]["turns"][0]
