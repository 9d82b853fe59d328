"""Draft families: one module each (``eagle3.py``, ``peagle.py``, ``dflash.py``) behind the one
interface of :mod:`eagle3.draft.families.base`, which the trainer, the serving loop, the exporter and the
planner ask instead of branching on a family's name ([docs/families.md](../../../docs/families.md))."""

# the built-in families register themselves, in the order users meet them
# isort: off
from eagle3.draft.families import eagle3  # noqa: F401
from eagle3.draft.families import peagle  # noqa: F401
from eagle3.draft.families import dflash  # noqa: F401
# isort: on
from eagle3.draft.families.base import (
    ENTRY_POINTS,
    DraftFamily,
    Proposal,
    Proposer,
    family_names,
    family_of,
    family_reading,
    get_family,
    parameter_count,
    register,
    vllm_speculative_config,
)

__all__ = ["ENTRY_POINTS", "DraftFamily", "Proposal", "Proposer", "family_names", "family_of", "family_reading",
           "get_family", "parameter_count", "register", "vllm_speculative_config"]
