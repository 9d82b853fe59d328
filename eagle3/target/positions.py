"""How a target's config states its positions: the context length and the RoPE (theta and
scaling), read from a config.json's keys as transformers and vLLM read them, whichever of the
spellings a model or a transformers version uses (``rope_parameters`` or ``rope_scaling`` and
``rope_theta``; ``type`` or ``rope_type``). The draft takes these from its target (the RoPE it
computes: :mod:`eagle3.draft.rope`)."""

from __future__ import annotations

from typing import Any

ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")
"""A config's keys that state its RoPE, in any of their spellings."""


def as_dict(config: Any) -> dict[str, Any]:
    """A config (a transformers config, a namespace or a dict) as a plain dict of its keys."""
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(vars(config))


def rope_kind(scaling: dict[str, Any] | None) -> str:
    """A RoPE scaling dict's type (``rope_type``, or the older ``type``); default when unset."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def read_rope(config: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(theta, scaling dict) from a config.json's keys, read as transformers and vLLM read them:
    ``rope_parameters`` or ``rope_scaling``; per-layer-type dicts (Gemma 3's
    ``{"full_attention": .., "sliding_attention": ..}``) give the full-attention layers' RoPE; for
    llama3 / yarn / longrope a top-level ``original_max_position_embeddings`` wins over the dict's,
    and ``max_position_embeddings`` fills it in when neither has one; a top-level
    ``partial_rotary_factor`` goes into the dict."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = rope["full_attention"]
    rope = dict(rope)
    theta = rope.pop("rope_theta", None) or config.get("rope_theta") or 10000.0  # as written: callers check it
    if config.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    if rope_kind(rope) in ("llama3", "yarn", "longrope"):
        if config.get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        elif config.get("max_position_embeddings") is not None:
            rope.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return theta, rope


def context_length(config: Any) -> int | None:
    """How many positions the target attends over (``max_position_embeddings`` of its text config),
    or None where the config does not say."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def rope_difference(config: Any, expected: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """Where ``config``'s RoPE differs from what ``expected`` states of it (its ``ROPE_KEYS``, in
    any spelling): ``(key, expected value, config's value)``, key ``rope_theta``, ``rope_type`` or a
    scaling key (``factor``, ...); None when all agree. Only what ``expected`` writes is compared
    (theta where it gives one); numbers compare as numbers."""
    stated = {k: v for k, v in expected.items() if k in ROPE_KEYS}
    if not stated:
        return None
    want_theta, want = read_rope(stated)
    have_theta, have = read_rope(as_dict(config))
    theta_given = "rope_theta" in stated or any("rope_theta" in (stated.get(k) or {})
                                                 for k in ("rope_parameters", "rope_scaling"))
    if theta_given and not _same(want_theta, have_theta):
        return "rope_theta", want_theta, have_theta
    if rope_kind(want) != rope_kind(have):
        return "rope_type", rope_kind(want), rope_kind(have)
    for key, value in want.items():
        if key not in ("type", "rope_type") and not _same(value, have.get(key)):
            return key, value, have.get(key)
    return None


def _same(a: Any, b: Any) -> bool:
    numbers = isinstance(a, int | float) and isinstance(b, int | float)
    return float(a) == float(b) if numbers else a == b


__all__ = ["ROPE_KEYS", "as_dict", "context_length", "read_rope", "rope_difference", "rope_kind"]
