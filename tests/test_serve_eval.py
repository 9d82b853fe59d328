"""serve_eval on a tiny target and draft: the report's figures, files and greedy equality."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.config import SamplingConfig
from serve_eval.config import SpecConfig
from serve_eval.evaluate import evaluate, markdown, prompt_end, read_prompts, write_report
from tests.helpers import PROMPTS, make_draft, make_target


def test_report_has_every_figure_and_file(tmp_path: Path) -> None:
    target = make_target()
    draft = make_draft(target)
    prompts = {"a": PROMPTS, "b": PROMPTS[:1]}
    report = evaluate(target, draft, prompts, config=SpecConfig("tree", k=2, topk=2, budget=4),
                      params=SamplingConfig(), max_new_tokens=12, stop_ids=[2], progress=False)
    assert set(report["sets"]) == {"a", "b"} and report["overall"]["prompts"] == 3
    for s in [*report["sets"].values(), report["overall"]]:
        assert s["tau"] >= 1.0 and len(s["accept_per_pos"]) == 2 and s["speedup"] > 0
        assert s["spec_tokens_per_s"] > 0 and s["plain_tokens_per_s"] > 0
    assert report["overall"]["equal"] == 3 and report["overall"]["lossless"]  # greedy: same text as plain
    assert list(report["overall"]["by_context"]) == ["0-1k"]  # short prompts: one bucket, every round in it
    assert report["overall"]["by_context"]["0-1k"]["tau"] == report["overall"]["tau"]
    assert len(report["prompts"]) == 3
    write_report(report, tmp_path / "r", wandb_mode="offline")
    saved = json.loads((tmp_path / "r" / "report.json").read_text())
    assert saved["overall"]["tau"] == report["overall"]["tau"]
    for png in ("acceptance_by_position.png", "tau_by_set.png", "speedup.png"):
        assert (tmp_path / "r" / png).read_bytes()[:4] == b"\x89PNG"
    assert "| overall | 3 |" in (tmp_path / "r" / "report.md").read_text()
    assert list((tmp_path / "r" / "wandb").glob("offline-run-*"))


def test_rounds_are_counted_by_the_context_before_them(tmp_path: Path) -> None:
    """Each round records the tokens before its first drafted token: the prompt, then one more per
    emitted token; the report pools rounds per bucket, tabulates and plots tau by context length."""
    from serve_eval.evaluate import summarise
    from serve_eval.spec_decode import DecodeStats, SpeculativeDecoder

    target = make_target()
    decoder = SpeculativeDecoder(target, make_draft(target), SpecConfig("chain", k=3))
    stats = decoder.generate(PROMPTS[1], 20, params=SamplingConfig()).stats
    assert stats.contexts[0] == len(PROMPTS[1]) + 1
    steps = zip(stats.contexts[:-1], stats.contexts[1:], stats.accepted[:-1], strict=True)
    assert len(stats.contexts) > 1 and all(b - a == acc + 1 for a, b, acc in steps)

    short = DecodeStats(accepted=[2, 0], proposed=3, contexts=[900, 1023], seconds_total=1.0)
    long = DecodeStats(accepted=[0, 1, 3], proposed=3, contexts=[1024, 5000, 300000], seconds_total=1.0)
    plain = DecodeStats(seconds_total=1.0)
    summary = summarise([short, long], [plain, plain])
    def by(draft: int) -> dict[str, int]:  # rounds without per-proposer counts: the draft's
        return {"draft": draft, "lookup": 0, "both": 0}

    assert summary["by_context"] == {
        "0-1k": {"rounds": 2, "tau": 2.0, "accept_per_pos": [0.5, 0.5, 0.0], "accepted_by": by(2)},
        "1-2k": {"rounds": 1, "tau": 1.0, "accept_per_pos": [0.0, 0.0, 0.0], "accepted_by": by(0)},
        "4-8k": {"rounds": 1, "tau": 2.0, "accept_per_pos": [1.0, 0.0, 0.0], "accepted_by": by(1)},
        "256k+": {"rounds": 1, "tau": 4.0, "accept_per_pos": [1.0, 1.0, 1.0], "accepted_by": by(3)}}
    report = {"config": {"mode": "chain", "k": 3, "topk": 1, "budget": 1, "temperature": 0.0, "max_new_tokens": 4},
              "sets": {"long": summarise([long], [plain])}, "overall": summary, "prompts": []}
    text = markdown(report)
    assert "| set | 0-1k | 1-2k | 4-8k | 256k+ |" in text
    assert "| long | - | 1.000 (1) | 2.000 (1) | 4.000 (1) |" in text
    assert "| overall | 2.000 (2) | 1.000 (1) | 2.000 (1) | 4.000 (1) |" in text
    write_report(report, tmp_path, wandb_mode="disabled")
    assert (tmp_path / "tau_by_context.png").read_bytes()[:4] == b"\x89PNG"


def test_other_proposers_run_beside_the_main_one_on_the_same_prompts(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # the lookup's branch is priced from verify times measured on this machine, which a loaded machine can
    # make so dear that no branch is proposed; here it is priced as a machine with cheap verifies would
    from serve_eval.spec_decode import SpeculativeDecoder

    monkeypatch.setattr(SpeculativeDecoder, "cost_lookup",
                        lambda self, verify: setattr(self.lookup_policy, "token_cost", 0.05))
    target = make_target()
    draft = make_draft(target)
    repeating = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]  # the lookup finds matches here
    report = evaluate(target, draft, {"a": PROMPTS, "loop": [repeating]},
                      config=SpecConfig("chain", k=2, proposer="hybrid"), params=SamplingConfig(),
                      max_new_tokens=16, stop_ids=[], progress=False, compare=["draft", "lookup"])
    assert report["config"]["proposer"] == "hybrid" and set(report["compare"]) == {"draft", "lookup"}
    runs = {"hybrid": report, **report["compare"]}
    for name, run in runs.items():
        assert run["overall"]["equal"] == 3 and run["overall"]["prompts"] == 3  # every run lossless
        by = run["overall"]["accepted_by"]
        assert by["draft"] + by["lookup"] + by["both"] == round((run["overall"]["tau"] - 1)
                                                                 * run["overall"]["rounds"])
        if name == "draft":
            assert by["lookup"] == by["both"] == by["lookup_rounds"] == 0
        else:
            assert by["lookup_rounds"] > 0
        if name == "lookup":
            assert by["draft"] == by["both"] == 0
    for bucket in report["overall"]["by_context"].values():
        assert set(bucket["accepted_by"]) == {"draft", "lookup", "both"}
    write_report(report, tmp_path, wandb_mode="disabled")
    text = (tmp_path / "report.md").read_text()
    assert "| set | hybrid tau | hybrid speedup | draft tau | draft speedup | lookup tau | lookup speedup |" in text
    assert f"| overall | {report['overall']['tau']:.3f} |" in text
    assert (tmp_path / "tau_by_proposer.png").read_bytes()[:4] == b"\x89PNG"


def test_markdown_flags_divergences_that_are_not_ties() -> None:
    report = {"config": {"mode": "chain", "k": 1, "topk": 1, "budget": 1, "temperature": 0.0, "max_new_tokens": 4},
              "sets": {"x": {"prompts": 1, "tau": 1.5, "accept_per_pos": [0.5], "spec_tokens_per_s": 2,
                             "plain_tokens_per_s": 1, "speedup": 2.0, "ttft_s": 0.1,
                             "time_split": {"draft": 0.1, "verify": 0.8}, "equal": 0,
                             "divergences": [{"prompt": 0, "position": 3, "margin": 0.5, "tie": False}]}},
              "overall": {"prompts": 1, "tau": 1.5, "accept_per_pos": [0.5], "spec_tokens_per_s": 2,
                          "plain_tokens_per_s": 1, "speedup": 2.0, "ttft_s": 0.1,
                          "time_split": {"draft": 0.1, "verify": 0.8}, "equal": 0}}
    text = markdown(report)
    assert "NOT a near-tie" in text and "| x | 1 | 1.500 | 0.50 |" in text


class _EchoChat:
    """Prompt ids = the first user turn's text as code points (enough to tell prompts apart)."""

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return [ord(c) for c in messages[-1]["content"]]

    def with_tools(self, tools: list | None) -> _EchoChat:
        return self


