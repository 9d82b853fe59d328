"""Every shipped recipe composes into the typed config tree; typos fail naming the key."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

import recipes.run  # noqa: F401  (registers the schema)
from eagle3.config import TargetConfig
from eagle3.train.config import TrainConfig, updated
from recipes.config import PipelineConfig

RECIPES = Path(recipes.run.__file__).parent
TARGETS = sorted(p.stem for p in (RECIPES / "target").glob("*.yaml"))


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_recipe_composes(target: str) -> None:
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        cfg = compose(config_name="pipeline", overrides=[f"target={target}"])
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, PipelineConfig) and isinstance(config.target, TargetConfig)
    assert config.target.name_or_path


def test_default_recipe_is_the_embedded_target() -> None:
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        config = OmegaConf.to_object(compose(config_name="pipeline"))
    assert config.target.name_or_path == "smollm2-135m"
    assert config.stages == ["target", "pools", "regenerate", "harvest", "val", "train", "mine", "eval", "report"]
    assert config.select.num_prompts >= 200 and config.eval.per_set >= 10 and config.mine.rounds >= 1
    assert config.mine.store == config.train.data.store == config.harvest.out_dir
    assert config.train.data.eval_store == config.mine.eval_store == "runs/quickstart/val/harvest"
    assert config.mine.records == [config.harvest.data] and config.mine.draft == "runs/quickstart/train/final"
    assert config.train.data.store == "runs/quickstart/harvest" and config.train.out_dir == "runs/quickstart/train"
    assert isinstance(config.train, TrainConfig) and config.train.data.eval_fraction == 0  # a separate eval store
    assert config.harvest.data == "runs/quickstart/regenerate/dataset/regenerated.jsonl"
    assert config.regenerate.pool == "runs/quickstart/prompts.jsonl"
    assert config.pools.out_dir == "runs/quickstart/pools"


def test_typo_fails_at_composition_naming_the_key() -> None:
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        with pytest.raises(ConfigCompositionException, match="target.dtyp"):
            compose(config_name="pipeline", overrides=["target.dtyp=float32"])
        cfg = compose(config_name="pipeline")
    with pytest.raises(ConfigKeyError, match="nme_or_path"):
        OmegaConf.merge(cfg, {"target": {"nme_or_path": "x"}})


def test_invalid_values_fail_with_the_field_named() -> None:
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        cfg = compose(config_name="pipeline", overrides=["target.dtype=fp33"])
    with pytest.raises(ValueError, match="target.dtype='fp33'"):
        OmegaConf.to_object(cfg)
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        cfg = compose(config_name="pipeline", overrides=["target.device=tpu"])
    with pytest.raises(ValueError, match="target.device='tpu': expected auto, cpu, cuda, cuda:N or mps"):
        OmegaConf.to_object(cfg)
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        cfg = compose(config_name="pipeline", overrides=["+pools.user_files=[{path:u.jsonl,language:English}]"])
    with pytest.raises(ValueError, match="pools.user_files.language='English': expected an ISO 639 code"):
        OmegaConf.to_object(cfg)
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        with pytest.raises(ConfigCompositionException, match="train.stpes"):
            compose(config_name="pipeline", overrides=["train.stpes=3"])
        cfg = compose(config_name="pipeline", overrides=["train.zero_stage=7"])
    with pytest.raises(ValueError, match="train.zero_stage=7"):
        OmegaConf.to_object(cfg)


def test_unknown_stage_is_named() -> None:
    from recipes.pipeline import run_pipeline

    known = (r"known stages are \['size', 'target', 'pools', 'quantize', 'regenerate', 'harvest', 'train', 'val', "
             r"'mine', 'eval', 'report'\]")
    with pytest.raises(ValueError, match=r"unknown \['harvst'\]; " + known):
        run_pipeline(PipelineConfig(stages=["target", "harvst"]))


def test_a_renamed_stage_runs_under_its_new_name_with_one_line(capsys) -> None:
    config = PipelineConfig(stages=["plan", "target"])
    assert config.stages == ["size", "target"]
    assert capsys.readouterr().err == "stages: 'plan' is now called 'size'; running size\n"


# ---------------------------------------------------------------- big-target recipes, sized on meta

BIG = {"llama-3.1-8b": ([2, 16, 29], 0.40e9, 0.45e9), "qwen3-8b": ([2, 18, 33], 0.38e9, 0.42e9),
       "kimi-k2.5": ([2, 30, 58], 0.95e9, 1.05e9)}


@pytest.mark.parametrize("name", sorted(BIG))
def test_big_target_recipes_size_their_draft_on_meta(name: str) -> None:
    from eagle3.draft.model import Eagle3Draft
    from eagle3.train.size import size_draft

    with initialize_config_module(config_module="recipes", version_base="1.3"):
        config = OmegaConf.to_object(compose(config_name=name))
    assert isinstance(config, PipelineConfig) and config.train.precision == "bf16"
    assert config.regenerate.backend == config.harvest.backend == "vllm"
    plan = size_draft(config.target, config.train)  # counted on meta and by the closed form (they must agree)
    ids, low, high = BIG[name]
    assert plan["aux_layer_ids"] == ids and low < plan["trainable_parameters"] < high
    assert plan["draft"]["draft_vocab_size"] == 32000
    # the draft carries the target's positions (engines clamp a draft to its config's)
    arch = config.target.architecture.get("text_config") or config.target.architecture
    rope = dict(arch["rope_parameters"])
    assert plan["draft"]["max_position_embeddings"] == arch["max_position_embeddings"] > 32000
    assert plan["draft"]["rope_theta"] == rope.pop("rope_theta")
    assert plan["draft"]["rope_scaling"] == (None if rope["rope_type"] == "default" else rope)
    # by hand for Kimi: fc 3*7168^2, q/k/v from 2*7168 to 64*128 + 2*8*128, o, SwiGLU 3*7168*18432,
    # 4 norms of 7168, lm_head 32000*7168
    if name == "kimi-k2.5":
        h = 7168
        by_hand = 3 * h * h + 2 * h * (8192 + 2048) + 8192 * h + 3 * h * 18432 + 4 * h + 32000 * h
        assert plan["trainable_parameters"] == by_hand == 985_427_968
        assert plan["frozen_embedding_parameters"] == 163840 * h
        # the recipe's long-row setting (its header): a 32k row over 4 ranks, each reading its share and K + 1 more
        long = size_draft(config.target, updated(config.train, {"data.micro_batch_tokens": 32768,
                                                                "context_parallel": 4}))
        assert long["row"] == {"micro_batch_tokens": 32768, "context_parallel": 4,
                               "rank_rows": 8192 + config.train.ttt_steps + 1}
    with torch.device("meta"):  # the frozen embedding is not trainable
        from eagle3.draft.model import DraftConfig

        draft = Eagle3Draft(DraftConfig(**plan["draft"]))
    assert not draft.embed_tokens.weight.requires_grad


def test_architecture_mismatch_fails_naming_the_key() -> None:
    from eagle3.target.model import TargetLoadError, check_architecture

    loaded = {"hidden_size": 64, "text_config": {"num_hidden_layers": 2}}
    check_architecture(loaded, {"hidden_size": 64, "text_config": {"num_hidden_layers": 2}}, "m")
    with pytest.raises(TargetLoadError, match=r"target.architecture.text_config.num_hidden_layers=61"):
        check_architecture(loaded, {"text_config": {"num_hidden_layers": 61}}, "m")


def test_the_rope_compares_by_meaning_whatever_the_spelling() -> None:
    from eagle3.target.model import TargetLoadError, check_architecture

    yarn = {"type": "yarn", "factor": 64, "original_max_position_embeddings": 4096, "beta_fast": 32}
    legacy = {"rope_theta": 50000, "rope_scaling": yarn, "max_position_embeddings": 262144}  # transformers 4
    current = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "beta_fast": 32.0,
                                   "original_max_position_embeddings": 4096, "beta_slow": 1.0},
               "max_position_embeddings": 262144}  # transformers 5
    recipe = {"max_position_embeddings": 262144,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "beta_fast": 32.0,
                                  "original_max_position_embeddings": 4096}}
    for loaded in (legacy, current):
        check_architecture(loaded, recipe, "m")
        check_architecture({"text_config": loaded}, {"text_config": recipe}, "m")
    wrong = {**recipe, "rope_parameters": {**recipe["rope_parameters"], "factor": 32.0}}
    with pytest.raises(TargetLoadError, match=r"target.architecture.text_config.rope_parameters: factor=32.0, .* 64"):
        check_architecture({"text_config": current}, {"text_config": wrong}, "m")
    with pytest.raises(TargetLoadError, match=r"rope_parameters: rope_theta=10000.0, .* 50000"):
        check_architecture(legacy, {"rope_theta": 10000.0}, "m")
    with pytest.raises(TargetLoadError, match=r"rope_parameters: rope_type='default', .* 'yarn'"):
        check_architecture(current, {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}, "m")


@pytest.mark.parametrize("name", sorted(p.stem for p in RECIPES.glob("*.yaml")))
def test_every_top_level_recipe_composes(name: str) -> None:
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        config = OmegaConf.to_object(compose(config_name=name))
    assert isinstance(config, PipelineConfig) and config.stages
    if "mine" in config.stages:
        assert config.mine.store == config.train.data.store and config.mine.eval_store == config.train.data.eval_store


def test_draft_and_serve_groups_set_their_fields() -> None:
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        default = OmegaConf.to_object(compose(config_name="pipeline"))
        frozen = OmegaConf.to_object(compose(config_name="pipeline", overrides=["draft=frozen-head", "serve=tree"]))
        paper = OmegaConf.to_object(compose(config_name="pipeline", overrides=["draft=eagle3"]))
        big = OmegaConf.to_object(compose(config_name="llama-3.1-8b"))
    # the default is the target-head recipe (docs/training.md, "Draft recipes")
    assert (default.train.draft.variant, default.train.init.lm_head, default.train.init.freeze_lm_head,
            default.train.optim.name, default.train.optim.lr, default.eval.mode) == \
        ("speculators", "target", False, "muon", 2e-3, "chain")
    assert (frozen.train.draft.variant, frozen.train.init.lm_head, frozen.train.init.freeze_lm_head,
            frozen.train.loss.step_decay) == ("speculators", "target", True, 1.0)
    assert (frozen.eval.mode, frozen.eval.k, frozen.eval.budget) == ("tree", 4, 16)
    assert (paper.train.draft.variant, paper.train.init.lm_head, paper.train.loss.step_decay, paper.train.optim.name,
            paper.train.optim.lr, frozen.train.optim.name, frozen.train.optim.lr) == ("eagle3", "random", 0.8,
                                                                                      "adamw", 2e-3,
                                                                         "muon", 1e-3)
    # the GPU recipes keep the paper's recipe with their own learning rate
    assert (big.train.draft.variant, big.train.optim.name, big.train.optim.lr) == ("eagle3", "adamw", 1e-4)
    assert frozen.train.steps == default.train.steps == paper.train.steps  # a group touches only its own fields


@pytest.mark.parametrize("name", sorted(p.stem for p in (RECIPES / "draft").glob("*.yaml")))
def test_the_race_passes_a_draft_recipe_as_the_pipeline_applies_it(name: str) -> None:
    """bench/studies/race_speculators.py turns recipes/draft/<name>.yaml into eagle3.train.loop flags: they must
    parse to the train fields the pipeline's ``draft=<name>`` sets."""
    import importlib.util

    from eagle3.train.config import draft_recipe, setting_keys, settings_of, train_settings
    from eagle3.train.loop import build_parser

    spec = importlib.util.spec_from_file_location("race", RECIPES.parent / "bench" / "studies" / "race_speculators.py")
    race = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(race)
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        pipeline = OmegaConf.to_object(compose(config_name="pipeline", overrides=[f"draft={name}"])).train
    parsed = vars(build_parser().parse_args(["--store", "s", "--out", "o", *race.recipe_flags(name)]))
    keys = draft_recipe(name).keys()  # dotted: optim.lr
    applied = settings_of(pipeline)
    assert keys and {k: parsed[k] for k in keys} == {k: applied[k] for k in keys}
    unset = setting_keys() - set(keys) - {"data.store", "out_dir"}
    defaults = settings_of(train_settings()())  # every family's draft keys
    assert all(parsed[k] == defaults[k] for k in unset)  # nothing else moves
    assert race.recipe_flags("none") == []


