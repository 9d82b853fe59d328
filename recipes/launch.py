"""Launching the pipeline's stages as jobs with submitit: Slurm, or local processes.

``eagle3-run launcher=slurm launcher.partition=gpu ...`` submits instead of running in-process:

    job "prepare"   one task: the stages before harvest (target, pools, quantize, regenerate, val)
    job "harvest"   an array, one task per shard (``harvest.shard = i/n``; whoever finishes the
                    last shard writes the manifest)                    after "prepare" succeeded
    job "train"     ``nodes x tasks_per_node`` tasks: DeepSpeed ranks, the rendezvous taken from
                    the job's environment (submitit's JobEnvironment: rank, world size, local
                    rank, first hostname; the port from the job id)   after every shard succeeded
    job "finish"    one task: mine, eval, report                       after "train" succeeded

With ``train.data.mode=online`` there is no harvest array: job "produce", an array of
``launcher.harvest_shards`` producers (``data_gen.produce``, worker i of n), starts with the
training job (both after "prepare"); the trainer waits for the first shard, and the producers stop
when it writes ``done``.

On Slurm the dependencies are ``afterok`` and :func:`submit` returns at once with the job ids;
``launcher=local`` runs the same jobs as local processes one group after the other (what the tests
use without a Slurm). Job folders are ``launcher.folder/<timestamp>-<name>`` (fresh per submission:
Slurm job ids restart when its state is wiped).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from eagle3.errors import Eagle3Error
from recipes.config import LauncherConfig, PipelineConfig

PREPARE = ("size", "target", "pools", "quantize", "regenerate", "val")
FINISH = ("mine", "eval", "report")


def run_stages(cfg: PipelineConfig, stages: list[str]) -> dict[str, Any]:
    from recipes.pipeline import run_pipeline

    return run_pipeline(replace(cfg, stages=stages))


def _record(cfg: PipelineConfig, stage: str, result: dict[str, Any]) -> None:
    """``out_dir/<stage>.json``, as the in-process pipeline writes it (the report stage reads them)."""
    import json

    from eagle3.atomic import atomic_write_text

    atomic_write_text(Path(cfg.out_dir) / f"{stage}.json", json.dumps(result, indent=2, default=str) + "\n")


def harvest_shard(cfg: PipelineConfig, shard: int, shards: int) -> dict[str, Any]:
    """One task of the harvest array: shard ``shard`` of ``shards``; the task that completes the
    store verifies it and records the stage."""
    from data_gen.harvest import run
    from eagle3.store.shards import verify_store

    if cfg.train.data.mode == "colocated":  # the plan and the tokens only: the trainer computes the states
        from recipes.pipeline import plan_only

        return plan_only(cfg)
    from recipes.pipeline import stage_folder

    with stage_folder(cfg, "harvest").handed_off():  # the same rule as in one process: other settings named
        summary = run(replace(cfg.harvest, shard=f"{shard}/{shards}"), cfg.target) | {"host": socket.gethostname()}
    if summary["complete"]:
        verify_store(cfg.harvest.out_dir)
        _record(cfg, "harvest", summary)
    return summary


SUBMITTED = ".submitted.json"
"""Written by the submitter into every folder its jobs share (the online spool): a job on a host
that does not see it is on another filesystem, and stops before it writes anything there."""


def _mark_shared(folder: str | os.PathLike[str]) -> str:
    """Write ``folder/SUBMITTED`` with a fresh token; returns the token."""
    import json
    import secrets

    from eagle3.atomic import atomic_write_text

    token = secrets.token_hex(8)
    Path(folder).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(folder) / SUBMITTED, json.dumps({"token": token, "host": socket.gethostname(),
                                                             "time": time.time()}) + "\n")
    return token


def check_shared(folder: str | os.PathLike[str], token: str | None, what: str, wait_s: float = 10.0) -> None:
    """In a job: stop with one line unless this host sees the submitter's ``folder/SUBMITTED`` with
    ``token`` within ``wait_s`` (None: nothing to check, e.g. a run submitted before this existed)."""
    import json

    if token is None:
        return
    path = Path(folder) / SUBMITTED
    deadline = time.monotonic() + wait_s
    while True:  # a network filesystem's cached view of the folder may lag the submitter's write
        try:
            seen = json.loads(path.read_text()).get("token")
        except (OSError, ValueError):
            seen = None
        if seen == token or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    here = socket.gethostname()
    if seen is None:
        raise LaunchError(f"{what} on host {here}: {path} is missing: this host does not see the submitter's "
                          f"{folder}; it must be on a filesystem every node of the job shares")
    if seen != token:
        raise LaunchError(f"{what} on host {here}: {path} is another submission's: two runs use {folder}; "
                          "give each its own")


def produce_task(cfg: PipelineConfig, worker: int, workers: int, token: str | None = None) -> dict[str, Any]:
    """One task of the producer array of online training."""
    from data_gen.produce import produce
    from recipes.pipeline import producer_epochs

    check_shared(cfg.harvest.out_dir, token, f"producer {worker}/{workers}")
    return produce(replace(cfg.harvest, shard=f"{worker}/{workers}"), cfg.target, seed=cfg.train.seed,
                   progress=False, max_epochs=producer_epochs(cfg)) | {"host": socket.gethostname()}


def check_rendezvous(master: str, port: int, rank: int, nodelist: str) -> None:
    """One line, before torch's rendezvous would hang or fail obscurely: the job's first node does
    not resolve on this host; (rank 0, which listens) the port is in use here."""
    here = socket.gethostname()
    try:
        socket.getaddrinfo(master, port)
    except OSError as err:
        raise LaunchError(f"rank {rank} on {here}: the job's first node {master!r} (from the node list {nodelist!r}) "
                          f"does not resolve here ({err}): fix the nodes' names (/etc/hosts or DNS)") from None
    if rank == 0:  # the rendezvous listens here
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store: a closed one may linger
            try:
                probe.bind(("", port))
            except OSError as err:
                raise LaunchError(f"rank 0 on {here}: the rendezvous port {port} is in use ({err.strerror}): set "
                                  "launcher.port to a free one") from None


def rendezvous_from_job(port_base: int = 20000, port: int | None = None) -> dict[str, str]:
    """RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the running submitit job: the
    job's first node, and ``port`` (None: ``port_base`` + the job id mod 20000). A first node this
    host cannot resolve, or (on that node) a port in use, stops the task with one line."""
    import submitit

    env = submitit.JobEnvironment()
    job_number = int("".join(c for c in str(env.job_id).split("_")[0] if c.isdigit()) or 0)
    port = port if port is not None else port_base + job_number % 20000
    master = env.hostnames[0]
    check_rendezvous(master, port, env.global_rank, os.environ.get("SLURM_JOB_NODELIST", "?"))
    return {"RANK": str(env.global_rank), "WORLD_SIZE": str(env.num_tasks), "LOCAL_RANK": str(env.local_rank),
            "MASTER_ADDR": master, "MASTER_PORT": str(port)}


def train_task(cfg: PipelineConfig, token: str | None = None) -> dict[str, Any]:
    """One rank of the training job. A rank that fails records why (recipes/rank_failure.py); a rank
    whose collective lost another rank, and finds no such record, calls the other's node lost and,
    with ``launcher.requeue``, requeues the job (Slurm restarts it when nodes are free; it resumes).
    A trainer that fails for good stops an online run's producers."""
    from eagle3.distributed import PeerLost, shutdown
    from eagle3.train.loop import train
    from recipes import rank_failure

    rank = os.environ.get("SLURM_PROCID", "0")
    try:
        if cfg.train.data.mode in ("online", "hybrid"):
            check_shared(cfg.train.data.store, token, "the trainer")
        os.environ.update(rendezvous_from_job(port=cfg.launcher.port))
        if cfg.launcher.interface:
            os.environ.update(GLOO_SOCKET_IFNAME=cfg.launcher.interface, NCCL_SOCKET_IFNAME=cfg.launcher.interface)
        rank = os.environ["RANK"]
        rank_failure.clear_record(cfg, rank)
        summary = train(cfg.train, cfg.target)
    except PeerLost as err:
        crash = rank_failure.crashed_rank(cfg)
        if crash is None and rank_failure.requeue(cfg.launcher, err):
            os._exit(1)  # Slurm ends this run; the requeued one writes the result
        rank_failure.stop_producers(cfg, err)
        if crash is not None:  # not a lost node: that rank's error is the job's
            raise LaunchError(f"rank {rank} on {socket.gethostname()}: stopped, as {crash}") from err
        raise
    except Exception as err:
        with contextlib.suppress(OSError):
            rank_failure.record_crash(cfg, rank, err)
            rank_failure.stop_producers(cfg, err)
        raise
    shutdown()  # the process groups go while the interpreter is whole (eagle3.distributed.shutdown)
    if rank == "0":
        _record(cfg, "train", summary)
    return summary