def _write_set(path: Path, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_read_prompts_spreads_a_set_over_its_languages(tmp_path: Path) -> None:
    def row(lang: str, i: int) -> dict:
        return {"language": lang, "messages": [{"role": "system", "content": "s"},
                                               {"role": "user", "content": f"{lang}{i}"},
                                               {"role": "assistant", "content": "a"}]}
    rows = [row(lang, i) for lang, n in (("ar", 3), ("fr", 1), ("zh", 2)) for i in range(n)]
    _write_set(tmp_path / "eval" / "ml.jsonl", rows)
    got = ["".join(map(chr, ids)) for ids in read_prompts(tmp_path, "ml", 5, _EchoChat())]
    assert got == ["ar0", "fr0", "zh0", "ar1", "zh1"]
    assert len(read_prompts(tmp_path, "ml", 100, _EchoChat())) == 6
    # one language (or none named): file order, as before
    _write_set(tmp_path / "eval" / "en.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(4)])
    assert ["".join(map(chr, ids)) for ids in read_prompts(tmp_path, "en", 3, _EchoChat())] == ["q0", "q1", "q2"]


def test_a_prompt_ends_at_the_request_before_the_first_reply_to_write() -> None:
    def turns(*roles: str) -> list[dict]:
        return [{"role": r.rstrip("_"), "content": "" if r.endswith("_") else "text"} for r in roles]

    assert prompt_end(turns("user")) == 0
    assert prompt_end(turns("system", "user", "assistant")) == 1  # a reference answer is left out
    assert prompt_end(turns("user", "assistant_", "user")) == 0  # MT-Bench: the second turn waits for a reply
    assert prompt_end(turns("user", "assistant", "user", "assistant", "user")) == 4  # a written history: long_chat
    assert prompt_end(turns("system", "assistant")) is None


def test_read_prompts_names_the_bad_line(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "q"}]}
    for bad, why in (("{not json", "ml.jsonl:2"), ([1, 2], "ml.jsonl:2: not a JSON object"),
                     ({"messages": [{"role": "assistant", "content": "a"}]}, "ml.jsonl:2: no user message")):
        _write_set(tmp_path / "eval" / "ml.jsonl", [good, bad])
        with pytest.raises(ValueError, match=why):
            read_prompts(tmp_path, "ml", 2, _EchoChat())
    with pytest.raises(FileNotFoundError, match="missing.jsonl: missing"):
        read_prompts(tmp_path, "missing", 1, _EchoChat())
    _write_set(tmp_path / "eval" / "empty.jsonl", [])
    with pytest.raises(ValueError, match="empty.jsonl: no prompts"):  # not a report of 0 prompts, tau 1.0
        read_prompts(tmp_path, "empty", 3, _EchoChat())


