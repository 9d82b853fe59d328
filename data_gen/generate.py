"""Batched generation on a :class:`~eagle3.target.model.Target`, left-padded, with HF ``generate``.

What comes back per row (:class:`Reply`): the new token ids **without** the stop
token that ended the turn (the chat template writes its own end-of-turn when the reply is
rendered again), and ``finish_reason``: ``"stop"`` when a stop id was generated,
``"length"`` when ``max_new_tokens`` ran out first. ``stop_id`` keeps which stop token it
was. Tokens after the first stop id (HF's padding of finished rows) are dropped.

Only the settings passed here steer generation: the model's own ``generation_config``
(e.g. an instruct model's shipped ``temperature=0.6``) is set aside for the call, so
``temperature=0`` is plain greedy decoding on every target. Sampling draws from the global
torch RNG forked and seeded with ``seed`` for the call, so a batch is reproducible on
its own, whatever ran before it.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from eagle3.config import SamplingConfig
from eagle3.device import sdpa_backends
from eagle3.target.chat import ChatFormat
from eagle3.target.model import Target


@dataclass(frozen=True)
class Reply:
    """One reply the target generated: its new tokens and why it ended."""

    token_ids: list[int]
    """New tokens, without the stop token."""
    finish_reason: str
    """``"stop"`` (a stop id was generated) or ``"length"`` (``max_new_tokens`` reached)."""
    stop_id: int | None = None

    @property
    def num_generated(self) -> int:
        """Decoding steps this row took: its tokens plus the stop token."""
        return len(self.token_ids) + (self.stop_id is not None)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int,
             device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Right-align prompts: ``(input_ids, attention_mask)``, both ``[batch, longest]``."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [batch, width]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [batch, width], 1 on real tokens
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def trim_generated(new_ids: Tensor | Sequence[Sequence[int]], stop_ids: Iterable[int]) -> list[Reply]:
    """Cut each row of ``new_ids`` (``[batch, steps]``, or ragged lists) at its first stop id (exclusive)."""
    stops = set(int(i) for i in stop_ids)
    out = []
    for row in (new_ids.tolist() if isinstance(new_ids, Tensor) else [list(r) for r in new_ids]):
        cut = next((i for i, tok in enumerate(row) if tok in stops), None)
        if cut is None:
            out.append(Reply(row, "length"))
        else:
            out.append(Reply(row[:cut], "stop", row[cut]))
    return out


@torch.no_grad()
def generate(
    target: Target,
    prompts: Sequence[Sequence[int]],
    stop_ids: Iterable[int],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    *,
    seed: int = 0,
) -> list[Reply]:
    """Generate a reply of up to ``max_new_tokens`` for every prompt (token ids) in one left-padded batch."""
    from transformers import GenerationConfig

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    stops = sorted(set(int(i) for i in stop_ids))
    if not stops:
        raise ValueError("stop_ids is empty: generation would only end at max_new_tokens; pass the EOS id")
    pad_id = target.tokenizer.pad_token_id
    pad_id = stops[0] if pad_id is None else pad_id
    input_ids, attention_mask = left_pad(prompts, pad_id, target.device)  # [batch, width] each
    settings = dict(max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=pad_id,
                    do_sample=not sampling.greedy, num_beams=1, use_cache=True)
    if not sampling.greedy:
        settings.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    config = GenerationConfig(**settings)
    with _neutral_generation_defaults(target), _seeded(seed, target.device), sdpa_backends(target.device):
        out = target.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    return trim_generated(out[:, input_ids.shape[1]:], stops)  # [batch, steps] -> per row


class Generator(Protocol):
    """Generates replies for a batch of prompts (token ids): HF below, vLLM in ``data_gen.vllm_generate``."""

    name: str

    def generate(self, prompts: Sequence[Sequence[int]], stop_ids: Iterable[int], max_new_tokens: int,
                 sampling: SamplingConfig, *, seed: int = 0) -> list[Reply]: ...


@dataclass
class HFGenerator:
    """:func:`generate` on a loaded :class:`~eagle3.target.model.Target`."""

    target: Target
    name: str = "hf"

    def generate(self, prompts: Sequence[Sequence[int]], stop_ids: Iterable[int], max_new_tokens: int,
                 sampling: SamplingConfig, *, seed: int = 0) -> list[Reply]:
        return generate(self.target, prompts, stop_ids, max_new_tokens, sampling, seed=seed)


@contextlib.contextmanager
def _neutral_generation_defaults(target: Target) -> Iterator[None]:
    """Hide the model's shipped generation defaults so that only our settings apply."""
    from transformers import GenerationConfig

    model = target.model
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(seed)
        yield