def _executor(launcher: LauncherConfig, name: str, gpus: Sequence[int] = (), **params: Any) -> Any:
    """An executor for one group of jobs. ``gpus`` (local jobs): the GPUs this job's processes see
    (a local job sees none unless given: submitit hides them); Slurm jobs get ``launcher.gpus_per_node``."""
    try:
        import submitit
    except ImportError as err:
        raise LaunchError(f"launcher={launcher.kind} needs the [slurm] extra: pip install -e '.[slurm]' "
                          f"({err})") from None

    folder = Path(launcher.folder) / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{name}"
    if launcher.kind == "local":
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(timeout_min=launcher.timeout_min, gpus_per_node=len(gpus), visible_gpus=tuple(gpus),
                             **{k: v for k, v in params.items() if k in ("tasks_per_node", "nodes")})
        return ex
    try:
        ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    except RuntimeError as err:  # submitit: "Could not detect srun, are you indeed on a slurm cluster?"
        raise LaunchError(f"launcher=slurm: {err} (submit from a Slurm login node, or use launcher=local)") from None
    slurm: dict[str, Any] = dict(timeout_min=launcher.timeout_min, slurm_job_name=f"eagle3-{name}",
                                 cpus_per_task=launcher.cpus_per_task, **params)
    if launcher.partition:
        slurm["slurm_partition"] = launcher.partition
    if launcher.mem_gb:
        slurm["mem_gb"] = launcher.mem_gb
    if launcher.gpus_per_node:
        slurm["gpus_per_node"] = launcher.gpus_per_node
    extra = {**launcher.additional, **launcher.per_job.get(name, {})}
    if name == "train" and launcher.requeue:
        extra["requeue"] = True
    slurm["slurm_additional_parameters"] = extra
    slurm["slurm_srun_args"] = ["--kill-on-bad-exit=1"]  # one task failed: its job stops, no rank waits for it
    ex.update_parameters(**slurm)
    return ex


