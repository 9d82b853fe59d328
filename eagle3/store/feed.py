"""What the trainer asks of the store it reads, whatever the data mode: the seam between the
trainer and where the hidden states come from.

    offline     a finished shard store (``eagle3.store.shards.HarvestStore``, or several: ``StoreUnion``)
    online      the spool the producers fill, read as they commit (``eagle3.store.spool.SpoolStore``)
    hybrid      online for the first epoch, whose shards become a store every later epoch reads
    co-located  the trainer's own target computes each micro-batch's states (``eagle3.store.colocated``)

Every store offers the samples (``len``, ``lengths``, ``sample_ids``, ``shard_of``, ``spec``,
``store[i]``) and the hooks below, whose defaults are an offline store's: the trainer calls them at
the same points for every mode and never asks which mode it reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar


class StoreFeed:
    """The trainer's hooks into a store (defaults: a finished store on disk, which needs none)."""

    reads_ahead: ClassVar[bool] = True
    """Batches may be read ahead on a thread (a store of files; not one that streams or computes its states)."""
    saves_early: ClassVar[bool] = False
    """The store may ask for a checkpoint before ``train.save_every`` (:meth:`needs_save`)."""

    def attach(self, target: Any) -> None:
        """The run's target, checked against the store's spec (a store that captures its own states keeps it)."""

    def begin_epoch(self, epoch: int) -> None:
        """The trainer starts epoch ``epoch`` (its plan made)."""

    def needs_save(self) -> bool:
        """This rank's reads since the last checkpoint ask for one now (the trainer agrees over the ranks)."""
        return False

    def after_checkpoint(self, remaining: Sequence[Sequence[int]], *, leader: bool) -> None:
        """A checkpoint was saved; ``remaining``: the epoch's micro-batches still to read (a resume starts
        there). ``leader``: this rank acts for all of them (deletes what no rank needs)."""

    def finish(self) -> None:
        """The run is over (called on one rank, also when a resumed run finds nothing left to do)."""

    def summary(self) -> dict[str, Any]:
        """What the run's summary says of where the states came from."""
        return {}

    def identity(self) -> list[str]:
        """One digest per shard: what a resumed run must read again (pinned in its checkpoints)."""
        raise NotImplementedError


__all__ = ["StoreFeed"]
