"""The pipeline's config tree (every stage reads its part) and where it runs. Hydra recipes in ``recipes/``
compose YAML over these dataclasses; the entry point converts once, and nothing below it sees a ``DictConfig``."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

import torch

from data_gen.config import HarvestConfig, PoolsConfig, QuantizeConfig, RegenerateConfig, SelectConfig
from eagle3.config import TargetConfig
from eagle3.draft.families import get_family
from eagle3.errors import ConfigError
from eagle3.train.config import draft_spec, run_config, train_settings
from hard_mining.config import MineConfig
from serve_eval.config import EvalConfig

TrainSettings = train_settings()  # hydra's schema of train: every draft family's train.draft keys

JOB_GROUPS = ("prepare", "harvest", "produce", "train", "finish")
"""The launcher's jobs (recipes/launch.py), as ``launcher.per_job`` names them."""
RENAMED_STAGES = {"plan": "size"}
"""Stage names recipes may still use: the draft's size before any weights was the ``plan`` stage."""


@dataclass
class LauncherConfig:
    """Where the pipeline runs: in this process (``none``), or as submitit jobs (recipes/launch.py)."""

    kind: str = "none"
    """none, local (submitit processes here, the groups one after the other) or slurm."""
    folder: str = "runs/submitit"
    """Job logs and pickles; each submission gets a fresh sub-folder."""
    partition: str | None = None
    timeout_min: int = 240
    cpus_per_task: int = 2
    mem_gb: int | None = None
    gpus_per_node: int = 0
    nodes: int = 1
    """The training job's nodes ..."""
    tasks_per_node: int = 1
    """... and ranks per node (one per GPU on GPU nodes)."""
    harvest_shards: int = 1
    """The harvest array's tasks (``harvest.shard`` i/n each)."""
    additional: dict[str, str] = field(default_factory=dict)
    """Extra sbatch options for every job (account, qos, constraint, ...)."""
    per_job: dict[str, dict[str, str]] = field(default_factory=dict)
    """Extra sbatch options for one job group, over ``additional``: prepare, harvest, produce, train
    or finish (e.g. ``+launcher.per_job.produce.partition=inference``: the producers on other nodes
    than the trainer)."""
    interface: str | None = None
    """The network interface the training ranks talk over (GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME in the job); None: the one the node's hostname resolves to (gloo), NCCL's
    own choice."""
    port: int | None = None
    """The training job's rendezvous port on its first node; None: 20000 + the job id mod 20000
    (jobs sharing a node do not collide). A port in use fails the job at once, naming it."""
    requeue: int = 0
    """N > 0: a training job that loses a node (a rank's collective fails) requeues itself, up to N
    times (sbatch --requeue; it waits for nodes, then resumes from its last checkpoint); 0: it
    fails, naming the lost rank, and a resubmission resumes."""

    def __post_init__(self) -> None:
        if self.kind not in ("none", "local", "slurm"):
            raise ConfigError(f"launcher.kind={self.kind!r}: expected none, local or slurm")
        for name in ("timeout_min", "cpus_per_task", "nodes", "tasks_per_node", "harvest_shards"):
            if getattr(self, name) < 1:
                raise ConfigError(f"launcher.{name}={getattr(self, name)}: must be >= 1")
        for job in self.per_job:
            if job not in JOB_GROUPS:
                raise ConfigError(f"launcher.per_job.{job}: no such job; expected one of {', '.join(JOB_GROUPS)}")
        if self.port is not None and not 1024 <= self.port <= 65535:
            raise ConfigError(f"launcher.port={self.port}: expected 1024..65535 (or null: from the job id)")
        if self.requeue < 0:
            raise ConfigError(f"launcher.requeue={self.requeue}: must be >= 0")


@dataclass
class PipelineConfig:
    """One run of the pipeline: every stage reads its part of this tree."""

    target: TargetConfig = field(default_factory=TargetConfig)
    pools: PoolsConfig = field(default_factory=PoolsConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    harvest: HarvestConfig = field(default_factory=HarvestConfig)
    train: TrainSettings = field(default_factory=TrainSettings)  # a TrainConfig
    val: SelectConfig = field(default_factory=lambda: SelectConfig(num_prompts=24, split="val"))
    """The held-out prompts the ``val`` stage regenerates and harvests (mining scores on them)."""
    mine: MineConfig = field(default_factory=MineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    """Used when ``stages`` has ``quantize``: every stage after it runs on the NVFP4 target."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    out_dir: str = "runs/quickstart"
    """Where every stage writes its outputs."""
    stages: list[str] = field(default_factory=lambda: ["target", "pools", "regenerate", "harvest", "val", "train",
                                                       "mine", "eval", "report"])
    """Stages to run, in order."""
    threads: int = 1
    """torch intra-op threads on CPU; 1 was fastest on a loaded 2-core machine."""
    local_ranks: int = 1
    """Training on the CPU with ``launcher.kind=none``: its ranks on this machine, each micro-batch's
    rows split over them (``train.context_parallel``; the same steps within round-off, in less time),
    where the draft family splits rows, the data is offline and ``train.context_parallel`` is left at
    1; capped by the cores over ``train.threads`` (eagle3/train/local_ranks.py). GPUs get their ranks
    from a launcher."""
    seed: int = 0

    def __post_init__(self) -> None:
        self.train = run_config(self.train)  # its draft section the family's class
        for old, new in RENAMED_STAGES.items():
            if old in self.stages:
                print(f"stages: {old!r} is now called {new!r}; running {new}", file=sys.stderr)
                self.stages = [new if s == old else s for s in self.stages]
        if self.train.data.mode in ("online", "colocated") and "mine" in self.stages:
            raise ConfigError(f"train.data.mode={self.train.data.mode} keeps no store for the mine stage to score and "
                              "extend: run without it (stages=[...] without mine), or train with "
                              "train.data.mode=hybrid or offline")
        if self.train.data.mode != "offline" and self.train.data.store != self.harvest.out_dir:
            raise ConfigError(f"train.data.mode={self.train.data.mode}: train.data.store={self.train.data.store!r} "
                              "must be the spool the "
                              f"producers fill, harvest.out_dir={self.harvest.out_dir!r}")
        if self.threads < 1:
            raise ConfigError(f"threads={self.threads}: must be >= 1")
        if self.local_ranks < 1:
            raise ConfigError(f"local_ranks={self.local_ranks}: must be >= 1")
        on_cpu = self.train.device == "cpu" or (self.train.device == "auto" and not torch.cuda.is_available())
        if (self.local_ranks > 1 and on_cpu and self.launcher.kind == "none" and self.train.context_parallel == 1
                and self.train.data.mode == "offline"
                and get_family(draft_spec(self.train.draft).family, "train.draft.family").splits_rows):
            self.train = replace(self.train, context_parallel=self.local_ranks)