def test_a_draft_recipe_with_a_key_that_is_no_train_setting_is_named(tmp_path: Path, monkeypatch) -> None:
    from eagle3.train import config

    monkeypatch.setattr(config, "DRAFT_RECIPES", tmp_path)
    (tmp_path / "typo.yaml").write_text("optim:\n  lr: 1e-3\nloss:\n  step_decy: 1.0\n")
    (tmp_path / "unset.yaml").write_text("optim:\n  lr: null\n")
    (tmp_path / "flat.yaml").write_text("step_decay: 1.0\n")  # a key of an earlier version: its new place named
    with pytest.raises(ValueError, match=r"typo\.yaml: 'loss\.step_decy' is not a train setting"):
        config.draft_recipe("typo")
    with pytest.raises(ValueError, match=r"unset\.yaml: optim\.lr=None: a draft recipe sets single values"):
        config.draft_recipe("unset")
    with pytest.raises(ValueError, match=r"flat\.yaml: train\.step_decay is now train\.loss\.step_decay$"):
        config.draft_recipe("flat")
    with pytest.raises(ValueError, match=r"draft recipe 'gone'.*known: flat, typo, unset, none"):
        config.draft_recipe("gone")


@pytest.mark.parametrize("family", ["peagle", "dflash"])
def test_the_parallel_family_recipes_plan_their_draft(family: str) -> None:
    """draft=peagle / draft=dflash on Llama-3.1-8B: counted on meta and by the closed form (size_draft
    checks they agree); P-EAGLE adds its mask state (3 x 4096) to EAGLE-3's layer, DFlash's layer reads
    H wide instead of 2H and adds q_norm/k_norm."""
    from eagle3.train.size import size_draft

    with initialize_config_module(config_module="recipes", version_base="1.3"):
        config = OmegaConf.to_object(compose(config_name="llama-3.1-8b", overrides=[f"draft={family}"]))
    assert config.train.draft.family == family
    assert config.train.draft.layers == (5 if family == "dflash" else 1)  # DFlash: five, as speculators'
    train = updated(config.train, {"draft.layers": 1})  # the arithmetic below is per layer
    plan = size_draft(config.target, train)
    eagle3 = size_draft(config.target, updated(train, {"draft.family": "eagle3", "draft.variant": "speculators"}))
    assert plan["family"] == family
    h, q, kv = 4096, 4096, 1024
    if family == "peagle":
        assert plan["trainable_parameters"] - eagle3["trainable_parameters"] == 3 * h
    else:  # q/k/v read H, not 2H; two head norms of 128 instead of input_norm (3H), hidden_norm stays
        assert plan["draft"]["block_size"] == config.train.ttt_steps + 1
        assert eagle3["trainable_parameters"] - plan["trainable_parameters"] == h * (q + 2 * kv) + 3 * h - 2 * 128


