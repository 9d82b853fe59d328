"""Shared fixtures: tiny random models built in memory, never downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


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


@pytest.fixture
def eagle3_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "eagle3-home"
    monkeypatch.setenv("EAGLE3_HOME", str(home))
    return home


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


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    """A tiny random Llama + tokenizer saved as an HF folder (safetensors)."""
    folder = tmp_path / "tiny-llama"
    tiny_llama(vocab=TINY_VOCAB).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder
