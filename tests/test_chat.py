"""Chat formatting: templates, BOS handling and stop ids, on the tiny byte-level tokenizer."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from eagle3.target.chat import FALLBACK_CHAT_TEMPLATE, ChatFormat, ChatFormatError, check_single_bos, eos_ids
from tests.helpers import CHAT_TEMPLATE, SWITCHED_TEMPLATES, SYSTEM_IN_LAST_USER, tiny_tokenizer

# Tiny tokenizer ids: <pad> 0, <s> 1, </s> 2, <|system|> 3, <|user|> 4, <|assistant|> 5; bytes follow.
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Yo"},
    {"role": "user", "content": "Bye"},
]


def test_prompt_ids_match_apply_chat_template_and_end_in_the_generation_prompt() -> None:
    tok = tiny_tokenizer()
    chat = ChatFormat.for_tokenizer(tok)
    ids = chat.prompt_ids(CONVERSATION)
    assert chat.template_source == "tokenizer"
    assert ids == tok.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids[:2] == [3, tok.convert_tokens_to_ids("B")]  # <|system|>B..., no BOS added by the tokenizer
    assert ids[-2:] == [2, 5]  # ...Bye</s><|assistant|>
    assert tok.decode(ids) == "<|system|>Be brief.</s><|user|>Hi</s><|assistant|>Yo</s><|user|>Bye</s><|assistant|>"


def test_fallback_template_for_a_tokenizer_without_one() -> None:
    tok = tiny_tokenizer(chat_template=None)
    chat = ChatFormat.for_tokenizer(tok)
    assert (chat.template_source, chat.template) == ("fallback", FALLBACK_CHAT_TEMPLATE)
    assert chat.render(CONVERSATION) == "<s>Be brief.\n\nUser: Hi\n\nAssistant: Yo</s>\n\nUser: Bye\n\nAssistant:"
    ids = chat.prompt_ids(CONVERSATION)
    assert ids[0] == 1 and ids[1] != 1  # exactly one BOS, written by the template
    assert chat.stop_ids == {2}  # the fallback closes turns with EOS


def test_stop_ids_gather_eos_generation_config_and_end_of_turn() -> None:
    # A template closing assistant turns with <|system|> (id 3): that single special token is the end of turn.
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|system|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok = tiny_tokenizer(chat_template=template)
    chat = ChatFormat.for_tokenizer(tok, GenerationConfig(eos_token_id=[2, 7]))
    assert chat.end_of_turn_id() == 3
    assert chat.stop_ids == {2, 3, 7}
    # The tests' default template ends turns with </s>, which is EOS already.
    assert ChatFormat.for_tokenizer(tiny_tokenizer()).stop_ids == {2}


def test_no_end_of_turn_when_plain_text_follows_the_reply() -> None:
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    chat = ChatFormat.for_tokenizer(tiny_tokenizer(chat_template=template))
    assert chat.end_of_turn_id() is None
    assert chat.stop_ids == {2}


def test_eos_ids_accept_int_or_list_and_deduplicate() -> None:
    tok = tiny_tokenizer()
    assert eos_ids(tok) == [2]
    assert eos_ids(tok, GenerationConfig(eos_token_id=2)) == [2]
    assert eos_ids(tok, GenerationConfig(eos_token_id=[9, 2, 7])) == [2, 9, 7]


def test_doubled_bos_is_refused() -> None:
    check_single_bos([1, 5, 1], bos_id=1)
    check_single_bos([1, 1], bos_id=None)
    with pytest.raises(ChatFormatError, match="doubled BOS"):
        check_single_bos([1, 1, 5], bos_id=1)
    chat = ChatFormat.for_tokenizer(tiny_tokenizer(chat_template="{{ bos_token }}" + FALLBACK_CHAT_TEMPLATE))
    with pytest.raises(ChatFormatError, match="doubled BOS"):
        chat.prompt_ids(CONVERSATION)


def test_prompt_must_end_with_a_user_turn() -> None:
    chat = ChatFormat.for_tokenizer(tiny_tokenizer())
    with pytest.raises(ChatFormatError, match="end with a user message"):
        chat.prompt_ids(CONVERSATION[:3])




def _masked_text(chat: ChatFormat, messages: list[dict[str, str]]) -> list[str]:
    """The masked runs of tokens, decoded."""
    return _runs(chat, *chat.tokenize_conversation(messages))


def _runs(chat: ChatFormat, ids: list[int], mask: list[int]) -> list[str]:
    runs, current = [], []
    for token, bit in zip(ids, mask, strict=True):
        if bit:
            current.append(token)
        elif current:
            runs.append(chat.tokenizer.decode(current))
            current = []
    return runs + ([chat.tokenizer.decode(current)] if current else [])


def test_a_reply_quoted_in_the_user_turn_is_masked_where_the_reply_is() -> None:
    chat = ChatFormat.for_tokenizer(tiny_tokenizer(SYSTEM_IN_LAST_USER))
    system = {"role": "system", "content": "Be brief."}
    one = [system, {"role": "user", "content": "Reply with: Sure thing"},
           {"role": "assistant", "content": "Sure thing"}]
    assert _masked_text(chat, one) == ["Sure thing</s>"]
    ids, mask = chat.tokenize_conversation(one)
    assert mask[-len("Sure thing") - 1:] == [1] * (len("Sure thing") + 1)  # the reply at the end, not the quote
    two = [system, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"},
           {"role": "user", "content": "Say Yes or No"}, {"role": "assistant", "content": "No"}]
    text = chat.render(two, add_generation_prompt=False)
    assert text == "<s>[INST] Hi[/INST] Yes</s>[INST] Say Yes or No[/INST] No</s>"
    ids, mask = chat.tokenize_conversation(two)
    assert _masked_text(chat, two) == ["Yes</s>", "No</s>"] and mask[-3:] == [1, 1, 1]


def _metaspace_tokenizer(template: str):
    """A SentencePiece-style tokenizer: words carry a leading '▁' that stands for the space before them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "▁Hi", "▁Hello", "▁world"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  additional_special_tokens=["[INST]", "[/INST]"])
    tok.chat_template = template
    return tok


