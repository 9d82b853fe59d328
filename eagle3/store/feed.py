"""What the trainer asks of the store it reads, whatever the data mode: the seam between the
trainer and where the hidden states come from.

    offline     a finished shard store (``eagle3.store.shards.HarvestStore``, or several: ``StoreUnion``)
    online      the spool the producers fill, read as they commit (``eagle3.store.spool.SpoolStore``)
    hybrid      online for the first epoch, whose shards become a store every later epoch reads
    co-located  the trainer's own target computes each micro-batch's states (``eagle3.store.colocated``)

Every store offers the samples (``len``, ``lengths``, ``sample_ids``, ``shard_of``, ``spec``,
``read``, ``token_columns``, ``token_digests``, ``check_target``: declared below) and the hooks below, whose defaults
are an offline store's: the trainer calls them at the same points for every mode and never asks
which mode it reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar


class StoreFeed:
    """The samples a store offers the trainer, and the trainer's hooks into it (defaults: a finished
    store on disk, which needs none)."""

    spec: Any
    """What harvested the samples (:class:`eagle3.store.shards.HarvestSpec`: target, aux layers, ..)."""
    lengths: Sequence[int]
    """Each sample's tokens, by index."""
    sample_ids: Sequence[str]
    """Each sample's id, by index."""
    shard_of: Sequence[int]
    """Each sample's shard, by index (the order shard windows read in)."""
    computes_states: ClassVar[bool] = False
    """The store computes each micro-batch's states with the run's own target (which it needs whole, on
    the rank's device; :meth:`attach`), instead of reading them."""

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> Any:
        """Sample ``i`` (:class:`eagle3.store.shards.Sample`), its states in fp32."""
        raise NotImplementedError

    def read(self, i: int, stored: bool = False) -> Any:
        """Sample ``i``; ``stored``: its states in the dtype the store keeps them in, where it keeps
        another (by default the same as ``store[i]``)."""
        return self[i]

    def token_columns(self, i: int) -> tuple[Any, Any]:
        """Sample ``i``'s (input_ids [T] int64, loss_mask [T] bool), without reading a state (the draft
        vocabulary counts them)."""
        raise NotImplementedError

    def token_digests(self) -> list[bytes]:
        """One digest of each sample's tokens (a held-out store less the conversations both hold)."""
        raise NotImplementedError

    def check_target(self, target: Any) -> None:
        """Refuse a target other than the one that harvested the samples, naming the key."""
        raise NotImplementedError

    def verified_files(self) -> list[str]:
        """The store folders whose files are checked against their checksums before training (a store
        read as it is written checks each shard as it reads it: none)."""
        return []

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
