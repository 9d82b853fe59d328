"""Tiny random targets and data, built in memory (nothing downloaded): what the tests, the
benchmarks' small checks and CI's cluster check build on. A random model is not a draft's target;
these only exercise the code."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def tiny_llama(num_layers: int = 8, hidden: int = 64, vocab: int = 128, seed: int = 0):
    """A random Llama small enough for unit tests (fp32, eager-free sdpa)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level tokenizer (no merges): 6 special tokens + 256 bytes = 262 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(specials + alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=specials[3:],
    )
    tok.chat_template = chat_template
    return tok


TINY_VOCAB = 262


def conversation(i: int, turns: int = 1) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
    for t in range(turns):
        messages += [{"role": "user", "content": f"question {i}.{t} " + "x" * (i % 7)},
                     {"role": "assistant", "content": f"answer {i}.{t} " + "y" * (i * 3 % 11)}]
    return messages


def regenerated_data(path: Path, n: int, turns: int = 1) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "messages": conversation(i, 1 + (i % turns))}) + "\n")
    return path


def sharpen(model: torch.nn.Module, factor: float = 8.0) -> torch.nn.Module:
    """Scale a random model's weights (norms and MoE router gates aside) by ``factor``: sharper,
    more varied next-token choices than the init's near-uniform ones."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name and not name.endswith("mlp.gate.weight") and ".router." not in name:
                param.mul_(factor)
    return model


def lively_llama(num_layers: int = 8, seed: int = 0):
    """tiny_llama with its weights (norms aside) scaled by 8: sharper, more varied next-token choices."""
    return sharpen(tiny_llama(num_layers=num_layers, vocab=TINY_VOCAB, seed=seed))


def save_lively(folder: Path, **kwargs) -> Path:
    lively_llama(**kwargs).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


__all__ = ["CHAT_TEMPLATE", "TINY_VOCAB", "conversation", "lively_llama", "regenerated_data", "save_lively",
           "sharpen", "tiny_llama", "tiny_tokenizer"]
