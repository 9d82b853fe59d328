"""Builders the tests share: tiny random targets and drafts, data files, templates. A test module
imports its helpers from here, never from another test module."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from eagle3.conversations import DOMAINS
from eagle3.draft.families import Proposal, family_of
from eagle3.draft.families.dflash import DFlashDraft
from eagle3.draft.metrics import accepted_runs, step_hits, upto_before
from eagle3.draft.model import DraftConfig, Eagle3Draft, KVCache
from eagle3.draft.vocab import DraftVocab, count_loss_tokens, select_draft_vocab
from eagle3.store.shards import read_manifest
from eagle3.target.model import Target
from eagle3.tiny import (  # noqa: F401  (the tests import them from here too)
    CHAT_TEMPLATE,
    TINY_VOCAB,
    conversation,
    lively_llama,
    regenerated_data,
    save_lively,
    sharpen,
    tiny_llama,
    tiny_tokenizer,
)
from recipes.tiny import tiny_pipeline  # noqa: F401
from serve_eval.config import SpecConfig
from serve_eval.spec_decode import SpeculativeDecoder
from serve_eval.verify import SamplingConfig, target_probs

VOCAB, DRAFT_VOCAB, TARGET_HIDDEN = 128, 32, 48
"""The TTT tests' tiny sizes: target vocabulary, draft vocabulary, target hidden size."""


PROMPTS = [[1, 17, 40, 9, 3], [1, 5, 5, 5, 5, 5, 5, 90, 4, 33, 12]]


def make_target(vocab: int = 128, layers: int = 6) -> Target:
    return Target(tiny_llama(num_layers=layers, vocab=vocab), tiny_tokenizer(), aux_layer_ids=(1, 2, 3))


def make_draft(target: Target, draft_vocab: int | None = None) -> Eagle3Draft:
    torch.manual_seed(1)
    config = DraftConfig.from_target_config(target.config, draft_vocab_size=draft_vocab or target.vocab_size,
                                            initializer_range=0.2)
    draft = Eagle3Draft(config, target.embed_tokens.weight.detach())
    if draft_vocab is not None:  # every other token: the draft cannot propose odd ids
        from eagle3.draft.vocab import DraftVocab

        vocab = DraftVocab.from_target_ids(torch.arange(0, target.vocab_size, 2)[:draft_vocab], target.vocab_size)
        draft.set_draft_vocab(vocab.d2t, vocab.t2d)
    return draft.eval()


def small_config(**kw) -> DraftConfig:
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=128, draft_vocab_size=32, target_hidden_size=48)
    return DraftConfig(**{**base, **kw})