@dataclass
class RegeneratedConversation:
    """One conversation with every assistant turn written by the target."""

    messages: list[dict[str, Any]]
    """System/user messages (and tool results) of the original, each followed by the target's reply."""
    turns: list[Reply] = field(default_factory=list)
    """The generation behind each assistant message, in order."""
    dropped_turns: int = 0
    """Replies not written (with everything after them: user turns, tool results) because their
    prompt was too long."""
    prompts: list[list[int]] = field(default_factory=list)
    """The prompt ids the target was fed for each turn (what :meth:`ChatFormat.prompt_ids` gave then)."""

    @property
    def skipped(self) -> bool:
        """Even the first prompt was too long: nothing was generated."""
        return not self.turns


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, batch, turn): independent streams, no arithmetic clashes."""
    digest = hashlib.sha256(":".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def reply_slots(conversation: Sequence[Mapping[str, Any]]) -> list[list[dict[str, Any]]]:
    """The messages the data gives before each reply the target writes: a user turn, or the tool
    results that answer a call (spliced in as the data has them). A reply follows each run of
    non-assistant messages, the last one included; the data's assistant turns only mark where."""
    slots: list[list[dict[str, Any]]] = []
    pending: list[dict[str, Any]] = []
    for m in conversation:
        if m["role"] == "system":
            continue
        if m["role"] == "assistant":
            if pending:
                slots.append(pending)
            pending = []
        else:
            pending.append({k: v for k, v in m.items() if k in ("role", "content", "name", "tool_call_id")})
    if pending:
        slots.append(pending)
    return slots


class ConversationJob:
    """One conversation regenerated turn by turn (:func:`regenerate_conversations`): renders each
    turn's prompt from the target's own earlier replies, takes the replies, drops what is too long."""

    def __init__(self, chat: ChatFormat, conversation: Sequence[Mapping[str, Any]],
                 max_prompt_tokens: int | None) -> None:
        self.chat, self.max_prompt_tokens = chat, max_prompt_tokens
        self.slots = reply_slots(conversation)
        system = [{"role": "system", "content": m["content"]} for m in conversation[:1] if m["role"] == "system"]
        self.result = RegeneratedConversation(messages=system)
        self._prompt: list[int] | None = None
        self.sequences_of: Any = None  # with capture: RegeneratedConversation -> the sequences to keep states of

    @property
    def depth(self) -> int:
        return len(self.result.turns)

    def next_prompt(self) -> list[int] | None:
        result, depth = self.result, len(self.result.turns)
        if depth >= len(self.slots) or result.dropped_turns:
            return None
        ids = self.chat.prompt_ids(result.messages + self.slots[depth])
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            result.dropped_turns = len(self.slots) - depth
            return None
        self._prompt = ids
        return ids

    def take_reply(self, reply: Reply) -> None:
        assert self._prompt is not None
        text = self.chat.tokenizer.decode(reply.token_ids, skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False)
        self.result.messages += [*self.slots[self.depth], {"role": "assistant", "content": text}]
        self.result.turns.append(reply)
        self.result.prompts.append(self._prompt)
        self._prompt = None

    def sequences(self) -> list[list[int]]:
        return [] if self.sequences_of is None else self.sequences_of(self.result)