def test_a_reply_token_that_starts_at_the_templates_space_is_masked() -> None:
    chat = ChatFormat.for_tokenizer(_metaspace_tokenizer(SYSTEM_IN_LAST_USER))
    ids, mask = chat.tokenize_conversation([{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "Hello world"}])
    tokens = chat.tokenizer.convert_ids_to_tokens(ids)
    assert tokens == ["<s>", "[INST]", "▁Hi", "[/INST]", "▁Hello", "▁world", "</s>"]
    assert mask == [0, 0, 0, 0, 1, 1, 1]  # '▁Hello' is the reply's first token, as the target wrote it


def test_a_template_that_refuses_a_conversation_names_it() -> None:
    refusing = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    chat = ChatFormat.for_tokenizer(tiny_tokenizer(refusing))
    with pytest.raises(ChatFormatError, match="refuses this conversation: System role not supported"):
        chat.prompt_ids(CONVERSATION)


def test_fallback_history_is_the_generation_prompt_followed_by_the_reply() -> None:
    """A base model continues 'Assistant:' with ' Yo' (decoded with its space): the harvested text
    must be that prompt and that reply, not 'Assistant:  Yo'."""
    chat = ChatFormat.for_tokenizer(tiny_tokenizer(chat_template=None))
    prompt = chat.render(CONVERSATION[:2])
    full = chat.render([*CONVERSATION[:2], {"role": "assistant", "content": " Yo"}], add_generation_prompt=False)
    assert full.startswith(prompt + " Yo</s>")


# Like DeepSeek-R1: every reply, the last one included, is rendered without its reasoning.
DROPS_ALL_REASONING = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
    "</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_a_reply_the_template_rewrites_is_harvested_as_the_target_wrote_it() -> None:
    chat = ChatFormat.for_tokenizer(tiny_tokenizer(DROPS_ALL_REASONING))
    conversation = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>r</think>x"}]
    assert not chat.history_is_context(conversation)
    with pytest.raises(ChatFormatError, match="rewrites it"):  # the rendering has lost the reasoning
        chat.tokenize_conversation(conversation)
    ids, mask = chat.tokenize_reply(conversation)
    decode = chat.tokenizer.decode
    assert ids[:-len("<think>r</think>x") - 1] == chat.prompt_ids(conversation[:1])  # the generation prompt's ids
    assert decode(ids) == chat.render(conversation[:1]) + "<think>r</think>x</s>"  # prompt, reply, end of turn
    assert decode([t for t, m in zip(ids, mask, strict=True) if m]) == "<think>r</think>x</s>"


