"""Where a fresh draft starts: each channel of what ``fc`` reads at unit RMS (every family and
variant, the factor held where the served draft applies it), and the copied head's scale fitted on
the first micro-batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data_gen.config import HarvestConfig
from data_gen.harvest import run as harvest
from eagle3.config import TargetConfig
from eagle3.draft.model import DraftConfig
from eagle3.errors import TrainError
from eagle3.store.shards import HarvestStore
from eagle3.target.model import Target
from eagle3.train.config import draft_recipe, train_config
from eagle3.train.loop import train
from tests.helpers import (
    TARGET_HIDDEN,
    TINY_VOCAB,
    lively_target,
    regenerated_data,
    sharpen,
    tiny_draft,
    tiny_tokenizer,
)

VARIANTS = {
    "eagle3": {},
    "speculators": {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
    "peagle": {"mask_token_id": 3},
    "dflash": {"block_size": 4, "mask_token_id": 3, "family": "dflash"},
}


def massive_states(n: int = 400, seed: int = 0) -> torch.Tensor:
    """[n, 3, H_t] aux states as a trained target has them: layers of very different scale, and in
    each a few channels carrying nearly all the energy."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(n, 3, TARGET_HIDDEN, generator=g) * torch.tensor([1.0, 5.0, 40.0]).view(1, 3, 1)
    aux[:, :, 7] += 3000.0 * (1 + 0.01 * torch.randn(n, 3, generator=g))  # a massive, nearly constant channel
    aux[:, 2, 11] *= 80.0
    return aux


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_channel_fc_reads_starts_at_unit_rms(variant: str) -> None:
    draft = tiny_draft(**VARIANTS[variant])
    aux = massive_states()
    before = draft.fc_input(aux).pow(2).mean(0).sqrt()
    assert before.max() / before.min() > 1e3  # the massive channel dwarfs the others
    fc_before = draft.fc.weight.detach().clone()
    factor = draft.scale_aux_inputs(aux)
    assert factor.shape == (3 * TARGET_HIDDEN,)
    read = draft.fc_input(aux).pow(2).mean(0).sqrt() * (draft.fc.weight.detach() / fc_before)[0]
    assert torch.allclose(read, torch.ones_like(read), rtol=1e-3)  # what fc reads, at unit RMS
    fresh = draft.fc_input(massive_states(seed=1)).pow(2).mean(0).sqrt() * (draft.fc.weight.detach() / fc_before)[0]
    assert fresh.max() / fresh.min() < 2  # and on other states of the same target
    if variant in ("speculators", "eagle3.1"):
        assert torch.equal(draft.fc.weight.detach(), fc_before)  # held in the norm before fc, fc untouched
    if variant == "peagle":  # the mask state is a typical state, not N(0, 1) before the scaling
        mask = draft.fc_input(draft.mask_hidden.detach().view(1, 3, -1))[0] / fc_before[0] * draft.fc.weight[0]
        assert 0.2 < float(mask.detach().pow(2).mean().sqrt()) < 5


def test_states_already_at_unit_rms_leave_the_draft_as_it_is() -> None:
    """States already at unit RMS per channel: the factor is ~1 and the draft is unchanged."""
    draft = tiny_draft()
    config: DraftConfig = draft.config
    aux = torch.randn(4000, 3, config.target_hidden_size, generator=torch.Generator().manual_seed(0))
    aux = aux / aux.pow(2).mean(0).sqrt()
    state = {k: v.clone() for k, v in draft.state_dict().items()}
    factor = draft.scale_aux_inputs(aux)
    assert torch.allclose(factor, torch.ones_like(factor), atol=1e-5)
    for k, v in draft.state_dict().items():
        assert torch.allclose(v, state[k], atol=1e-5), k