def regenerate_conversations(
    generator: Generator | Target,
    chat: ChatFormat,
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    *,
    seed: int = 0,
    max_prompt_tokens: int | None = None,
    thinking: Sequence[bool | None] | None = None,
    tools: Sequence[Sequence[Mapping[str, Any]] | None] | None = None,
    engine: Any = None,
    sequences_of: Any = None,
    results: list[RegeneratedConversation] | None = None,
) -> list[RegeneratedConversation]:
    """Regenerate every assistant turn of ``conversations`` with the target.

    ``generator`` is a :class:`Generator` (HF or vLLM), or a Target (run with HF).

    The original assistant contents (and their tool calls) are dropped; user turns and tool results
    are kept (:func:`reply_slots`); each reply is written from the target's own earlier replies and
    the messages after them (``user2``, or the results of the call it stands for). A conversation
    whose prompt at depth ``d`` exceeds ``max_prompt_tokens`` keeps its first ``d - 1`` exchanges and
    drops the rest (``dropped_turns``); at depth 1 that skips it entirely. ``thinking[i]``:
    conversation i's prompts rendered with the template's thinking switch on or off (None: unset);
    ``tools[i]``: the function schemas it may call (:meth:`ChatFormat.with_tools`).

    With ``engine`` (a :class:`data_gen.engine.Engine` on the HF target) every conversation keeps
    its KV cache from turn to turn and rows are decoded together (sampled: conversation i draws from
    ``derive_seed(seed, i)``); ``sequences_of`` (a conversation -> the token sequences to keep
    states of) turns its capture on, and the states come back as ``engine.captured``; ``results``, if
    given, is filled with the conversations at the start (what ``sequences_of`` is called with). Otherwise
    (vLLM) turns go depth by depth: all first replies in one ``generate`` call, then all second
    replies, ..., the batch at depth ``d`` sampled with ``derive_seed(seed, d)``.
    """
    if isinstance(generator, Target):
        generator = HFGenerator(generator)
    jobs = conversation_jobs(chat, conversations, max_prompt_tokens, thinking, tools)
    if results is not None:  # the caller's view of the conversations as they are written
        results[:] = [job.result for job in jobs]
    if engine is not None:
        for job in jobs:
            job.sequences_of = sequences_of
        engine.captured = engine.run(jobs, [derive_seed(seed, i) for i in range(len(jobs))])
    else:
        run_by_depth(generator, chat, jobs, max_new_tokens, sampling, seed)
    return [job.result for job in jobs]


def conversation_jobs(chat: ChatFormat, conversations: Sequence[Sequence[Mapping[str, Any]]],
                      max_prompt_tokens: int | None, thinking: Sequence[bool | None] | None = None,
                      tools: Sequence[Sequence[Mapping[str, Any]] | None] | None = None) -> list[ConversationJob]:
    """One :class:`ConversationJob` per conversation, rendered in its thinking mode with its tools."""
    modes = thinking if thinking is not None else [None] * len(conversations)
    schemas = tools if tools is not None else [None] * len(conversations)
    chats = [(chat if mode is None else chat.with_thinking(mode)).with_tools(given)
             for mode, given in zip(modes, schemas, strict=True)]
    return [ConversationJob(c, conv, max_prompt_tokens) for c, conv in zip(chats, conversations, strict=True)]


def run_by_depth(generator: Generator, chat: ChatFormat, jobs: Sequence[ConversationJob], max_new_tokens: int,
                 sampling: SamplingConfig, seed: int) -> None:
    """Every job's turns depth by depth: all first replies in one ``generate`` call, then all second
    replies, ...; the batch at depth ``d`` sampled with ``derive_seed(seed, d)``."""
    for depth in range(1, max((len(job.slots) for job in jobs), default=0) + 1):
        live, prompts = [], []
        for job in jobs:
            if len(job.slots) < depth or job.result.dropped_turns:
                continue
            ids = job.next_prompt()
            if ids is not None:
                live.append(job)
                prompts.append(ids)
        if not live:
            continue
        replies = generator.generate(prompts, chat.stop_ids, max_new_tokens, sampling, seed=derive_seed(seed, depth))
        for job, reply in zip(live, replies, strict=True):
            job.take_reply(reply)


__all__ = [
    "ConversationJob", "Generator", "HFGenerator", "RegeneratedConversation", "Reply", "conversation_jobs",
    "derive_seed", "generate", "left_pad", "regenerate_conversations", "reply_slots", "run_by_depth",
    "trim_generated",
]