def _after(ex: Any, launcher: LauncherConfig, jobs: list[Any]) -> None:
    """Make ``ex``'s next submission wait for ``jobs`` (Slurm afterok)."""
    if launcher.kind != "slurm" or not jobs:
        return
    ids = sorted({str(j.job_id).split("_")[0] for j in jobs})
    params = dict(ex.parameters.get("additional_parameters") or {})  # AutoExecutor: the Slurm executor's own names
    params["dependency"] = "afterok:" + ":".join(ids)
    ex.update_parameters(slurm_additional_parameters=params)


def _array(launcher: LauncherConfig, name: str, fn: Any, cfg: PipelineConfig, previous: list[Any],
           *extra: Any) -> list[Any]:
    """``launcher.harvest_shards`` tasks ``fn(cfg, i, n, *extra)``: a Slurm job array; locally one
    process per task, task i on GPU i mod ``launcher.gpus_per_node`` (on a CPU: none)."""
    n = launcher.harvest_shards
    if launcher.kind == "local":
        g = launcher.gpus_per_node
        return [_executor(launcher, f"{name}-{i}", gpus=[i % g] if g else []).submit(fn, cfg, i, n, *extra)
                for i in range(n)]
    ex = _executor(launcher, name)
    _after(ex, launcher, previous)
    return ex.map_array(fn, [cfg] * n, list(range(n)), [n] * n, *([e] * n for e in extra))


class LaunchError(Eagle3Error, RuntimeError):
    """Jobs could not be submitted or one failed; the message names the launcher and the reason."""


def submit(cfg: PipelineConfig, launcher: LauncherConfig, wait: bool | None = None) -> dict[str, Any]:
    """Submit the pipeline's stages as jobs; returns the job ids (and, when waiting, the results)."""
    from submitit.core.utils import FailedSubmissionError, UncompletedJobError

    try:
        return _submit(cfg, launcher, wait)
    except (UncompletedJobError, FailedSubmissionError) as err:  # sbatch refused, or a job failed (its log named)
        raise LaunchError(f"launcher={launcher.kind}: {_why(err, launcher)}") from None


