"""Batched generation: padding, trimming at stop ids, batch == alone, sampling seeds."""

from __future__ import annotations

import pytest
import torch

from data_gen.generate import Reply, generate, left_pad, trim_generated
from eagle3.config import SamplingConfig
from eagle3.target.chat import ChatFormat
from eagle3.target.model import Target
from tests.helpers import lively_target

PROMPTS = ["Hi", "Write a long poem about the sea and the sky, please.", "2+2?", "abc" * 12, "x",
           "Bonjour, ça va ?", "def f(x): return x", "Why is the sky blue? Explain step by step."]


@pytest.fixture(scope="module")
def target() -> Target:
    return lively_target()


@pytest.fixture(scope="module")
def chat(target: Target) -> ChatFormat:
    return ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)


def _prompt(chat: ChatFormat, text: str) -> list[int]:
    return chat.prompt_ids([{"role": "user", "content": text}])


def test_left_pad_right_aligns_prompts() -> None:
    ids, mask = left_pad([[7, 8, 9], [5]], pad_id=0)
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []], pad_id=0)


def test_trim_cuts_at_the_first_stop_id_and_drops_it() -> None:
    new = torch.tensor([[5, 6, 2, 0, 0],
                        [7, 8, 9, 10, 11],
                        [3, 4, 9, 2, 9]])
    assert trim_generated(new, stop_ids=[2, 3]) == [
        Reply([5, 6], "stop", 2),
        Reply([7, 8, 9, 10, 11], "length"),
        Reply([], "stop", 3),
    ]
    assert [g.num_generated for g in trim_generated(new, [2, 3])] == [3, 5, 1]


def test_batch_of_eight_equals_each_row_alone(target: Target, chat: ChatFormat) -> None:
    prompts = [_prompt(chat, p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 4  # really padded
    batched = generate(target, prompts, chat.stop_ids, 24)
    assert len({tuple(g.token_ids) for g in batched}) == len(PROMPTS)  # varied outputs, not one repeated token
    for row, prompt in enumerate(prompts):
        alone = generate(target, [prompt], chat.stop_ids, 24)[0]
        assert alone == batched[row], f"row {row} differs between batch and alone"
        assert len(alone.token_ids) <= 24


def test_greedy_equals_hf_greedy_and_manual_argmax(target: Target, chat: ChatFormat) -> None:
    prompt = _prompt(chat, PROMPTS[1])
    ours = generate(target, [prompt], chat.stop_ids, 6)[0]
    ids = torch.tensor([prompt])
    for _ in range(6):  # no KV cache: every step recomputed from scratch
        ids = torch.cat([ids, target.model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    manual = ids[0, len(prompt):].tolist()
    assert ours.finish_reason == "length" and ours.token_ids == manual


def test_generation_stops_at_a_stop_id(target: Target, chat: ChatFormat) -> None:
    prompt = _prompt(chat, PROMPTS[1])
    free = generate(target, [prompt], chat.stop_ids, 24)[0].token_ids
    stop = free[5]
    first = free.index(stop)  # the stop token may already appear earlier
    cut = generate(target, [prompt], [*chat.stop_ids, stop], 24)[0]
    assert cut == Reply(free[:first], "stop", stop)


def test_the_models_own_generation_defaults_are_ignored(chat: ChatFormat) -> None:
    target = lively_target()  # its own copy: the generation config is changed below
    prompt = _prompt(chat, PROMPTS[0])
    want = generate(target, [prompt], chat.stop_ids, 12)
    shipped = target.model.generation_config
    shipped.update(do_sample=True, temperature=5.0, top_k=3, repetition_penalty=3.0)  # e.g. an instruct model's
    assert generate(target, [prompt], chat.stop_ids, 12) == want
    assert target.model.generation_config is shipped  # restored after the call


def test_sampling_is_reproducible_per_seed_and_leaves_global_rng_alone(target: Target, chat: ChatFormat) -> None:
    prompts = [_prompt(chat, p) for p in PROMPTS[:3]]
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = generate(target, prompts, chat.stop_ids, 16, sampling, seed=7)
    assert torch.rand(1) == before  # the global RNG did not advance
    assert generate(target, prompts, chat.stop_ids, 16, sampling, seed=7) == a
    assert generate(target, prompts, chat.stop_ids, 16, sampling, seed=8) != a
    assert generate(target, prompts, chat.stop_ids, 16, SamplingConfig(), seed=7) != a


def test_sampling_config_validation(target: Target, chat: ChatFormat) -> None:
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-1)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)
    with pytest.raises(ValueError, match="stop_ids is empty"):
        generate(target, [[1, 2]], [], 1)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        generate(target, [[1, 2]], chat.stop_ids, 0)