def test_a_reply_is_its_generated_ids_and_the_stop_it_ended_with() -> None:
    tok = tiny_tokenizer()
    chat = ChatFormat.for_tokenizer(tok)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    prompt = chat.prompt_ids(conversation[:1])
    y, o = tok.convert_tokens_to_ids(["y", "o"])
    # generated ids that decode to the reply are kept as they are, and the stop is the one it wrote
    ids, mask = chat.tokenize_reply(conversation, {"token_ids": [y, o], "stop_id": 0, "finish_reason": "stop"})
    assert ids == [*prompt, y, o, 0] and mask == [0] * len(prompt) + [1, 1, 1]
    # cut at max_new_tokens: the target never wrote a stop, so none is trained
    ids, mask = chat.tokenize_reply(conversation, {"token_ids": [y, o], "stop_id": None, "finish_reason": "length"})
    assert ids == [*prompt, y, o] and mask == [0] * len(prompt) + [1, 1]
    # ids that do not decode to the reply (an edited record) give way to the text
    ids, _ = chat.tokenize_reply(conversation, {"token_ids": [o], "stop_id": 2, "finish_reason": "stop"})
    assert ids == [*prompt, y, o, 2]
    for not_ids in ("yo", [y, "o"], [y, True]):  # ... as do "ids" that are not token ids
        assert chat.tokenize_reply(conversation, {"token_ids": not_ids, "stop_id": 2})[0] == [*prompt, y, o, 2]
    # an empty reply: the target stopped at once, and that stop is what is trained
    ids, mask = chat.tokenize_reply([conversation[0], {"role": "assistant", "content": ""}])
    assert ids == [*prompt, 2] and mask == [0] * len(prompt) + [1]


def test_whole_conversations_mask_short_replies_and_only_the_stops_written() -> None:
    # plain-text role headers: a reply that is the header's own word is found after the header
    chat = ChatFormat.for_tokenizer(tiny_tokenizer(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"))
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "assistant"},
                    {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    assert _masked_text(chat, conversation) == ["assistant</s>", "c</s>"]
    ids, mask = chat.tokenize_conversation(conversation)
    assert chat.tokenizer.decode(ids[:mask.index(1)]) == "user: hi</s>assistant: "
    ids, mask = chat.tokenize_conversation(conversation, ended=[False, True])  # the first reply was cut
    assert _runs(chat, ids, mask) == ["assistant", "c</s>"]


def test_history_is_context_per_conversation() -> None:
    chat = ChatFormat.for_tokenizer(tiny_tokenizer(SYSTEM_IN_LAST_USER))
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"},
             {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "No"}]
    assert chat.history_is_context(turns)  # without a system prompt the rendering is the context
    assert not chat.history_is_context([{"role": "system", "content": "Be brief."}, *turns])
    assert ChatFormat.for_tokenizer(tiny_tokenizer()).history_is_context(
        [{"role": "system", "content": "Be brief."}, *turns])
    # a template that trims replies renders the history as seen only where there was nothing to trim
    trims = ChatFormat.for_tokenizer(tiny_tokenizer(CHAT_TEMPLATE.replace("{{ m['content'] }}",
                                                                          "{{ m['content'] | trim }}")))
    assert trims.history_is_context(turns)
    padded = [dict(m) for m in turns]
    padded[1]["content"] = "Yes\n"  # the target wrote a newline the rendered history drops
    assert not trims.history_is_context(padded)
    assert ChatFormat.for_tokenizer(tiny_tokenizer()).history_is_context(padded)  # kept verbatim: whole


@pytest.mark.parametrize("switch", sorted(SWITCHED_TEMPLATES))
def test_the_thinking_switch_is_found_and_every_render_passes_it(switch: str) -> None:
    chat = ChatFormat.for_tokenizer(tiny_tokenizer(SWITCHED_TEMPLATES[switch]))
    assert chat.thinking_switch == switch
    messages = [{"role": "user", "content": "hi"}]
    default, on, off = chat.render(messages), chat.with_thinking(True).render(messages), chat.with_thinking(False)
    empty_block = "<think>\n\n</think>\n\n" if switch == "enable_thinking" else "<think></think>"
    assert off.render(messages).endswith(empty_block)
    assert on == default != off.render(messages)  # on is what the template does unasked, for both
    assert off.prompt_ids(messages) == off.tokenizer(off.render(messages), add_special_tokens=False)["input_ids"]
    assert off.stop_ids == chat.stop_ids and chat.with_thinking(False) == off  # equal formats, hashable
    assert hash(off) != hash(chat)


def test_a_template_without_a_thinking_switch_is_refused_by_name() -> None:
    chat = ChatFormat.for_tokenizer(tiny_tokenizer())
    assert chat.thinking_switch is None
    with pytest.raises(ChatFormatError, match=r"the chat template \(tokenizer's, sha256 [0-9a-f]{12}\) reads no "
                                              r"thinking switch \(enable_thinking or thinking\): thinking cannot be "
                                              r"turned off"):
        chat.with_thinking(False)