def randomised(draft: Eagle3Draft, seed: int = 0) -> Eagle3Draft:
    """Weights large enough to matter and norms away from 1, so swapped pieces would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.2 * torch.randn(p.shape, generator=g))
    return draft.eval()


def random_draft(seed: int = 0, **kw) -> Eagle3Draft:
    config = small_config(**kw)
    draft = randomised(Eagle3Draft(config), seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(config.vocab_size, generator=g)[: config.draft_vocab_size]
    vocab = DraftVocab.from_target_ids(ids, config.vocab_size)
    draft.set_draft_vocab(vocab.d2t, vocab.t2d)
    return draft


def propose(draft: Eagle3Draft, embedding: torch.Tensor, k: int = 5, seed: int = 1) -> list[list[int]]:
    """Greedy chains of k target ids from random aux states, as at serving time (own KV cache)."""
    g = torch.Generator().manual_seed(seed)
    c = draft.config
    draft.load_embedding(embedding)
    aux = torch.randn(2, 6, c.num_aux_layers, c.target_hidden_size, generator=g)  # [B, S, A, H_t]
    tokens = torch.randint(0, c.vocab_size, (2, 6), generator=g)
    cache = KVCache()
    with torch.no_grad():
        hidden, logits = draft(tokens, draft.combine_aux(aux), torch.arange(6).expand(2, 6), cache)
        hidden, out = hidden[:, -1:], []
        for step in range(k):
            token = draft.draft_to_target_ids(logits[:, -1].argmax(-1))  # [B]
            out.append(token.tolist())
            hidden, logits = draft(token[:, None], hidden, torch.full((2, 1), 6 + step), cache)
    return out


def public_folder(path: Path, config: dict, tensors: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def public_config(c: DraftConfig, **kw) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "max_position_embeddings": 2048, "vocab_size": c.vocab_size,
            "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size, **kw}


def record_file(path: Path, ids: range, prefix: str = "r") -> Path:
    with open(path, "w") as f:
        for i in ids:
            language = "de" if i % 4 == 3 else "en"
            f.write(json.dumps({"id": f"{prefix}{i}", "domain": DOMAINS[i % 4], "language": language,
                                "messages": conversation(i, 1 + i % 2)}) + "\n")
    return path


def wheel_with(path: Path, member: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    return path


def tiny_kimi_k25(folder):
    """A tiny random Kimi-K2.5 (multimodal wrapper, DeepSeek-V3 text model: MLA + MoE), saved in
    the checkpoint's own layout (``language_model.model.*``, ``language_model.lm_head``)."""
    import transformers

    text = dict(model_type="deepseek_v3", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                max_position_embeddings=256, tie_word_embeddings=False)
    config = transformers.Kimi_K25Config(
        text_config=text, projection_hidden_size=32, tie_word_embeddings=False,
        # as the real checkpoint: its own code is offered for AutoModelForCausalLM (not trusted here)
        auto_map={"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                  "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(config).eval().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def tiny_draft(num_layers: int = 1, seed: int = 0, **variant: Any) -> Any:
    """A tiny draft of the TTT tests' sizes, norms away from 1 and a random draft vocab; ``variant``
    sets DraftConfig fields (a ``block_size`` makes it a DFlash draft)."""
    torch.manual_seed(seed)
    config = DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=TARGET_HIDDEN,
                         num_layers=num_layers, initializer_range=0.15, **variant)
    draft = family_of(config).build(config, torch.randn(VOCAB, 64))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # norms away from 1, so that a swapped norm would show
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    vocab = DraftVocab.from_target_ids(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB], VOCAB)
    draft.set_draft_vocab(vocab.d2t, vocab.t2d)
    return draft.eval()


def documents(batch: dict) -> Iterator[tuple[int, int, int]]:
    """(row, start, end) of every document of a packed batch, as the serving-time references walk it."""
    for row in range(batch["input_ids"].shape[0]):
        doc = batch["document_ids"][row]
        for d in doc.unique().tolist():
            where = (doc == d).nonzero().flatten()
            yield row, int(where[0]), int(where[-1]) + 1


def train_briefly(draft: Any, batch: dict, steps: int = 30, num_steps: int = 3,
                  after_backward: Callable[[], None] | None = None) -> list[float]:
    """Adam (lr 3e-3) on one packed batch through the family's training forward; the losses."""
    from eagle3.draft.ttt import prepare_targets

    targets = prepare_targets(batch["target_logits"], draft.t2d)
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(steps):
        out = family_of(draft.config).forward(draft, batch["input_ids"], batch["aux"], batch["position_ids"],
                                              batch["document_ids"], batch["loss_mask"], targets, num_steps=num_steps)
        opt.zero_grad()
        out.loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    return losses


def packed_batch(doc_lengths: list[list[int]], seed: int = 0, t2d: torch.Tensor | None = None) -> dict:
    """Rows of packed documents (as eagle3.store.batches.pack builds them), with random states and targets
    (with ``t2d``, the target's argmax mostly falls inside the draft vocab)."""
    g = torch.Generator().manual_seed(seed)
    s = sum(doc_lengths[0])
    assert all(sum(row) == s for row in doc_lengths)
    b = len(doc_lengths)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in doc_lengths])
    doc = torch.stack([torch.cat([torch.full((n,), k) for k, n in enumerate(row)]) for row in doc_lengths])
    return {
        "input_ids": torch.randint(0, VOCAB, (b, s), generator=g),
        "aux": torch.randn(b, s, 3, TARGET_HIDDEN, generator=g),
        "position_ids": pos,
        "document_ids": doc,
        "loss_mask": torch.rand(b, s, generator=g) > 0.3,
        "target_logits": 3 * torch.randn(b, s, VOCAB, generator=g) + (0 if t2d is None else 4.0 * t2d),
    }