def massive_gemma3() -> Target:
    """A tiny random Gemma-3 text target (tied, scaled embeddings, norms stored as offsets) with what a
    trained Gemma-3-270M has and a random init lacks: two channels every token carries (its aux
    states' energy is ~98% in a few channels) and a final norm scaling channels by 1 to ~30 (the
    real one: 0.2 to 301)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    model = sharpen(Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)).eval())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 5] = 50.0  # the residual stream carries these to every layer
        model.model.embed_tokens.weight[:, 9] = -25.0
        model.model.norm.weight.copy_(torch.rand(64, generator=g) ** 4 * 30)
    return Target(model, tiny_tokenizer(), aux_layer_ids=(1, 2, 4), name="gemma")


def test_the_default_recipe_learns_on_a_gemma_like_target_from_the_fitted_start(tmp_path: Path) -> None:
    """The default recipe (target-head) on a target with massive channels and a sharp final norm: from
    the copied head the draft does not learn in 40 steps (held-out tau_sim stays ~1: the real
    Gemma-3-270M's 1.012); from the start fitted on the first micro-batch it does. The fitted start
    is in the summary, and a resumed run keeps the setting (pinned)."""
    target = massive_gemma3()
    store = tmp_path / "store"
    harvest(HarvestConfig(data=str(regenerated_data(tmp_path / "data.jsonl", 40, turns=3)), out_dir=str(store),
                          dtype="float32"), TargetConfig(name_or_path="gemma"), target=target, progress=False)
    aux = torch.cat([HarvestStore(store)[i].aux for i in range(4)])  # [T, A, H]
    energy = aux.pow(2).mean(0)  # [A, H]
    assert float((energy.topk(2, dim=-1).values.sum(-1) / energy.sum(-1)).min()) > 0.9  # massive channels
    base = {**draft_recipe("target-head"), **{"data.store": str(store), "steps": 40, "data.micro_batch_tokens": 256,
                                              "optim.warmup_steps": 2, "data.eval_fraction": 0.2, "eval_every": 40,
                                              "save_every": 20, "draft.vocab_size": 64, "log.wandb_mode": "disabled",
                                              "log.progress": False, "device": "cpu"}}

    def run(out: str, **start: str) -> dict:
        return train(train_config({**base, "out_dir": str(tmp_path / out), **start}), target=target)

    copied = run("copied", **{"init.aux_scale": "none", "init.head_scale": "one"})
    fitted = run("fitted", **{"init.aux_scale": "auto", "init.head_scale": "auto"})  # the recipe's setting
    assert copied["eval_last"]["eval/tau_sim"] < 1.1
    assert fitted["eval_last"]["eval/tau_sim"] > 1.5
    assert fitted["start"]["logit_std"]["refit"] is True  # the copied head far sharper than the target's
    assert fitted["start"]["head_scale"] < 0.1 and fitted["start"]["aux_scale"]["max"] > 10
    assert fitted["first_loss"] < copied["first_loss"] / 5
    base["steps"] = 60
    with pytest.raises(TrainError, match="train.init.head_scale"):
        run("fitted", **{"init.aux_scale": "auto", "init.head_scale": "one"})


def test_auto_keeps_a_copied_start_that_is_not_too_sharp(tmp_path: Path) -> None:
    """On a target whose copied head is about as sharp on the untrained draft as on its own states,
    ``auto`` probes and keeps the copy: the run equals one with the copy, bit for bit."""
    target = lively_target()
    store = tmp_path / "store"
    harvest(HarvestConfig(data=str(regenerated_data(tmp_path / "data.jsonl", 12, turns=2)), out_dir=str(store),
                          dtype="float32"), TargetConfig(name_or_path="lively"), target=target, progress=False)
    base = {**draft_recipe("target-head"), **{"data.store": str(store), "steps": 4, "data.micro_batch_tokens": 256,
                                              "optim.warmup_steps": 2, "data.eval_fraction": 0.0, "eval_every": 0,
                                              "save_every": 0, "draft.vocab_size": 64, "log.wandb_mode": "disabled",
                                              "log.progress": False, "device": "cpu"}}
    runs = {}
    for name, start in {"copied": ("none", "one"), "auto": ("auto", "auto")}.items():
        runs[name] = train(train_config({**base, "out_dir": str(tmp_path / name), "init.aux_scale": start[0],
                                          "init.head_scale": start[1]}), target=target)
    assert runs["auto"]["start"]["logit_std"]["refit"] is False and "head_scale" not in runs["auto"]["start"]
    assert ((tmp_path / "auto" / "final" / "model.safetensors").read_bytes()
            == (tmp_path / "copied" / "final" / "model.safetensors").read_bytes())
