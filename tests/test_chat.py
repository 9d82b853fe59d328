"""Chat formatting: templates, BOS handling and stop ids, on the tiny byte-level tokenizer."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from eagle3.chat import FALLBACK_CHAT_TEMPLATE, ChatFormat, ChatFormatError, check_single_bos, eos_ids
from tests.conftest import tiny_tokenizer

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