def _why(err: Exception, launcher: LauncherConfig) -> str:
    """submitit's error as one line: a failed job's own error line and its log; sbatch's error line and
    the node options it was given; else the error's first line."""
    import re

    from submitit.core.utils import FailedJobError, FailedSubmissionError

    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if isinstance(err, FailedJobError):
        raised = [line for line in lines if re.match(r"^(?:[a-z_]\w*\.)*[A-Z]\w*: ", line)]  # pkg.mod.Class: why
        logs = [line[2:] for line in lines if line.startswith("- ") and line.endswith(".err")]
        if raised:
            return f"a job failed: {raised[-1]}" + (f" (its log: {logs[0]})" if logs else "")
    refused = [line for line in lines if line.startswith("sbatch: error:")]  # submitit raises either class
    if isinstance(err, FailedSubmissionError) or refused:
        said = refused or [line for line in lines if "error" in line.lower()]
        groups = [("additional.", launcher.additional), *((f"per_job.{j}.", o) for j, o in launcher.per_job.items())]
        nodes = [f"{where}{key}={value}" for where, options in groups for key, value in options.items()
                 if key in ("nodelist", "exclude", "partition", "constraint")]
        if launcher.partition:
            nodes.append(f"partition={launcher.partition}")
        return (said[-1] if said else lines[0] if lines else type(err).__name__) + \
            (f" (node options: {', '.join(nodes)})" if nodes else "")
    return lines[0] if lines else type(err).__name__


def _submit(cfg: PipelineConfig, launcher: LauncherConfig, wait: bool | None) -> dict[str, Any]:
    wait = launcher.kind == "local" if wait is None else wait
    prepare = [s for s in cfg.stages if s in PREPARE]
    finish = [s for s in cfg.stages if s in FINISH]
    jobs: dict[str, Any] = {}
    previous: list[Any] = []

    def settle(group: list[Any]) -> None:
        if launcher.kind == "local":  # no dependencies between local jobs: run the groups in order
            for job in group:
                job.results()

    first_gpu = list(range(min(launcher.gpus_per_node, 1)))  # local: one GPU for the one-process stages
    if prepare:
        ex = _executor(launcher, "prepare", gpus=first_gpu)
        jobs["prepare"] = [ex.submit(run_stages, cfg, prepare)]
        settle(jobs["prepare"])
        previous = jobs["prepare"]
    if "quantize" in cfg.stages:  # the jobs after "prepare" run on the NVFP4 checkpoint it wrote
        from recipes.pipeline import on_quantized_target

        cfg = on_quantized_target(cfg)
    online = cfg.train.data.mode in ("online", "hybrid") and "train" in cfg.stages
    if "harvest" in cfg.stages and not online:
        jobs["harvest"] = _array(launcher, "harvest", harvest_shard, cfg, previous)
        settle(jobs["harvest"])
        previous = jobs["harvest"]
    if "train" in cfg.stages:
        token = None
        if online:  # the producers start with the trainer, and end when it is done
            from eagle3.store.spool import DONE

            (Path(cfg.harvest.out_dir) / DONE).unlink(missing_ok=True)
            token = _mark_shared(cfg.harvest.out_dir)  # every producer and rank checks it sees the same spool
            jobs["produce"] = _array(launcher, "produce", produce_task, cfg, previous, token)
        ex = _executor(launcher, "train", gpus=range(launcher.gpus_per_node), nodes=launcher.nodes,
                       tasks_per_node=launcher.tasks_per_node)
        _after(ex, launcher, previous)
        jobs["train"] = [ex.submit(train_task, cfg, token)]
        settle(jobs["train"])
        if online:
            settle(jobs["produce"])
        previous = jobs["train"]
    if finish:
        ex = _executor(launcher, "finish", gpus=first_gpu)
        _after(ex, launcher, previous)
        jobs["finish"] = [ex.submit(run_stages, cfg, finish)]
        settle(jobs["finish"])
    out: dict[str, Any] = {"launcher": launcher.kind,
                           "jobs": {k: [str(j.job_id) for j in v] for k, v in jobs.items()}}
    if wait:
        # a multi-task job's result is its rank 0's
        out["results"] = {k: [j.results()[0] for j in v] for k, v in jobs.items()}
    return out


__all__ = ["LaunchError", "check_rendezvous", "check_shared", "harvest_shard", "produce_task", "rendezvous_from_job",
           "run_stages", "submit", "train_task"]
