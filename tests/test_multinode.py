"""What a multi-node run needs that one host never exercises, checked without a cluster: the line
that names a rank lost mid-collective, the rendezvous checks (first node unresolvable, port in
use), the shared-filesystem check of a job's folders, submitit's errors as one line, the launcher's
multi-node keys, and a trainer that waits for a lost producer's replacement. The real two-node
runs are CI's (scripts/ci/slurm.sh)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch

from eagle3.distributed import PeerLost, Runtime, lost_peer
from eagle3.errors import ConfigError
from eagle3.store.shards import StoreError
from eagle3.store.spool import SpoolStore
from recipes.config import LauncherConfig
from recipes.launch import LaunchError, check_rendezvous, check_shared


def runtime(rank: int, hosts: list[tuple[str, str]]) -> Runtime:
    return Runtime(device=torch.device("cpu"), rank=rank, world_size=len(hosts), local_rank=0, hosts=tuple(hosts))


def test_a_collective_that_lost_a_rank_names_it_by_its_address() -> None:
    rt = runtime(0, [("n1", "10.0.0.1"), ("n2", "10.0.0.2"), ("n3", "10.0.0.3")])
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [10.0.0.3]:41234: Connection reset by peer")
    lost = lost_peer(gloo, rt)
    assert isinstance(lost, PeerLost)
    assert lost.what.startswith("rank 0 on n1: a collective failed: lost rank 2 on n3 (10.0.0.3)")
    assert "ranks 0: n1, 1: n2, 2: n3" in str(lost) and "launcher.requeue" in str(lost)
    assert "rank 1 on" not in str(lost)  # 10.0.0.3 names n3 only (no prefix match on 10.0.0.1...)
    # ranks on one host share an address: the error cannot say which one went away
    same_host = runtime(1, [("box", "10.0.0.9"), ("box", "10.0.0.9")])
    assert "does not say which" in str(lost_peer(RuntimeError("Connection closed by peer [10.0.0.9]:1"), same_host))
    # not a lost peer: left as it is
    assert lost_peer(RuntimeError("CUDA out of memory"), rt) is None
    assert lost_peer(RuntimeError("Connection reset by peer"), runtime(0, [("n1", "10.0.0.1")])) is None


def test_the_rendezvous_names_a_first_node_it_cannot_resolve_and_a_port_in_use() -> None:
    with pytest.raises(LaunchError, match=r"rank 1 on .*first node 'no-such-node\.invalid' \(from the node list "
                                          r"'no-such-node\.invalid,n2'\) does not resolve here"):
        check_rendezvous("no-such-node.invalid", 29500, 1, "no-such-node.invalid,n2")
    with socket.socket() as squatter:
        squatter.bind(("", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(LaunchError, match=rf"rank 0 on .*: the rendezvous port {port} is in use .*launcher\.port"):
            check_rendezvous("localhost", port, 0, "localhost")
        check_rendezvous("localhost", port, 1, "localhost")  # only rank 0 listens there
    check_rendezvous("localhost", port, 0, "localhost")  # free again


def test_a_job_on_a_host_without_the_shared_folder_stops_naming_it(tmp_path: Path) -> None:
    from recipes.launch import _mark_shared

    token = _mark_shared(tmp_path / "spool")
    check_shared(tmp_path / "spool", token, "producer 0/1")  # seen: nothing said
    check_shared(tmp_path / "elsewhere", None, "producer 0/1")  # no token (an older submission): not checked
    with pytest.raises(LaunchError, match=r"producer 0/1 on host .*elsewhere/\.submitted\.json is missing: this host "
                                          r"does not see the submitter's .*elsewhere; it must be on a filesystem"):
        check_shared(tmp_path / "elsewhere", token, "producer 0/1", wait_s=0.5)
    _mark_shared(tmp_path / "spool")  # a second submission on the same folder
    with pytest.raises(LaunchError, match="is another submission's: two runs use"):
        check_shared(tmp_path / "spool", token, "the trainer", wait_s=0.5)


def test_submitit_errors_become_one_line() -> None:
    from submitit.core.utils import FailedJobError

    from recipes.launch import _why

    trace = ("Job (task=0) failed during processing with trace:\n----------------------\nTraceback (most recent call "
             "last):\n  File \"x.py\", line 1, in <module>\n    raise LaunchError(...)\nrecipes.launch.LaunchError: "
             "rank 0 on n1: the rendezvous port 20005 is in use\n----------------------\nYou can check full logs with "
             "'job.stderr(0)' and 'job.stdout(0)'or at paths:\n  - /j/5_0_log.err\n  - /j/5_0_log.out\n")
    launcher = LauncherConfig(kind="slurm", per_job={"train": {"nodelist": "n9", "qos": "high"}})
    assert _why(FailedJobError(trace), launcher) == ("a job failed: recipes.launch.LaunchError: rank 0 on n1: the "
                                                     "rendezvous port 20005 is in use (its log: /j/5_0_log.err)")
    refused = FailedJobError("sbatch: error: Batch job submission failed: Invalid node name specified\n")
    assert _why(refused, launcher) == ("sbatch: error: Batch job submission failed: Invalid node name specified "
                                       "(node options: per_job.train.nodelist=n9)")


def test_the_multi_node_launcher_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from recipes import launch

    with pytest.raises(ConfigError, match=r"launcher\.per_job\.trainer: no such job; expected one of prepare, harvest"):
        LauncherConfig(per_job={"trainer": {"nodelist": "n1"}})
    with pytest.raises(ConfigError, match=r"launcher\.port=80: expected 1024\.\.65535"):
        LauncherConfig(port=80)
    with pytest.raises(ConfigError, match=r"launcher\.requeue=-1"):
        LauncherConfig(requeue=-1)
    from eagle3.train.config import TrainConfig

    with pytest.raises(ConfigError, match=r"train\.collective_timeout_s=0: must be > 0 \(seconds\)"):
        TrainConfig(collective_timeout_s=0)
    (tmp_path / "bin").mkdir()
    for tool in ("srun", "sbatch"):
        (tmp_path / "bin" / tool).write_text("#!/bin/sh\nexit 0\n")
        (tmp_path / "bin" / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    cluster = LauncherConfig(kind="slurm", folder=str(tmp_path), requeue=2, additional={"account": "a"},
                             per_job={"produce": {"partition": "inference"}, "train": {"account": "b"}})
    params = {name: launch._executor(cluster, name)._executor.parameters for name in ("produce", "train", "finish")}
    extra = {name: p["additional_parameters"] for name, p in params.items()}
    assert extra == {"produce": {"account": "a", "partition": "inference"},
                     "train": {"account": "b", "requeue": True},  # only the training job requeues itself
                     "finish": {"account": "a"}}
    assert all(p["srun_args"] == ["--kill-on-bad-exit=1"] for p in params.values())
    after = launch._executor(cluster, "train")
    launch._after(after, cluster, [type("Job", (), {"job_id": "41_1"})(), type("Job", (), {"job_id": "41_0"})()])
    assert after._executor.parameters["additional_parameters"] == {"account": "b", "requeue": True,
                                                                    "dependency": "afterok:41"}  # kept beside it


def test_a_trainer_names_a_lost_producer_and_carries_on_with_its_replacement(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A producer on another host falls silent: named on stderr at once, an error only after the
    grace; a producer that writes its heartbeat again in time (a restart, any host) carries on."""
    record = tmp_path / "producer-0-of-1.json"

    def heartbeat(age_s: float, host: str = "n2") -> None:
        record.write_text(json.dumps({"worker": 0, "workers": 1, "pid": 1, "host": host, "state": "running",
                                      "made": 3, "time": time.time() - age_s}))

    store = SpoolStore.__new__(SpoolStore)  # only what the wait reads: no spool needed
    store.root, store.wait_s, store.stale_s, store.grace_s = tmp_path, 600.0, 60.0, 1.5
    heartbeat(age_s=600)
    alive = store._producers_alive("e0000-shard-00003", seq=3)
    time.sleep(1.05)
    assert alive()
    said = capsys.readouterr().err
    assert "shard e0000-shard-00003 waits on a lost producer: producer 0/1 (pid 1 on n2) silent for" in said
    assert "this trainer waits 2 s for it" in said
    heartbeat(age_s=0, host="n1")  # restarted elsewhere
    time.sleep(1.05)
    assert alive() and "a producer took over shard e0000-shard-00003" in capsys.readouterr().err
    heartbeat(age_s=600)
    with pytest.raises(StoreError, match=r"not produced: producer 0/1 \(pid 1 on n2\) silent for .*rerun the trainer"):
        for _ in range(5):
            time.sleep(1.05)
            alive()