def test_sizing_from_an_architecture_without_positions_says_so(capsys) -> None:
    """A recipe's architecture without the context length or the RoPE sizes a draft with the
    defaults (2,048 positions, theta 10,000), the very config engines clamp a draft to: one line says it."""
    from eagle3.train.size import size_draft

    with initialize_config_module(config_module="recipes", version_base="1.3"):
        config = OmegaConf.to_object(compose(config_name="llama-3.1-8b"))
    size_draft(config.target, config.train)
    assert capsys.readouterr().err == ""
    arch = {k: v for k, v in config.target.architecture.items() if k not in ("max_position_embeddings",
                                                                            "rope_parameters")}
    plan = size_draft(replace(config.target, architecture=arch), config.train)
    err = capsys.readouterr().err
    assert "no max_position_embeddings or rope_parameters" in err and len(err.splitlines()) == 1
    assert plan["draft"]["max_position_embeddings"] == 2048


def test_local_ranks_split_rows_only_where_they_can() -> None:
    """On a CPU the quickstart trains on two local ranks (rows split, train.context_parallel=2); a
    draft family that does not split rows, streamed data, another launcher, training on a GPU or a
    context_parallel set by hand keep theirs; local_ranks below 1 is named."""
    def composed(*overrides: str) -> PipelineConfig:
        return OmegaConf.to_object(compose(config_name="pipeline", overrides=list(overrides)))

    with initialize_config_module(config_module="recipes", version_base="1.3"):
        if torch.cuda.is_available():
            pytest.skip("local ranks split rows on CPU training only")
        assert composed().train.context_parallel == 2
        assert composed("local_ranks=1").train.context_parallel == 1
        assert composed("draft=eagle3").train.context_parallel == 2
        assert composed("train.draft.family=dflash").train.context_parallel == 1
        assert composed("launcher=local").train.context_parallel == 1
        assert composed("train.context_parallel=3").train.context_parallel == 3
        hybrid = composed("train.data.mode=hybrid", "train.data.shard_window=2", "stages=[train]")
        assert hybrid.train.context_parallel == 1
        assert composed("train.device=cuda").train.context_parallel == 1  # GPUs: a launcher's ranks, one each
        with pytest.raises(Exception, match="local_ranks=0: must be >= 1"):
            composed("local_ranks=0")