# Templates written for these tests, after the behaviour of reasoning models' templates: Qwen3's
# generation prompt closes an empty thinking block when enable_thinking is false; Kimi-K2 Thinking's
# opens one unless thinking is false, then writes it empty. Both drop earlier replies' reasoning.
SWITCHED_TEMPLATES = {
    "enable_thinking": (
        "{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] }}{% endif %}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
        "{% endif %}"),
    "thinking": (
        "{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] }}{% endif %}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>"
        "{% if thinking is defined and thinking is false %}<think></think>{% else %}<think>{% endif %}"
        "{% endif %}"),
}

TOOL_TEMPLATE = (  # like Qwen3's: tools in the system turn, results in user turns, history reasoning dropped
    "{%- if tools %}<|system|>{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</s>"
    "{%- elif messages[0]['role'] == 'system' %}<|system|>{{ messages[0]['content'] }}</s>{% endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}<|user|>{{ m['content'] }}</s>"
    "{%- elif m['role'] == 'assistant' %}<|assistant|>"
    "{%- if loop.index0 < ns.last_user %}{{ m['content'].split('</think>')[-1].lstrip() }}"
    "{%- else %}{{ m['content'] }}{% endif %}</s>"
    "{%- elif m['role'] == 'tool' %}"
    "{%- if messages[loop.index0 - 1]['role'] != 'tool' %}<|user|>{% endif %}"
    "<tool_response>{{ m['content'] }}</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}</s>{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}"
)
"""Modelled on the behaviour of Qwen3's template: ``tools`` listed in the system turn, consecutive tool
results in one user turn, replies before the last user turn without their reasoning (replies within
the current tool loop keep it), the empty thinking block written into the generation prompt when
thinking is off."""