def test_a_failed_jobs_line_is_the_rank_naming_one_of_a_chained_trace() -> None:
    from submitit.core.utils import FailedJobError

    from recipes.launch import _why

    trace = ("Job (task=0) failed during processing with trace:\n----------------------\nTraceback (most recent call "
             "last):\nRuntimeError: [pair.cc:537] Read error [10.0.0.2]:41234: Connection reset by peer\n\nThe above "
             "exception was the direct cause of the following exception:\n\nTraceback (most recent call last):\n"
             "eagle3.distributed.PeerLost: rank 0 on n1: a collective failed: lost rank 1 on n2 (10.0.0.2)\n"
             "----------------------\nYou can check full logs at paths:\n  - /j/5_0_log.err\n")
    assert _why(FailedJobError(trace), LauncherConfig(kind="slurm")) == (
        "a job failed: eagle3.distributed.PeerLost: rank 0 on n1: a collective failed: lost rank 1 on n2 (10.0.0.2) "
        "(its log: /j/5_0_log.err)")


def test_a_crashed_rank_is_told_from_a_lost_node_and_never_requeued(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that raised leaves a record; a survivor finds it (no requeue: it would crash again); a
    lost node leaves none. Requeue asks Slurm, and a refusal or a missing scontrol fails the job."""
    import subprocess
    from types import SimpleNamespace

    from recipes import rank_failure

    cfg = SimpleNamespace(train=SimpleNamespace(out_dir=str(tmp_path / "train"), data=SimpleNamespace(
        mode="online", store=str(tmp_path / "spool"))))
    assert rank_failure.crashed_rank(cfg, wait_s=0.0) is None  # nothing recorded: a lost node
    rank_failure.record_crash(cfg, "1", ValueError("the disk is full\nmore"))
    assert rank_failure.crashed_rank(cfg, wait_s=0.0) == f"rank 1 on {socket.gethostname()} failed: ValueError: " \
                                                          "the disk is full"
    rank_failure.clear_record(cfg, "1")  # the rank's next run starts clean
    assert rank_failure.crashed_rank(cfg, wait_s=0.0) is None

    lost = PeerLost("rank 0 on n1: a collective failed: lost rank 1 on n2 (10.0.0.2)")
    slurm = LauncherConfig(kind="slurm", requeue=1)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert not rank_failure.requeue(slurm, lost)  # its one requeue is spent
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    asked: list[list[str]] = []

    def scontrol(args: list[str], **_: object) -> SimpleNamespace:
        asked.append(args)
        return SimpleNamespace(returncode=0 if args[-1] == "41" else 1, stderr="Invalid job id specified")

    monkeypatch.setattr(subprocess, "run", scontrol)
    assert rank_failure.requeue(slurm, lost) and asked == [["scontrol", "requeue", "41"]]
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert not rank_failure.requeue(slurm, lost)  # Slurm refused: the job fails instead
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("scontrol")))
    assert not rank_failure.requeue(slurm, lost)
    assert not rank_failure.requeue(LauncherConfig(kind="local", requeue=1), lost)


def test_a_failed_trainer_stops_the_producers_but_not_one_started_after(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from eagle3.store.spool import DONE, Spool
    from recipes import rank_failure

    (tmp_path / "spool").mkdir()
    cfg = SimpleNamespace(train=SimpleNamespace(out_dir=str(tmp_path / "train"), data=SimpleNamespace(
        mode="online", store=str(tmp_path / "spool"))))
    spool = Spool.__new__(Spool)  # done() reads only its folder
    spool.root = tmp_path / "spool"
    assert not spool.done()
    rank_failure.stop_producers(cfg, RuntimeError("boom"))
    assert spool.done() and spool.done_why() == "the trainer failed: RuntimeError: boom"
    spool.started = time.time() + 1  # a producer restarted after the failure: the trainer it serves is a rerun
    assert not spool.done()
    (tmp_path / "spool" / DONE).write_text("")  # a trainer that finished: every producer stops
    assert spool.done() and spool.done_why() == "the trainer is done"


SILENT_PEER = """
import json, os, sys, time
from pathlib import Path
import deepspeed, torch
from eagle3.distributed import init_runtime, lost_peer
here = Path(sys.argv[1])  # both ranks imported: start the 3 s rendezvous together (imports vary on a busy machine)
(here / f"ready-{os.environ['RANK']}").touch()
while not all((here / f"ready-{r}").exists() for r in (0, 1)):
    time.sleep(0.05)
rt = init_runtime("cpu", timeout_s=3)
if rt.rank == 1:  # a rank that stays alive but never answers (a frozen node)
    time.sleep(8)
    sys.exit(0)
t0 = time.monotonic()
try:
    torch.distributed.all_reduce(torch.ones(4))
    print(json.dumps({"lost": None}))
except RuntimeError as err:
    print(json.dumps({"seconds": time.monotonic() - t0, "lost": str(lost_peer(err, rt))}))
"""


@pytest.mark.slow
def test_a_silent_rank_fails_the_collective_after_the_timeout_and_is_named_lost(tmp_path: Path) -> None:
    """Two gloo ranks, the second never answering: the first's collective fails after the rendezvous
    timeout (``train.collective_timeout_s``), as a lost peer, instead of hanging."""
    import os
    import subprocess
    import sys

    from eagle3.distributed import free_port

    script = tmp_path / "silent.py"
    script.write_text(SILENT_PEER)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    root = Path(__file__).parents[1]
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.DEVNULL, text=True,
                              cwd=root)
             for r in (0, 1)]
    out = [p.communicate(timeout=120)[0] for p in procs]
    said = json.loads(out[0].strip().splitlines()[-1])
    assert said["lost"] is not None and "a collective failed: lost another rank" in said["lost"]
    assert "Timed out" in said["lost"] and 2.5 <= said["seconds"] < 30  # the 3 s timeout, not gloo's 30 min
