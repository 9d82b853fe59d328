"""Draft families: one module each, behind one interface the rest of the project asks (the
interface and the registry; :mod:`eagle3.draft.families` registers the built-in families).

A family is what differs between EAGLE-3, P-EAGLE and DFlash drafts, and only that: how its draft
is built and shaped from its spec (:class:`eagle3.draft.spec.DraftSpec`), its training forward, the serving
proposer that drafts each round, and the engine config it is exported with. The trainer, the serving loop, the
exporter and the planner ask :func:`family_of` (a draft config's family) or :func:`get_family`
(a name from ``train.draft.family``) instead of branching on names.

Adding a family is one new module that subclasses :class:`DraftFamily` and calls :func:`register`,
plus its recipe and tests (``docs/families.md`` shows the diff for a fourth); a package outside this
one registers its families through the ``eagle3_forge.draft_families`` entry points.

Names the interface uses (``K`` draft tokens per round, ``V`` the target vocabulary, ``Vd`` the
draft's)::

    build(config, embed)            -> the draft module (a DraftHead)
    forward(draft, ..)              -> TTTOutput: loss, matches and counts per step (training)
    proposer(draft, cache, spec)    -> Proposer: each round's K tokens from the rows the target verified
    engine_config(config, ids, ..)  -> the config.json an engine serves it from
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from eagle3.draft.spec import DraftSpec
from eagle3.errors import ConfigError, TrainError

if TYPE_CHECKING:
    from eagle3.config import SamplingConfig
    from eagle3.draft.model import DraftConfig, DraftHead
    from eagle3.draft.ttt import TTTOutput


@dataclass
class Proposal:
    """One round's draft: ``tokens`` (target ids), each one's parent node (-1: the root; a chain is
    -1, 0, 1, ..), when sampled the distribution each was drawn from, ``qs`` [N, V], and the draft's
    own probability of its first token (``first_p``: at temperature 1; a tree's best root child), which
    a serving policy may weigh other proposals against."""

    tokens: list[int]
    parents: list[int]
    qs: Tensor | None = None
    first_p: float | None = None


class Proposer:
    """The serving side of a family. The loop hands it, each round that speculates, the rows the
    target verified since the last proposal (their aux states and the token after each) and asks
    for ``k`` draft tokens; after verification it rolls the draft cache back to the verified rows.

    ``cache`` is the draft's own KV cache: :class:`eagle3.draft.model.DraftKV` (dynamic), or a static one
    with the same methods (``serve_eval.static_cache.StaticDraftKV``) when the family replays its
    steps under CUDA graphs (:attr:`DraftFamily.replays_steps`)."""

    one_forward: ClassVar[bool] = False
    """One draft forward proposes the whole round (the cost model times that forward, not a step)."""

    def __init__(self, draft: Any, cache: Any, spec: Any) -> None:
        self.draft, self.cache, self.spec = draft, cache, spec
        self.device = draft.fc.weight.device

    def start(self, slots: int) -> Any:
        """A new generation: the draft cache emptied, for up to ``slots`` rows; returns it."""
        return self.cache.start(slots)

    def propose(self, aux: Tensor, tokens: list[int], start: int, k: int, params: SamplingConfig,
                g: torch.Generator | None) -> Proposal:
        """Catch up on rows ``start..`` (aux [1, R, A, H_t], ``tokens`` the token after each row),
        then ``k`` >= 1 draft tokens after the newest one."""
        raise NotImplementedError

    def catch_up(self, aux: Tensor, tokens: list[int], start: int) -> tuple[Tensor, Tensor]:
        """Step-by-step families: rows ``start..`` through the draft -> the root's state and logits
        (the cost model's warm-up before it times :meth:`step`)."""
        raise NotImplementedError

    def step(self, token: int, state: Tensor, position: int) -> tuple[Tensor, Tensor]:
        """Step-by-step families: one draft step over the cache (the cost model times it)."""
        raise NotImplementedError

    def proposal_logits(self, aux: Tensor, tokens: list[int], start: int, k: int) -> Tensor:
        """One-forward families: the catch-up and the round's one forward -> the k draft tokens'
        logits [k, Vd] (what :meth:`propose` draws from; the cost model times this)."""
        raise NotImplementedError

    def rollback(self, rows: int) -> None:
        """After verification: keep the draft cache's first ``rows`` rows (the verified ones)."""
        self.cache.truncate(rows)

    # -- helpers every family's proposer uses

    def target_logits(self, logits: Tensor) -> Tensor:
        """Draft-vocab logits [.., Vd] -> target-vocab logits [.., V] (-inf outside the draft vocab)."""
        out = logits.new_full((*logits.shape[:-1], self.draft.config.vocab_size), float("-inf"))
        out[..., self.draft.draft_to_target_ids(torch.arange(logits.shape[-1], device=logits.device))] = logits
        return out

    def draw(self, logits: Tensor, params: SamplingConfig, g: torch.Generator | None) -> tuple[int, Tensor | None]:
        """One draft token from one row's draft-vocab logits [Vd] -> (its target id, the distribution
        [V] it was drawn from when sampling, else None)."""
        full = self.target_logits(logits)  # [V]
        if params.greedy:
            return int(full.argmax()), None
        q = torch.softmax(full.float() / params.temperature, dim=-1)
        return int(torch.multinomial(q, 1, generator=g)), q

    def draw_each(self, logits: Tensor, params: SamplingConfig, g: torch.Generator | None) -> Proposal:
        """A chain drawn from one forward's rows, logits [k, Vd], each token on its own (a proposal need
        not depend on the earlier draft tokens to stay lossless: verification only needs the
        distribution each token was drawn from)."""
        full = self.target_logits(logits)  # [k, V]
        if params.greedy:
            tokens, qs = full.argmax(-1).tolist(), None
        else:
            qs = torch.softmax(full.float() / params.temperature, dim=-1)  # [k, V]
            tokens = torch.multinomial(qs, 1, generator=g)[:, 0].tolist()
        return Proposal(tokens, list(range(-1, len(tokens) - 1)), qs, self.probability(full[0], tokens[0]))

    @staticmethod
    def probability(full: Tensor, token: int) -> float:
        """The draft's probability of ``token`` (temperature 1) from one row's target-vocab logits [V]."""
        return float(torch.softmax(full.float(), dim=-1)[token])


class DraftFamily:
    """What a draft family provides; subclass it in the family's own module and :func:`register` it."""

    name: ClassVar[str]
    reads_mask_token: ClassVar[bool] = False
    """Trains and serves with a mask token (``train.draft.mask_token_id``, chosen from the tokenizer if unset)."""
    replays_steps: ClassVar[bool] = False
    """Its serving steps replay over a static draft cache under CUDA graphs (``target_cache=graphs``)."""
    architectures: ClassVar[tuple[str, ...]] = ()
    """config.json ``architectures`` of a folder in this family's own layout, which :meth:`load_folder`
    reads; none: the EAGLE-3 formats' reader (:func:`eagle3.export.load_draft`) reads its folders."""

    # -- settings

    spec_class: ClassVar[type[DraftSpec]] = DraftSpec
    """The class of this family's ``train.draft`` section: :class:`DraftSpec`, or a subclass with the
    family's own fields (a DFlash draft's block size)."""
    splits_rows: ClassVar[bool] = True
    """Trains a row split over ranks (``train.context_parallel`` > 1)."""
    recomputes_steps: ClassVar[bool] = True
    """Its training unroll can recompute step by step in backward (``train.gradient_checkpointing``)."""
    starts_from_readout: ClassVar[bool] = True
    """Its layers can start as the target's readout (``train.init.layers=readout``)."""

    def check_spec(self, spec: DraftSpec) -> None:
        """Refuse a draft spec this family cannot honour (a ConfigError naming the key)."""
        if spec.mask_token_id is not None and not self.reads_mask_token:
            readers = [name for name, family in _FAMILIES.items() if family.reads_mask_token]
            raise ConfigError(f"train.draft.mask_token_id={spec.mask_token_id}: only a {' or '.join(readers)} draft "
                             "reads a mask token")

    def shape(self, spec: DraftSpec, steps: int) -> dict[str, Any]:
        """Draft-config fields this family sets from the spec and the tokens a round drafts (beyond the
        common shape)."""
        return {}

    # -- the draft

    def check_config(self, config: DraftConfig) -> None:
        """Refuse a draft config this family cannot build (a ConfigError naming the field)."""

    def config_fields(self, mask_token_id: int | None, spec: DraftSpec, steps: int) -> dict[str, Any]:
        """The family's own draft-config fields: its name and mask token (None when it reads none)."""
        return {"family": self.name, "mask_token_id": mask_token_id if self.reads_mask_token else None,
                **self.shape(spec, steps)}

    def build(self, config: DraftConfig, embed_tokens_weight: Tensor | None = None) -> DraftHead:
        raise NotImplementedError

    def parameter_count(self, config: DraftConfig) -> int:
        """Trainable parameters in closed form (the planner checks it against a model on the meta device)."""
        raise NotImplementedError

    def adopt(self, draft: DraftHead, source: str, mask_token_id: int | None, steps: int) -> DraftHead:
        """The draft of ``source`` (``train.init.draft``) as this family's starting point, drafting ``steps``
        tokens a round (the same draft by default); a draft of another family is refused naming
        ``train.draft.family``."""
        if draft.config.family != self.name:
            raise TrainError(f"train.init.draft: {source} is a {draft.config.family} draft; set "
                             f"train.draft.family={draft.config.family}")
        return draft

    # -- training and serving

    def forward(self, draft: Any, *args: Any, **kwargs: Any) -> TTTOutput:
        """The training forward: :func:`eagle3.draft.ttt.ttt_forward`'s inputs and output."""
        raise NotImplementedError

    def proposer(self, draft: Any, cache: Any, spec: Any) -> Proposer:
        """The serving proposer for ``spec`` (``serve_eval.config.SpecConfig``: mode, k, topk, budget);
        refuses (ConfigError) what this family cannot propose."""
        raise NotImplementedError

    # -- export and import

    def load_folder(self, folder: Path, cfg: dict[str, Any], tensors: dict[str, Tensor],
                    embed_tokens_weight: Tensor | None) -> Any:
        """A folder in this family's own layout (:attr:`architectures`; ``tensors`` as saved) ->
        :class:`eagle3.export.LoadedDraft`. By default the draft config and aux layer ids of our
        ``draft.json`` beside it, which every export of ours writes."""
        from eagle3.draft.formats import OUR_META, DraftFormatError, LoadedDraft, fill_draft, our_meta

        meta = our_meta(folder)
        if "draft_config" not in meta or "aux_layer_ids" not in meta:
            raise DraftFormatError(f"{folder}: a {self.name} folder needs its draft.json (draft_config, aux_layer_ids)")
        from eagle3.draft.model import DraftConfig

        try:
            config = DraftConfig(**meta["draft_config"])
            self.check_config(config)
        except (TypeError, ValueError) as err:
            raise DraftFormatError(f"{folder / OUR_META}: draft_config: {err}") from None
        draft = self.build(config, None if "embed_tokens.weight" in tensors else embed_tokens_weight)
        d2t, t2d = tensors.pop("d2t").long(), tensors.pop("t2d").bool()
        fill_draft(draft, tensors, d2t, t2d, folder)
        return LoadedDraft(draft=draft, aux_layer_ids=tuple(meta["aux_layer_ids"]), format="vllm", path=folder,
                           meta=meta, has_embedding="embed_tokens.weight" in tensors,
                           has_lm_head="lm_head.weight" in tensors)

    def engine_config(self, config: DraftConfig, aux_layer_ids: Any, fmt: str, dtype: str,
                      **speculators: Any) -> dict[str, Any]:
        """config.json of the draft in engine format ``fmt`` (vllm, sglang, speculators)."""
        raise NotImplementedError

    def vllm_speculative_config(self, engine_cfg: dict[str, Any], k: int) -> dict[str, Any] | None:
        """vLLM's ``speculative_config`` keys (beyond ``model``) that serve a draft folder of this family
        (``engine_cfg``: its config.json, ours or speculators') at ``k`` draft tokens a round; None: not a
        folder of this family."""
        return None

    def vllm_only(self, config: DraftConfig, fmt: str) -> None:
        """Refuse an engine format other than vLLM's, for a family only vLLM serves."""
        if fmt != "vllm":
            from eagle3.draft.formats import DraftFormatError

            raise DraftFormatError(f"a {self.name} draft (mask_token_id={config.mask_token_id}) is served by vLLM "
                                   f"only, from the vllm format; the {fmt} format has no keys for it")


_FAMILIES: dict[str, DraftFamily] = {}


def register(family: DraftFamily) -> DraftFamily:
    """Make ``family`` known by its name (a later registration of the same name replaces it)."""
    _FAMILIES[family.name] = family
    return family


ENTRY_POINTS = "eagle3_forge.draft_families"
"""The entry-point group through which an installed package adds families: each entry names a
module that calls :func:`register` when imported (read once, when a name is not known)."""


def get_family(name: str, key: str = "draft.family") -> DraftFamily:
    """The family named ``name``; a ConfigError naming ``key`` and the known ones otherwise."""
    if name not in _FAMILIES:
        load_plugins()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ConfigError(f"{key}={name!r}: expected one of {', '.join(_FAMILIES)}") from None


def load_plugins() -> None:
    """Import every installed package's families (:data:`ENTRY_POINTS`), which register themselves."""
    from importlib import import_module
    from importlib.metadata import entry_points

    for entry in entry_points(group=ENTRY_POINTS):
        import_module(entry.value.split(":")[0])


def family_names() -> list[str]:
    return list(_FAMILIES)


def family_reading(architectures: list[str]) -> DraftFamily | None:
    """The family whose own folder layout has one of these ``architectures`` (None: an EAGLE-3 format)."""
    return next((f for f in _FAMILIES.values() if set(f.architectures) & set(architectures)), None)


def vllm_speculative_config(engine_cfg: dict[str, Any], k: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` keys for a draft folder's config.json, from the family that reads
    it (eagle3, the plain layout, last)."""
    for family in sorted(_FAMILIES.values(), key=lambda f: f.name == "eagle3"):
        if (keys := family.vllm_speculative_config(engine_cfg, k)) is not None:
            return keys
    raise ConfigError(f"no draft family serves a folder with architectures={engine_cfg.get('architectures')} in vLLM")


def family_of(config: DraftConfig) -> DraftFamily:
    """The family of a draft config (``config.family``), which checks the config fits it."""
    family = get_family(config.family)
    family.check_config(config)
    return family


def parameter_count(config: DraftConfig) -> int:
    """Trainable parameters of a draft of this config, in closed form (its family's count)."""
    return family_of(config).parameter_count(config)


__all__ = ["ENTRY_POINTS", "DraftFamily", "Proposal", "Proposer", "family_names", "family_of",
           "family_reading", "get_family", "parameter_count", "register", "vllm_speculative_config"]