STRICT_ROLES_TEMPLATE = (  # like Llama 2 / Gemma: any role but system/user/assistant raises
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Only user, assistant and system roles are supported') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

THINK_DROPPING_TEMPLATE = (  # like reasoning templates: earlier replies lose their <think> block
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# Like Mistral v0.3: the system prompt is written into the *last* user turn, and only when the
# conversation ends with that user turn, so a harvested conversation (ending in a reply) and its
# rendering up to the reply differ before the reply.
SYSTEM_IN_LAST_USER = (
    "{{ bos_token }}{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{% for m in (messages[1:] if system else messages) %}"
    "{% if m['role'] == 'user' %}[INST] {% if system and loop.last %}{{ system }}\n\n{% endif %}"
    "{{ m['content'] }}[/INST]"
    "{% else %} {{ m['content'] | trim }}{{ eos_token }}{% endif %}{% endfor %}"
)


def lively_target(chat_template: str | None = None, **kwargs) -> Target:
    tokenizer = tiny_tokenizer() if chat_template is None else tiny_tokenizer(chat_template)
    return Target(lively_llama(**kwargs), tokenizer, name="lively")


# ---------------------------------------------------------------- serving-loop builders


class OracleDecoder(SpeculativeDecoder):
    """Proposes the target's own greedy continuation (with every ``wrong``-th token changed), so
    that long accepted runs and rejections both happen; the family's proposer still runs (its
    catch-up, masks and rollback), its proposal replaced."""

    def __init__(self, *args, wrong: int = 0, **kw) -> None:
        super().__init__(*args, **kw)
        self.wrong = wrong
        proposer = self.proposer
        real_start, real_propose = proposer.start, proposer.propose
        seen: list[int] = []  # every row's token so far: the context is the prompt's first token then these

        def start(slots: int):
            seen.clear()
            return real_start(slots)

        def propose(aux, tokens, start_row, k, params, g):
            real_propose(aux, tokens, start_row, k, params, g)
            seen.extend(tokens)
            context, n = [self._first, *seen], start_row + len(tokens)
            if self.config.mode == "tree":  # a wrong root child first, then the right chain under the second
                right = self._greedy(context, self.config.k)
                return Proposal([(right[0] + 1) % self.target.vocab_size, *right], [-1, -1, *range(1, len(right))])
            out = self._greedy(context, k)
            if self.wrong:
                out = [(t + 1) % self.target.vocab_size if (i + n) % self.wrong == 0 else t for i, t in enumerate(out)]
            return Proposal(out, list(range(-1, len(out) - 1)))

        proposer.start, proposer.propose = start, propose

    def generate(self, prompt: list[int], *args, **kw):
        self._first = prompt[0]
        return super().generate(prompt, *args, **kw)

    def _greedy(self, context: list[int], k: int) -> list[int]:
        out: list[int] = []
        for _ in range(k):
            logits = self.target(torch.tensor([context + out]), return_logits=True).logits[0, -1]
            out.append(int(logits.argmax()))
        return out


def plain(target: Target, prompt: list[int], n: int = 24) -> list[int]:
    return SpeculativeDecoder(target, None).generate(prompt, n).tokens


def assert_sampling_matches_target(config: SpecConfig, draft_for, prompt: list[int] | None = None) -> None:
    """Sampled generation with ``draft_for(target)`` (None: no draft) on a tiny model matches the
    target's distribution (chi-square over 1500 three-token continuations of ``prompt``, p = 1e-4)."""
    target = make_target(vocab=32, layers=4)
    draft = draft_for(target) if draft_for is not None else None
    params = SamplingConfig(temperature=1.0, top_k=4)
    prompt = prompt or [1, 7, 3]
    decoder = SpeculativeDecoder(target, draft, config)
    trials = 1500
    counts: dict[tuple[int, int, int], int] = {}
    for seed in range(trials):
        key = tuple(decoder.generate(prompt, 3, params=params, seed=seed).tokens)
        counts[key] = counts.get(key, 0) + 1
    # exact: p(a) p(b | a) p(c | a b) under the processed target distribution; the 2nd and 3rd
    # tokens come from speculative rounds
    p0 = target_probs(target(torch.tensor([prompt])).logits[0, -1], params)
    expected: dict[tuple[int, int, int], float] = {}
    for a in p0.nonzero().flatten().tolist():
        p1 = target_probs(target(torch.tensor([prompt + [a]])).logits[0, -1], params)
        for b in p1.nonzero().flatten().tolist():
            p2 = target_probs(target(torch.tensor([prompt + [a, b]])).logits[0, -1], params)
            for c in p2.nonzero().flatten().tolist():
                expected[(a, b, c)] = trials * float(p0[a] * p1[b] * p2[c])
    assert set(counts) <= set(expected)  # nothing outside the target's top-k is ever emitted
    # pool cells with small expectations into one, then chi-square
    small = [k for k, e in expected.items() if e < 5]
    stat = sum((counts.get(k, 0) - e) ** 2 / e for k, e in expected.items() if e >= 5)
    if small:
        e = sum(expected[k] for k in small)
        o = sum(counts.get(k, 0) for k in small)
        stat += (o - e) ** 2 / e
    dof = sum(1 for e in expected.values() if e >= 5) + bool(small) - 1
    # critical value at p = 1e-4: about dof + 4.3*sqrt(2*dof) + 10 for these sizes
    assert stat < dof + 4.3 * (2 * dof) ** 0.5 + 10, (stat, dof)


# ---------------------------------------------------------------- the parallel families

MASK = 5
"""The tiny DFlash draft's mask token."""


def tiny_dflash(num_layers: int = 1, block_size: int = 4, seed: int = 0) -> DFlashDraft:
    return tiny_draft(num_layers, seed, mask_token_id=MASK, block_size=block_size)


def peagle_for(target) -> Eagle3Draft:
    base = make_draft(target)
    draft = Eagle3Draft(replace(base.config, family="peagle", mask_token_id=3), target.embed_tokens.weight.detach())
    draft.load_state_dict({**base.state_dict(), "mask_hidden": torch.randn(draft.mask_hidden.shape)})
    return draft.eval()


def dflash_for(target, block_size: int = 4) -> DFlashDraft:
    torch.manual_seed(1)
    config = DraftConfig.from_target_config(target.config, draft_vocab_size=target.vocab_size, initializer_range=0.2,
                                            mask_token_id=3, block_size=block_size)
    return DFlashDraft(config, target.embed_tokens.weight.detach()).eval()


# ---------------------------------------------------------------- reference forms the library does not need
# (per batch, or by hand): the library's tallies and fused paths are checked against them


def draft_vocab_from_store(root: str | Path, draft_vocab_size: int, vocab_size: int,
                           always_include: Sequence[int] = ()) -> DraftVocab:
    counts = count_loss_tokens(store_token_columns(root), vocab_size)
    return select_draft_vocab(counts, draft_vocab_size, always_include)


def to_draft_logits(logits: Tensor, t2d: Tensor) -> Tensor:
    """Target-vocab logits or log-probs [..., V] -> the draft vocab's [..., Vd] (softmax of the
    result is the target distribution restricted to the draft vocab and renormalised)."""
    return logits[..., t2d.to(logits.device)]


def draft_logits_to_target(logits: Tensor, d2t: Tensor, vocab_size: int) -> Tensor:
    """Draft logits [..., Vd] -> [..., V] with -inf outside the draft vocab (what vLLM does)."""
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    out[..., torch.arange(len(d2t), device=logits.device) + d2t.to(logits.device)] = logits
    return out


def to_draft_probs(probs: Tensor, t2d: Tensor) -> Tensor:
    """Target-vocab probabilities [..., V] -> [..., Vd], renormalised to sum to 1 (0 where no mass)."""
    kept = probs[..., t2d.to(probs.device)]
    return kept / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).tiny)


