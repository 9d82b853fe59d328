"""Thinking vs answer: which reply tokens lie in the thinking block, and acceptance reported by part."""

from __future__ import annotations

from eagle3.config import SamplingConfig
from eagle3.draft.metrics import acceptance_by_part
from eagle3.target.reasoning import DEFAULT_MARKERS, ThinkingMarkers
from serve_eval.config import SpecConfig
from serve_eval.evaluate import evaluate, markdown
from tests.helpers import lively_target, make_draft, tiny_tokenizer


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_labels_follow_the_block_whether_the_prompt_or_the_reply_opens_it() -> None:
    tok = tiny_tokenizer()  # byte level: one token a character here
    reply = "<think>ab</think>cd"
    labels = DEFAULT_MARKERS.label(tok, _ids(tok, "<|user|>q</s><|assistant|>"), _ids(tok, reply))
    assert "".join("T" if x else "a" for x in labels) == "T" * len("<think>ab</think>") + "aa"
    # the generation prompt opened the block (thinking on): the reply starts inside it
    labels = DEFAULT_MARKERS.label(tok, _ids(tok, "<|assistant|><think>\n"), _ids(tok, "xy</think>z"))
    assert labels == [True] * len("xy</think>") + [False]
    # thinking off: the template wrote an empty block into the prompt; the reply is all answer
    assert not any(DEFAULT_MARKERS.label(tok, _ids(tok, "<|assistant|><think>\n\n</think>\n\n"), _ids(tok, "hi")))
    # cut inside the reasoning, or not
    assert DEFAULT_MARKERS.ends_inside(tok, _ids(tok, "<|assistant|>"), _ids(tok, "<think>still going"))
    assert DEFAULT_MARKERS.ends_inside(tok, _ids(tok, "<|assistant|><think>"), _ids(tok, "still going"))
    assert not DEFAULT_MARKERS.ends_inside(tok, _ids(tok, "<|assistant|><think>"), _ids(tok, "done</think>ok"))
    kimi_like = ThinkingMarkers("◁think▷", "◁/think▷")
    assert kimi_like.label(tok, _ids(tok, "x"), _ids(tok, "◁think▷r◁/think▷a"))[-1] is False


def test_acceptance_is_split_by_the_part_each_round_starts_in() -> None:
    parts = acceptance_by_part([2, 0, 1, 3], [3, 3, 3, 3], [True, True, False, False], 3)
    assert parts == {"answer": {"rounds": 2, "tau": 3.0, "accept_per_pos": [1.0, 0.5, 0.5]},
                     "thinking": {"rounds": 2, "tau": 2.0, "accept_per_pos": [0.5, 0.5, 0.0]}}
    assert acceptance_by_part([1], [3], [False], 3) == {"answer": {"rounds": 1, "tau": 2.0,
                                                                    "accept_per_pos": [1.0, 0.0, 0.0]}}


def test_the_report_gives_tau_on_thinking_and_answer_rounds() -> None:
    target = lively_target()
    draft = make_draft(target)
    opened = _ids(target.tokenizer, "<|user|>hi</s><|assistant|><think>\n")
    plain = _ids(target.tokenizer, "<|user|>hi</s><|assistant|>")
    report = evaluate(target, draft, {"thinks": [opened], "answers": [plain]}, config=SpecConfig(k=2),
                      params=SamplingConfig(), max_new_tokens=10, stop_ids=[2], progress=False)
    thinks, answers = report["sets"]["thinks"]["by_part"], report["sets"]["answers"]["by_part"]
    assert set(answers) == {"answer"}
    assert "thinking" in thinks and sum(p["rounds"] for p in thinks.values()) == sum(
        p["rounds"] for p in report["sets"]["thinks"]["by_context"].values())
    overall = report["overall"]["by_part"]
    assert overall["thinking"]["rounds"] == thinks["thinking"]["rounds"]
    assert "tau by part of the reply" in markdown(report)
