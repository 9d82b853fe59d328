"""Chat formatting for generation: render a conversation with the target's chat template.

A :class:`ChatFormat` is built once per tokenizer and decides, once, which template it
uses: the tokenizer's own ``chat_template``, or, for base models without one,
:data:`FALLBACK_CHAT_TEMPLATE` (recorded as ``template_source == "fallback"``). Every
render passes that template explicitly, so nothing is guessed per call.

Prompts are rendered to text with ``add_generation_prompt=True`` and tokenized with
``add_special_tokens=False``, exactly as ``apply_chat_template(tokenize=True)`` does:
templates that want a BOS write ``{{ bos_token }}`` themselves, and letting the tokenizer
add one too would double it (:func:`check_single_bos` guards against that).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from eagle3.errors import Eagle3Error

FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n\n"
    "{% elif m['role'] == 'tool' %}Tool: {{ m['content'] }}\n\n"
    "{% else %}Assistant: {{ m['content'] | trim }}{{ eos_token if eos_token else '' }}\n\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
"""The template for tokenizers without one (base models): BOS, then ``User: ...`` /
``Assistant: ...`` paragraphs (a tool result: ``Tool: ...``), each assistant turn closed by the
EOS token; the generation prompt is ``Assistant:`` (the model continues with a space, so a reply is rendered trimmed
after ``Assistant: ``: the text the model saw and wrote). A base model has never seen this
format, so the EOS is its only stop token."""

THINKING_SWITCHES = ("enable_thinking", "thinking")
"""Template variables through which a reasoning model's template turns its thinking on or off (Qwen3
and GLM-4.5 read ``enable_thinking``; Kimi-K2 Thinking, Kimi-K2.5 and DeepSeek-V3.1 read ``thinking``)."""

TOOLS_IN_SYSTEM = (
    "You can call the following functions. Their JSON schemas, one per line:\n{schemas}\n\n"
    "To call one, write <tool_call>{{\"name\": <function name>, \"arguments\": <JSON object>}}</tool_call>; "
    "the result comes back in the next turn."
)
"""How a conversation's tools reach a template that does not read ``tools``: this text, the schemas
filled in, as the system prompt (after the conversation's own system prompt, if any)."""

TOOL_CALL_TEXT = "<tool_call>{call}</tool_call>"
"""How a written call (an assistant message's ``tool_calls``) reaches a template that does not write
them: appended to the message's content, the format :data:`TOOLS_IN_SYSTEM` asks for."""

TOOL_RESULTS_AS_USER = "Tool result ({name}):\n{content}"
"""How a tool result reaches a template that cannot render the ``tool`` role: consecutive results
become one user turn of these paragraphs (``name`` is the tool's, else ``tool``)."""

_SENTINEL = "EAGLE3SENTINEL"

Message = Mapping[str, Any]


class ChatFormatError(Eagle3Error, ValueError):
    """A conversation could not be rendered into a well-formed prompt."""


@dataclass(frozen=True)
class ChatFormat:
    """How one tokenizer renders conversations and where its generations stop."""

    tokenizer: Any
    template: str
    """The jinja chat template every render uses (passed explicitly)."""
    template_source: str
    """``"tokenizer"`` (the tokenizer's own template) or ``"fallback"`` (:data:`FALLBACK_CHAT_TEMPLATE`)."""
    stop_ids: frozenset[int]
    """Token ids that end a generated turn: EOS, generation-config EOS ids, end-of-turn token."""
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    """(name, value) of the variables every render passes to the template besides the messages
    (:meth:`with_thinking`)."""
    tools_json: str = ""
    """The function schemas the conversation may call, as JSON (:meth:`with_tools`); empty: none."""

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, generation_config: Any = None,
                      fallback_template: str = FALLBACK_CHAT_TEMPLATE) -> ChatFormat:
        """Pick the template once: the tokenizer's own, else ``fallback_template``."""
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, dict):  # several named templates: the "default" one is the chat template
            own = own.get("default")
        template, source = (own, "tokenizer") if own else (fallback_template, "fallback")
        partial = cls(tokenizer, template, source, frozenset())
        stops = set(eos_ids(tokenizer, generation_config))
        end = partial.end_of_turn_id()
        if end is not None:
            stops.add(end)
        if not stops:
            raise ChatFormatError("the tokenizer has no EOS token and the template no end-of-turn token: "
                                  "generation would never stop; set tokenizer.eos_token")
        return cls(tokenizer, template, source, frozenset(stops))

    @property
    def template_sha256(self) -> str:
        return hashlib.sha256(self.template.encode("utf-8")).hexdigest()

    @property
    def thinking_switch(self) -> str | None:
        """The variable of :data:`THINKING_SWITCHES` the template reads (the first, if several), else None."""
        return _thinking_switch(self.template)

    def with_thinking(self, on: bool) -> ChatFormat:
        """This format with the template's thinking switch set (every render passes it); a template
        without one is refused, naming it."""
        switch = self.thinking_switch
        if switch is None:
            raise ChatFormatError(f"the chat template ({self.template_source}'s, sha256 {self.template_sha256[:12]}) "
                                  f"reads no thinking switch ({' or '.join(THINKING_SWITCHES)}): thinking cannot be "
                                  f"turned {'on' if on else 'off'} with it")
        return replace(self, template_kwargs=tuple({**dict(self.template_kwargs), switch: on}.items()))

    @property
    def reads_tools(self) -> bool:
        """Whether the template reads ``tools`` (else :data:`TOOLS_IN_SYSTEM` carries them)."""
        return "tools" in _template_variables(self.template)

    @functools.cached_property
    def renders_tool_role(self) -> bool:
        """Whether the template renders a ``tool`` message as its own turn, its content included
        (else :data:`TOOL_RESULTS_AS_USER` carries results as user turns)."""
        return self._shows_sentinel([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "call"},
                                     {"role": "tool", "name": "probe", "tool_call_id": "0", "content": _SENTINEL}])

    @functools.cached_property
    def tool_call_arguments(self) -> str | None:
        """How the template writes an assistant message's ``tool_calls``: taking each call's arguments
        as an ``object`` (most: ``| tojson``) or as a JSON ``string`` (DeepSeek-R1's, OpenAI's wire
        form); None where it writes no calls (each is then written into the content as
        :data:`TOOL_CALL_TEXT`)."""
        for form, arguments in (("object", {"a": 1}), ("string", '{"a": 1}')):
            call = {"id": "0", "type": "function", "function": {"name": _SENTINEL, "arguments": arguments}}
            if self._shows_sentinel([{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": None, "tool_calls": [call]}]):
                return form
        return None

    def _shows_sentinel(self, probe: list[dict[str, Any]]) -> bool:
        """Whether rendering ``probe`` as it stands (no fallbacks) writes :data:`_SENTINEL`; a template
        that refuses it does not."""
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(probe, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=True, **dict(self.template_kwargs))
        except (TemplateError, TypeError, KeyError):
            return False
        return _SENTINEL in text

    def with_tools(self, tools: Sequence[Mapping[str, Any]] | None) -> ChatFormat:
        """This format with the conversation's function schemas (OpenAI's form, as
        :func:`eagle3.conversations.check_tools` gives them) passed on every render: as the
        template's ``tools`` where it reads them, else in the system prompt (:data:`TOOLS_IN_SYSTEM`)."""
        return replace(self, tools_json=json.dumps(list(tools), ensure_ascii=False) if tools else "")

    def in_mode(self, mode: str) -> ChatFormat:
        """``template`` (this format: the switch unset), ``on`` or ``off`` (:meth:`with_thinking`)."""
        if mode not in ("template", "on", "off"):
            raise ChatFormatError(f"thinking mode {mode!r}: expected template, on or off")
        return self if mode == "template" else self.with_thinking(mode == "on")

    @property
    def renders_time(self) -> bool:
        """Whether the template writes the current date or time (Llama 3.2's ``strftime_now``):
        a prompt rendered again later is not the one the target was given."""
        return "strftime_now" in self.template

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        kwargs = dict(self.template_kwargs)
        shown = [{"role": m["role"], "content": m["content"],
                  **({k: m[k] for k in ("name", "tool_call_id") if k in m} if m["role"] == "tool" else {})}
                 for m in messages]
        for entry, m in zip(shown, messages, strict=True):
            if m["role"] == "assistant" and m.get("tool_calls"):  # a written call (an eval prompt's history)
                if self.tool_call_arguments is not None:
                    entry["tool_calls"] = [_call_for_template(c, self.tool_call_arguments) for c in m["tool_calls"]]
                    entry["content"] = m["content"] or None  # a reply that is only calls (DeepSeek tests for none)
                else:
                    entry["content"] += "".join(TOOL_CALL_TEXT.format(call=json.dumps(
                        {"name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])},
                        ensure_ascii=False)) for c in m["tool_calls"])
        if self.tools_json:
            tools = json.loads(self.tools_json)
            if self.reads_tools:
                kwargs["tools"] = tools
            else:
                shown = _tools_in_system(shown, tools)
        if any(m["role"] == "tool" for m in shown) and not self.renders_tool_role:
            shown = _tool_results_as_user(shown)
        try:
            return self.tokenizer.apply_chat_template(
                shown, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except TemplateError as err:  # e.g. "System role not supported" (Gemma 2)
            raise ChatFormatError(f"the chat template refuses this conversation: {err}") from err

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of ``messages`` followed by the generation prompt (the assistant header)."""
        if not messages or messages[-1]["role"] not in ("user", "tool"):
            raise ChatFormatError("a generation prompt must end with a user message or a tool result")
        ids = self.tokenizer(self.render(messages), add_special_tokens=False)["input_ids"]
        check_single_bos(ids, self.tokenizer.bos_token_id)
        return ids

    def tokenize_reply(self, messages: Sequence[Message],
                       turn: Mapping[str, Any] | None = None) -> tuple[list[int], list[int]]:
        """A conversation whose last message is the one reply to train on, as the target saw and
        wrote it: the generation prompt of the messages before it (:meth:`prompt_ids`, the very
        ids regeneration fed the target), the reply's tokens, then the stop token it ended with.
        Loss mask: 1 on the reply and its stop.

        ``turn``: the reply's entry of a regenerated record's ``generation.turns``: its generated
        ``token_ids`` are used when they decode to the reply (else the reply text is tokenized),
        its ``stop_id`` is the stop, and a reply cut at ``max_new_tokens`` (``finish_reason``
        ``"length"``) gets no stop; its ``prompt_ids`` (kept where the template writes the date)
        are the prompt when its ``prompt_sha256`` is that of these messages. Without it: the
        text, and the end-of-turn token (else EOS).
        Token level, so no template rewriting of the reply (DeepSeek-R1 dropping its reasoning)
        and no merge of a reply's first characters with the header's can change what is trained.
        """
        if not messages or messages[-1]["role"] != "assistant":
            raise ChatFormatError("a reply sample must end with an assistant message")
        turn = turn or {}
        prompt = self._prompt_as_fed(messages[:-1], turn)
        content = messages[-1]["content"]
        reply = _token_ids(turn.get("token_ids"))  # None: absent, or not ids (edited by hand): the text decides
        if reply is None or self.tokenizer.decode(reply, skip_special_tokens=False,
                                                  clean_up_tokenization_spaces=False) != content:
            reply = self.tokenizer(content, add_special_tokens=False)["input_ids"] if content else []
        if turn.get("finish_reason") == "length":
            stop: list[int] = []
        elif turn.get("stop_id") is not None:
            stop = [int(turn["stop_id"])]
        else:
            end = self.end_of_turn_id()
            end = self.tokenizer.eos_token_id if end is None else end
            stop = [] if end is None else [int(end)]
        ids = [*prompt, *(int(t) for t in reply), *stop]
        return ids, [0] * len(prompt) + [1] * (len(ids) - len(prompt))

    def _prompt_as_fed(self, messages: Sequence[Message], turn: Mapping[str, Any]) -> list[int]:
        """The generation prompt of ``messages``: the ``prompt_ids`` a regenerated turn kept, when
        its ``prompt_sha256`` says they were rendered from these very messages (not so for a
        record edited since), else rendered now."""
        stored = _token_ids(turn.get("prompt_ids"))
        if stored and turn.get("prompt_sha256") == messages_sha256(messages):
            check_single_bos(stored, self.tokenizer.bos_token_id)
            return stored
        return self.prompt_ids(messages)

    def history_is_context(self, messages: Sequence[Message]) -> bool:
        """Whether rendering ``messages`` whole puts, before each reply, the generation prompt the
        target was given to write it (followed by the reply): then the whole conversation is one
        sample. Not so when the template rewrites earlier replies (Qwen3 drops their ``<think>``)
        or moves a turn (Mistral writes the system prompt into the last user turn only)."""
        text = self.render(messages, add_generation_prompt=False)
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                prompt = self.render(messages[:i], add_generation_prompt=True)
                if not text.startswith(prompt):
                    return False
                rest, content = text[len(prompt):], m["content"]
                # verbatim; only a reply without surrounding whitespace may follow the template's own
                # (a template that trims replies would otherwise drop whitespace the target wrote)
                if not (rest.startswith(content) or content == content.strip() and rest.lstrip().startswith(content)):
                    return False
        return True

    def tokenize_conversation(self, messages: Sequence[Message],
                              ended: Sequence[bool] | None = None) -> tuple[list[int], list[int]]:
        """Token ids of a whole conversation and its loss mask: 1 exactly on assistant tokens.

        Assistant tokens are each assistant message's content plus the template's
        end-of-turn token right after it (the draft must learn to propose the stop too), unless
        ``ended[k]`` is False for the k-th reply (cut at ``max_new_tokens``: the target never
        wrote that stop); the role headers, system and user turns are 0. Each reply is located
        in the rendered text after its generation prompt (else after the user text it answers),
        verbatim or stripped; a token that overlaps it is masked (SentencePiece's ``▁word``
        starts at the template's space before it). For a conversation whose history is not the
        generation context (:meth:`history_is_context`) use :meth:`tokenize_reply` per turn.
        """
        text = self.render(messages, add_generation_prompt=False)
        spans: list[tuple[int, int, bool]] = []  # [start, end) of each reply, and whether its stop counts
        cursor, k = 0, -1  # k: index of the current reply among the assistant messages
        for i, m in enumerate(messages):
            content = m["content"]
            if m["role"] != "assistant":
                # Move past the turns the template shows in order; a template may move or drop a
                # system turn (Mistral renders it into the last user turn only), so it is not sought.
                found = _locate(text, content, cursor) if m["role"] != "system" and content else None
                cursor = found[1] if found else cursor
                continue
            k += 1
            prompt = self.render(messages[:i], add_generation_prompt=True)
            if text.startswith(prompt):  # past the assistant header: a short reply cannot match it
                cursor = max(cursor, len(prompt))
            if not content:
                continue
            found = _locate(text, content, cursor)
            if found is None:
                raise ChatFormatError(f"assistant message {i} does not appear in the rendered conversation; "
                                      "the template rewrites it, so its tokens cannot be masked")
            spans.append((*found, ended is None or k >= len(ended) or bool(ended[k])))
            cursor = found[1]
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = enc["input_ids"]
        check_single_bos(ids, self.tokenizer.bos_token_id)
        mask = [0] * len(ids)
        end_of_turn = self.end_of_turn_id()
        stops = self.stop_ids | ({end_of_turn} if end_of_turn is not None else set())
        offsets = enc["offset_mapping"]
        t = 0
        for start, end, counts_stop in spans:  # spans and tokens both ascend: one pass
            while t < len(ids) and offsets[t][1] <= start:
                t += 1
            last_token = None
            while t < len(ids) and offsets[t][0] < end:
                if offsets[t][1] > offsets[t][0]:  # a token that overlaps the content
                    mask[t] = 1
                    last_token = t
                t += 1
            if counts_stop and last_token is not None and last_token + 1 < len(ids) and ids[last_token + 1] in stops:
                mask[last_token + 1] = 1
        return ids, mask

    def end_of_turn_id(self) -> int | None:
        """The special token the template writes right after an assistant message, if any.

        Found by rendering a one-exchange conversation with a sentinel reply and
        tokenizing what follows the sentinel: SmolLM2/Qwen ``<|im_end|>``, Llama-3
        ``<|eot_id|>``, the fallback's EOS. ``None`` when no special token follows.
        """
        text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}],
                           add_generation_prompt=False)
        if _SENTINEL not in text:
            return None
        after = text[text.rindex(_SENTINEL) + len(_SENTINEL):].lstrip(" ")
        ids = self.tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
        if ids and ids[0] in set(self.tokenizer.all_special_ids) | set(_added_ids(self.tokenizer)):
            return int(ids[0])
        return None


@functools.lru_cache(maxsize=16)
def _template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from outside (empty for one jinja2 alone cannot parse)."""
    import jinja2
    from jinja2 import meta

    try:
        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateSyntaxError:
        return frozenset()  # transformers' own environment may still render it; nothing we can name


def _thinking_switch(template: str) -> str | None:
    names = _template_variables(template)
    return next((name for name in THINKING_SWITCHES if name in names), None)


def _arguments_object(arguments: Any) -> Any:
    """A call's arguments as an object (OpenAI's wire form sends them as a JSON string)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return arguments


def _call_for_template(call: Mapping[str, Any], arguments: str) -> dict[str, Any]:
    fn = call["function"]
    args = _arguments_object(fn["arguments"])
    if arguments == "string":
        args = json.dumps(args, ensure_ascii=False)
    return {**call, "function": {"name": fn["name"], "arguments": args}}


def _tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    schemas = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    text = TOOLS_IN_SYSTEM.format(schemas=schemas)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _tool_results_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    previous = None
    for m in messages:
        if m["role"] != "tool":
            out.append(m)
        else:
            text = TOOL_RESULTS_AS_USER.format(name=m.get("name") or "tool", content=m["content"])
            if previous == "tool":  # consecutive results: one user turn
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{text}"}
            else:
                out.append({"role": "user", "content": text})
        previous = m["role"]
    return out


def _token_ids(value: Any) -> list[int] | None:
    """``value`` when it is a list of token ids as a record stores them, else None."""
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def messages_sha256(messages: Sequence[Message]) -> str:
    """A digest of the roles and contents of ``messages``, exactly as written."""
    data = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


def _locate(text: str, content: str, cursor: int) -> tuple[int, int] | None:
    """[start, end) of ``content`` (as given, else stripped) in ``text`` from ``cursor`` on."""
    for piece in (content, content.strip()):
        start = text.find(piece, cursor) if piece else -1
        if start >= 0:
            return start, start + len(piece)
    return None


def eos_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """The tokenizer's EOS id and the generation config's ``eos_token_id`` (int or list), deduplicated."""
    found: list[int] = []
    if tokenizer.eos_token_id is not None:
        found.append(int(tokenizer.eos_token_id))
    gen_eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if gen_eos is not None:
        found.extend(int(i) for i in (gen_eos if isinstance(gen_eos, Iterable) else [gen_eos]))
    return list(dict.fromkeys(found))


def check_single_bos(ids: Sequence[int], bos_id: int | None) -> None:
    """Raise if a rendered prompt starts with two BOS tokens (template and tokenizer both added one)."""
    if bos_id is not None and len(ids) >= 2 and ids[0] == bos_id and ids[1] == bos_id:
        raise ChatFormatError(f"the prompt starts with a doubled BOS (id {bos_id}); "
                              "the template writes one, so tokenize with add_special_tokens=False")


def _added_ids(tokenizer: Any) -> list[int]:
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return [int(i) for i, tok in decoder.items() if getattr(tok, "special", False)]


__all__ = ["FALLBACK_CHAT_TEMPLATE", "ChatFormat", "ChatFormatError", "check_single_bos", "eos_ids", "messages_sha256"]
