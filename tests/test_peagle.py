"""P-EAGLE (parallel drafting): the unroll against the draft run as vLLM serves it (one forward over
the context and the mask rows), training, export/import in vLLM's layout, and the serving loop's
losslessness with a parallel draft."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from eagle3.draft.families import family_of
from eagle3.draft.families import parameter_count as trainable_parameter_count
from eagle3.draft.formats import DraftFormatError
from eagle3.draft.model import Eagle3Draft, KVCache
from eagle3.draft.ttt import prepare_targets
from eagle3.export import export_draft_folder, load_draft
from serve_eval.config import SpecConfig
from serve_eval.spec_decode import SpeculativeDecoder
from tests.helpers import (
    PROMPTS,
    OracleDecoder,
    assert_sampling_matches_target,
    documents,
    make_target,
    packed_batch,
    peagle_for,
    plain,
    tiny_draft,
    train_briefly,
)

MASK = 7


def parallel_draft(num_layers: int = 1, **variant: bool) -> Eagle3Draft:
    return tiny_draft(num_layers, mask_token_id=MASK, **variant)


@torch.no_grad()
def parallel_serving_logits(draft: Eagle3Draft, batch: dict[str, torch.Tensor], num_steps: int) -> dict:
    """{(row, k, t): logits [Vd]} as vLLM's parallel drafting runs the draft: the cache holds the
    context rows <= t (fed one at a time), then ONE forward over K-1 mask rows (the mask token, the
    mask state, positions t+1..t+K-1) gives draft tokens 2..K."""
    out = {}
    for row, start, end in documents(batch):
        ids = batch["input_ids"][row]
        fc = draft.combine_aux(batch["aux"][row : row + 1])  # [1, S, H]
        cache = KVCache()
        for t in range(start, end - 1):
            _, logits = draft(ids[t + 1].view(1, 1), fc[:, t : t + 1], torch.tensor([[t - start]]), cache)
            out[row, 0, t] = logits[0, 0]
            ids_m, hidden = draft.mask_inputs((1, num_steps - 1), torch.float32, torch.device("cpu"))
            pos = torch.arange(t - start + 1, t - start + num_steps)[None]
            _, logits = draft(ids_m, hidden, pos, cache.fork())
            for k in range(1, num_steps):
                if t + k + 1 < end:  # the unroll counts a step only where its target exists
                    out[row, k, t] = logits[0, k - 1]
    return out


@pytest.mark.parametrize("num_layers,variant", [(1, {}), (2, {}), (1, {"fc_norm": True, "norm_output": True}),
                                                (1, {"norm_before_fc": True, "norm_before_residual": True})])
def test_unroll_equals_one_parallel_forward(num_layers: int, variant: dict) -> None:
    draft = parallel_draft(num_layers, **variant)
    batch = packed_batch([[9, 7], [5, 11]], t2d=draft.t2d)
    num_steps = 4
    ref = parallel_serving_logits(draft, batch, num_steps)
    with torch.no_grad():
        out = family_of(draft.config).forward(draft, batch["input_ids"], batch["aux"], batch["position_ids"],
                                              batch["document_ids"], batch["loss_mask"],
                                              prepare_targets(batch["target_logits"], draft.t2d),
                                              num_steps=num_steps, return_logits=True)
    gaps: dict[int, float] = {}
    for (row, k, t), logits in ref.items():
        gaps[k] = max(gaps.get(k, 0.0), (out.logits[k][row, t] - logits).abs().max().item())
    assert sorted(gaps) == list(range(num_steps))
    assert max(gaps.values()) < 1e-4, gaps


def test_the_unroll_is_not_the_eagle3_chain() -> None:
    """Negative control: the same weights without the mask (an eagle3 chain) give other logits from
    step 1 on, so the test above does see which inputs the later steps read."""
    draft = parallel_draft()
    chain = Eagle3Draft(replace(draft.config, family="eagle3", mask_token_id=None))
    chain.load_state_dict({k: v for k, v in draft.state_dict().items() if k != "mask_hidden"})
    batch = packed_batch([[9, 7]], t2d=draft.t2d)
    args = (batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"], batch["loss_mask"],
            prepare_targets(batch["target_logits"], draft.t2d))
    with torch.no_grad():
        a = family_of(draft.config).forward(draft, *args, num_steps=3, return_logits=True)
        b = family_of(chain.config).forward(chain, *args, num_steps=3, return_logits=True)
    assert torch.equal(a.logits[0], b.logits[0])
    assert (a.logits[1] - b.logits[1]).abs().max() > 1e-2


def test_training_moves_the_mask_state_and_lowers_the_loss() -> None:
    draft = parallel_draft().train()
    before = draft.mask_hidden.detach().clone()

    def mask_state_has_a_gradient() -> None:
        assert draft.mask_hidden.grad is not None and draft.mask_hidden.grad.abs().sum() > 0

    batch = packed_batch([[12, 12], [24]], t2d=draft.t2d)
    losses = train_briefly(draft, batch, after_backward=mask_state_has_a_gradient)
    assert losses[-1] < 0.8 * losses[0], losses
    assert not torch.equal(before, draft.mask_hidden.detach())
    assert trainable_parameter_count(draft.config) == sum(p.numel() for p in draft.parameters() if p.requires_grad)


def test_export_writes_vllms_keys_and_imports_back(tmp_path) -> None:
    draft = parallel_draft()
    folder = export_draft_folder(tmp_path / "d", draft.state_dict(), draft.config, (1, 2, 3), dtype="float32")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["parallel_drafting"] is True and cfg["mask_token_id"] == MASK
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    tensors = load_file(str(folder / "model.safetensors"))
    assert tensors["mask_hidden"].shape == (3 * draft.config.target_hidden_size,)
    loaded = load_draft(folder, embed_tokens_weight=draft.embed_tokens.weight)
    assert loaded.draft.config.mask_token_id == MASK
    assert torch.equal(loaded.draft.mask_hidden, draft.mask_hidden)
    for fmt in ("speculators", "sglang"):
        with pytest.raises(DraftFormatError, match="vLLM only"):
            export_draft_folder(tmp_path / fmt, draft.state_dict(), draft.config, (1, 2, 3), fmt,
                                verifier="t")
    # a checkpoint with mask_hidden but no mask_token_id is refused naming the key
    del cfg["mask_token_id"], cfg["parallel_drafting"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftFormatError, match="mask_token_id"):
        load_draft(folder)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_plain_decoding(k: int) -> None:
    target = make_target()
    decoder = SpeculativeDecoder(target, peagle_for(target), SpecConfig("chain", k=k))
    for prompt in PROMPTS:
        ref = plain(target, prompt)
        assert decoder.generate(prompt, 24).tokens == ref


@pytest.mark.parametrize("wrong", [0, 3])
def test_greedy_equals_plain_decoding_when_parallel_drafts_are_accepted(wrong: int) -> None:
    target = make_target()
    decoder = OracleDecoder(target, peagle_for(target), SpecConfig("chain", k=4), wrong=wrong)
    for prompt in PROMPTS:
        ref = plain(target, prompt, 30)
        got = decoder.generate(prompt, 30)
        assert got.tokens == ref
        assert got.stats.tau > 4.0 if wrong == 0 else 1.0 < got.stats.tau < 5.0


def test_a_parallel_draft_refuses_trees() -> None:
    target = make_target()
    with pytest.raises(ValueError, match="tree"):
        SpeculativeDecoder(target, peagle_for(target), SpecConfig("tree", k=3))


def test_sampled_generation_matches_the_target_distribution() -> None:
    assert_sampling_matches_target(SpecConfig("chain", k=2), peagle_for)


def test_the_default_mask_token() -> None:
    from types import SimpleNamespace

    from eagle3.draft.spec import DraftSpec
    from eagle3.errors import TrainError
    from eagle3.train.config import train_config
    from eagle3.train.start import mask_token_for

    class Tok(SimpleNamespace):
        def __len__(self) -> int:
            return self.size

    def target(vocab: int = 100, **tok) -> SimpleNamespace:
        fields = {"size": 100, "eos_token_id": 2, "pad_token_id": None, "unk_token_id": None, "mask_token_id": None}
        config = SimpleNamespace(eos_token_id=[2, 7])  # Llama-3's configs list several
        return SimpleNamespace(vocab_size=vocab, tokenizer=Tok(**{**fields, **tok}), config=config)

    peagle = DraftSpec(family="peagle")
    assert mask_token_for(peagle, target(mask_token_id=9, pad_token_id=5)) == 9  # the tokenizer's own mask
    assert mask_token_for(peagle, target(vocab=128, pad_token_id=5)) == 100  # the first row no token uses
    assert mask_token_for(peagle, target(pad_token_id=2, unk_token_id=0)) == 0  # pad is the eos: unk (SmolLM2)
    assert mask_token_for(peagle, target(pad_token_id=2)) == 99  # nothing else: the last id
    assert mask_token_for(peagle, target(pad_token_id=7, unk_token_id=3)) == 3  # the config's other eos
    assert mask_token_for(DraftSpec(family="dflash", mask_token_id=7), target()) == 7
    with pytest.raises(TrainError, match="mask_token_id=100"):
        mask_token_for(DraftSpec(family="peagle", mask_token_id=100), target())
    with pytest.raises(ValueError, match="train.draft.mask_token_id=3: only a peagle or dflash"):
        train_config(**{"draft.mask_token_id": 3})
    with pytest.raises(ValueError, match="train.gradient_checkpointing=true: a dflash draft"):
        train_config(**{"draft.family": "dflash"}, gradient_checkpointing=True)
    with pytest.raises(ValueError, match="train.draft.family='medusa'"):
        train_config(**{"draft.family": "medusa"})