def test_workers_serve_the_same_tokens_as_one_process(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two processes serve the prompts in turn: every prompt's rounds, each set's tau and the equality
    with plain decoding as one process gives them, in the sets' order; a worker that cannot load its
    pair fails the evaluation in one line naming the setting."""
    import torch

    from eagle3.draft.model import DraftConfig, Eagle3Draft
    from eagle3.target.model import load_target
    from eagle3.train.checkpoint import export_draft
    from serve_eval.eval_runs import EvalError, PairSource, load_pair
    from tests.helpers import TINY_VOCAB, randomised

    probe = load_target(str(tiny_model_dir), dtype="float32", device="cpu")
    config = DraftConfig.from_target_config(probe.config, draft_vocab_size=TINY_VOCAB)
    draft = randomised(Eagle3Draft(config, torch.zeros(TINY_VOCAB, config.hidden_size)))
    state = {k: v for k, v in draft.state_dict().items() if not k.startswith("embed_tokens")}
    export_draft(tmp_path / "draft", state, config, {"aux_layer_ids": list(probe.aux_layer_ids)})
    target, draft = load_pair(str(tmp_path / "draft"), str(tiny_model_dir), "float32", "cpu")
    repeating = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    prompts = {"a": list(PROMPTS), "b": [repeating, PROMPTS[0]]}
    source = PairSource.of(str(tmp_path / "draft"), str(tiny_model_dir), target)
    kwargs = {"config": SpecConfig("chain", k=2), "params": SamplingConfig(), "max_new_tokens": 10,
              "stop_ids": [], "progress": False}
    one = evaluate(target, draft, prompts, **kwargs)
    two = evaluate(target, draft, prompts, workers=2, source=source, **kwargs)
    assert two["config"]["workers"] == 2 and one["config"]["workers"] == 1
    assert [(r["set"], r["prompt"]) for r in two["prompts"]] == [(r["set"], r["prompt"]) for r in one["prompts"]]
    keys = ("new_tokens", "target_forwards", "tau", "accept_per_pos", "accepted_by")
    assert [[r[k] for k in keys] for r in two["prompts"]] == [[r[k] for k in keys] for r in one["prompts"]]
    for name in prompts:
        assert two["sets"][name]["tau"] == one["sets"][name]["tau"]
        assert two["sets"][name]["equal"] == one["sets"][name]["equal"] == len(prompts[name])
    with pytest.raises(EvalError, match="eval.workers: worker 1 exited with code 1 before sending 2 of its prompts"):
        evaluate(target, draft, prompts, workers=2, source=PairSource(str(tmp_path / "nowhere"), str(tiny_model_dir),
                                                                     "float32", "cpu"), **kwargs)
    with pytest.raises(ValueError, match="source"):
        evaluate(target, draft, prompts, workers=2, **kwargs)


def test_eval_workers_fit_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """One process per core over the threads on a CPU, one per GPU from GPU 0, one elsewhere."""
    import os

    import torch

    from serve_eval.eval_runs import eval_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert [eval_workers(n, "cpu") for n in (1, 2, 8)] == [1, 2, 4]
    assert eval_workers(4, "cpu", threads=2) == 2 and eval_workers(4, "cpu", threads=8) == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert eval_workers(4, "cuda") == eval_workers(4, "cuda:0") == 2
    assert eval_workers(4, "cuda:1") == 1 and eval_workers(4, "mps") == 1
