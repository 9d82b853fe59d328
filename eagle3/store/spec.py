"""Where the trainer's samples come from and how they are batched (:class:`StoreSpec`, the trainer's
``train.data`` section): the stores, the data mode, the spool's and producers' timers, the
windows and the micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle3.errors import ConfigError

MODES = ("offline", "online", "hybrid", "colocated")
KEY = "train.data"


@dataclass
class StoreSpec:
    """The training data (``train.data.*``)."""

    store: str = ""
    """Training harvest store (a folder with manifest.json), checked against the target."""
    extra_stores: list[str] = field(default_factory=list)
    """More stores of the same target and layers, trained on with ``store`` as one (e.g. what
    mining rounds appended); the held-out split by sample id covers them too."""
    sample_weights: str | None = None
    """A JSON file ``{sample_id: weight}``: each epoch a sample is seen floor(w) times, plus once
    with probability frac(w) (drawn per seed, epoch and id); unlisted samples weigh 1. Mining's
    oversampling of weak domains."""
    eval_store: str | None = None
    """Held-out harvest store for evaluation (None: hold out ``eval_fraction`` of ``store``)."""
    eval_fraction: float = 0.0
    """Without ``eval_store``: the share of the store's samples held out for eval, chosen by a
    hash of each sample id (the same split in every run); 0 means no eval."""
    mode: str = "offline"
    """offline: ``store`` is a harvest store; online: ``store`` is a spool that producers
    (python -m data_gen.produce, same seed) fill while this run trains, a window of shards at a
    time (needs shard_window >= 1 and eval_fraction 0: held-out data comes from eval_store);
    hybrid: online for the first epoch (producers with --max-epochs 1), whose shards are kept as a
    harvest store in the spool's folder that later epochs (and mining) read offline; colocated:
    ``store`` is a plan without states (python -m data_gen.produce --max-epochs 0) and this
    run's own target computes each micro-batch's states (targets that fit beside the draft)."""
    micro_batch_tokens: int = 2048
    """Tokens per micro-batch per rank: one packed row, or one padded bucket."""
    batching: str = "pack"
    """pack: documents concatenated into rows of ``micro_batch_tokens`` (attention never crosses
    a document); buckets: similar lengths padded together."""
    shard_window: int = 0
    """Sample order: 0 shuffles the whole training set each epoch; N > 0 shuffles the store's
    shards and batches N consecutive shards at a time (each shard needed only while its window
    trains: the order online training reads its spool in)."""
    spool_wait_s: float = 600.0
    """online/hybrid: how long the trainer waits for a shard (or the first producer) before it stops."""
    producer_stale_s: float = 120.0
    """online/hybrid: a producer on another host whose heartbeat is older than this counts as lost
    (on the trainer's own host a producer's pid tells at once)."""
    producer_grace_s: float = 30.0
    """online/hybrid: how long the trainer waits, after naming a lost producer in its log, for a
    restarted one (on any host) before it stops; a producer restarted meanwhile carries on the run."""

    def __post_init__(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ConfigError(f"{KEY}.micro_batch_tokens={self.micro_batch_tokens}: must be >= 1")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"{KEY}.eval_fraction={self.eval_fraction}: must be in [0, 1)")
        if self.eval_store is not None and self.eval_fraction > 0:
            raise ConfigError(f"{KEY}.eval_fraction={self.eval_fraction}: set it or eval_store, not both")
        if self.mode not in MODES:
            raise ConfigError(f"{KEY}.mode={self.mode!r}: expected {', '.join(MODES)}")
        if self.mode == "colocated" and self.extra_stores:
            raise ConfigError(f"{KEY}.mode=colocated computes the states of {KEY}.store's plan: no {KEY}.extra_stores")
        if self.streams and (self.shard_window < 1 or self.eval_fraction > 0 or self.extra_stores):
            raise ConfigError(f"{KEY}.mode={self.mode} reads its spool a window of shards at a time: it needs "
                              f"{KEY}.shard_window >= 1, {KEY}.eval_fraction=0 (held-out data: {KEY}.eval_store) and "
                              f"no {KEY}.extra_stores")
        if self.shard_window < 0:
            raise ConfigError(f"{KEY}.shard_window={self.shard_window}: must be >= 0 (0: the whole set shuffled)")
        if self.batching not in ("pack", "buckets"):
            raise ConfigError(f"{KEY}.batching={self.batching!r}: expected pack or buckets")
        for name in ("spool_wait_s", "producer_grace_s"):  # 0: do not wait
            if getattr(self, name) < 0:
                raise ConfigError(f"{KEY}.{name}={getattr(self, name)}: must be >= 0 (seconds)")
        if self.producer_stale_s <= 0:
            raise ConfigError(f"{KEY}.producer_stale_s={self.producer_stale_s}: must be > 0 (seconds)")

    @property
    def streams(self) -> bool:
        """Online or hybrid: producers fill a spool while the run trains."""
        return self.mode in ("online", "hybrid")


__all__ = ["KEY", "MODES", "StoreSpec"]