def draft_probs_to_target(probs: Tensor, d2t: Tensor, vocab_size: int) -> Tensor:
    """Draft probabilities [..., Vd] -> [..., V], zero outside the draft vocab."""
    out = probs.new_zeros((*probs.shape[:-1], vocab_size))
    out[..., torch.arange(len(d2t), device=probs.device) + d2t.to(probs.device)] = probs
    return out


def step_accuracy(match: Tensor, counted: Tensor) -> Tensor:
    """[K] share of counted positions where the draft's argmax equals the target's, per step."""
    return step_hits(match, counted).sum(1) / counted.flatten(1).sum(1).clamp_min(1)


def conditional_acceptance(match: Tensor, counted: Tensor) -> Tensor:
    """[K] accuracy at step k among counted positions whose steps < k all matched."""
    upto, before = upto_before(match, counted)
    return upto.sum(1) / before.sum(1).clamp_min(1)


def simulated_tau(match: Tensor, counted: Tensor) -> Tensor:
    """1 + mean over positions counted at step 0 of sum_k prod_{j<=k} 1[match_j].

    The product runs per position (a miss or an uncounted step ends its run); averaging
    per-step accuracies first and multiplying them would be biased.
    """
    run, start = accepted_runs(match, counted)
    if not bool(start.any()):
        return torch.ones((), device=match.device)
    return 1.0 + run[start].float().mean()


def store_token_columns(root: str | Path) -> Iterator[tuple[Tensor, Tensor]]:
    """(input_ids, loss_mask) of each shard of a harvest store, without reading any state."""
    from safetensors import safe_open

    root = Path(root)
    for entry in read_manifest(root)["shards"]:
        with safe_open(str(root / entry["file"]), framework="pt") as f:
            yield f.get_tensor("input_ids"), f.get_tensor("loss_mask")
