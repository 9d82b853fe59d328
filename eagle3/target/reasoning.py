"""Where a reasoning model's thinking is: which generated tokens lie inside its thinking block.

Reasoning models write ``<think> ... </think>`` before the answer (Qwen3, DeepSeek-R1 and V3.1,
Kimi-K2 Thinking and K2.5, GLM-4.5); with thinking on, some templates open the block in the
generation prompt, so a reply may start inside it. :class:`ThinkingMarkers` labels each generated
token: thinking (inside the block, its markers included) or answer. The labels feed acceptance by
part (the speculative loop's stats, the evaluation report) and the count of replies cut inside
their reasoning (regeneration).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_PROMPT_TAIL_TOKENS = 32  # the generation prompt's last tokens hold any block it opens


@dataclass(frozen=True)
class ThinkingMarkers:
    """The text that opens and closes a thinking block."""

    open: str = "<think>"
    close: str = "</think>"

    def opens_in(self, text: str) -> bool:
        """Whether ``text`` ends inside a thinking block (its last marker opens one)."""
        return text.rfind(self.open) > text.rfind(self.close)

    def prompt_opens(self, tokenizer: Any, prompt_ids: Sequence[int]) -> bool:
        """Whether a generation prompt leaves the reply inside a thinking block."""
        tail = tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
        return self.opens_in(tail)

    def label(self, tokenizer: Any, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> list[bool]:
        """Per token of ``token_ids`` (a reply to ``prompt_ids``): True where it is thinking: inside
        the block, or part of a marker. Text is matched, so markers that are several tokens work too."""
        pieces = [tokenizer.decode([int(t)], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                  for t in token_ids]
        text = "".join(pieces)
        inside = self.prompt_opens(tokenizer, prompt_ids)
        spans: list[tuple[int, int]] = []  # [start, end) of thinking, in characters of text
        start = 0 if inside else None
        at = 0
        while True:
            marker = self.close if start is not None else self.open
            found = text.find(marker, at)
            if found < 0:
                break
            if start is None:
                start = found
            else:
                spans.append((start, found + len(marker)))
                start = None
            at = found + len(marker)
        if start is not None:
            spans.append((start, len(text) + 1))
        labels, offset, s = [], 0, 0
        for piece in pieces:
            end = offset + len(piece)
            while s < len(spans) and spans[s][1] <= offset:
                s += 1
            labels.append(s < len(spans) and spans[s][0] < max(end, offset + 1) and spans[s][1] > offset)
            offset = end
        return labels

    def ends_inside(self, tokenizer: Any, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> bool:
        """Whether a reply stops inside its thinking block (cut at ``max_new_tokens`` mid-reasoning)."""
        text = tokenizer.decode(list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if self.open in text or self.close in text:
            return self.opens_in(text)
        return self.prompt_opens(tokenizer, prompt_ids)


DEFAULT_MARKERS = ThinkingMarkers()

__all__ = ["DEFAULT_MARKERS", "ThinkingMarkers"]
