"""CI's real-Slurm check, run by scripts/ci/slurm.sh once its two-node cluster is up (nodes n1, n2:
each a network namespace with its own address, hostname and processes; this folder shared). Every
job goes through the project's launcher (submitit), as users submit:

1. the tiny pipeline's harvest array (2 shards, one per node) and a 2-rank training job on one node;
2. two nodes: the same training, one rank per node (gloo over the nodes' eth0): the same draft;
3. a node lost: that two-node training with ``launcher.requeue=1``; n2 is killed (every process,
   slurmd too) after a checkpoint; the surviving rank names the lost one and requeues the job; n2
   comes back; the job resumes and ends with the same draft;
4. online across nodes: the producer on n1, the trainer on n2: the offline run's draft;
5. the producer's node lost: producer on n2, trainer on n1; n2 is killed; the trainer names the
   producer; a producer restarted on n1 carries the run on to the offline run's draft;
6. bad input, one line each: a node Slurm does not know, a rendezvous port in use, a spool the
   producer's host does not see (a folder private to each node).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from eagle3.store.shards import HarvestStore, verify_store
from eagle3.train.config import updated
from recipes.launch import LaunchError, submit
from recipes.tiny import tiny_pipeline

ROOT = Path(__file__).resolve().parents[2]

STEPS, SAVE_EVERY = 60, 5  # long enough for a node to be killed between two checkpoints
NODE = ROOT / "scripts" / "ci" / "slurm_node.sh"


def say(**fields: Any) -> None:
    print(json.dumps(fields, default=str), flush=True)


class Cluster:
    """The CI cluster's nodes: kill one (every process on it), start it again."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.prefix = (folder / "prefix").read_text().strip()
        lines = (line.split() for line in (folder / "hosts").read_text().splitlines())
        self.addr = {name: addr for addr, name in lines}

    def kill(self, node: str) -> None:
        subprocess.run(["bash", str(NODE), "stop", str(self.folder), node], check=True)
        say(event="node killed", node=node)

    def start(self, node: str) -> None:
        subprocess.run(["bash", str(NODE), "start", str(self.folder), node, self.addr[node]], check=True)
        for _ in range(120):
            state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True).stdout
            if state.strip() in ("idle", "mix", "alloc"):
                say(event="node back", node=node)
                return
            time.sleep(1)
        raise SystemExit(f"slurm e2e: {node} did not come back")


def job_state(job: str) -> str:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], capture_output=True, text=True).stdout
    return (out.split() or ["UNKNOWN"])[0]


def wait_job(job: str, timeout_s: float = 900) -> str:
    start = time.time()
    while time.time() - start < timeout_s:
        state = job_state(job)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(2)
    raise SystemExit(f"slurm e2e: job {job} still {job_state(job)} after {timeout_s:.0f} s")


def wait_for(what: str, ready: Any, timeout_s: float = 300) -> None:
    start = time.time()
    while not ready():
        if time.time() - start > timeout_s:
            raise SystemExit(f"slurm e2e: waited {timeout_s:.0f} s for {what}")
        time.sleep(0.5)


def logs(folder: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(folder.rglob("*_log.err")))


def final(out: Path) -> bytes:
    return (out / "final" / "model.safetensors").read_bytes()


def base(work: Path) -> Any:
    cfg = tiny_pipeline(work, kind="slurm")
    return replace(cfg, train=replace(cfg.train, steps=STEPS, save_every=SAVE_EVERY, collective_timeout_s=60),
                   launcher=replace(cfg.launcher, cpus_per_task=1, timeout_min=20, interface="eth0"))


def one_node(work: Path) -> bool:
    """The harvest array over both nodes (a task asks for a whole node's CPUs), then 2 ranks on one."""
    cfg = base(work)
    cfg = replace(cfg, launcher=replace(cfg.launcher, per_job={"harvest": {"cpus_per_task": "2"}}))
    started = time.time()
    out = submit(cfg, cfg.launcher, wait=True)
    store = HarvestStore(work / "harvest")
    verify_store(work / "harvest")
    workers = {r["worker"]: r["host"] for r in out["results"]["harvest"]}
    summary = json.loads((work / "train" / "summary.json").read_text())
    ok = (len(store) == 24 and sorted(workers) == ["0/2", "1/2"] and sorted(workers.values()) == ["n1", "n2"]
          and summary["world_size"] == 2 and len(set(summary["hosts"])) == 1)
    say(check="harvest over two nodes, training on one", jobs=out["jobs"], store_samples=len(store),
        harvest_hosts=workers, train_hosts=summary["hosts"], seconds=round(time.time() - started, 1), ok=ok)
    return ok


def two_nodes(work: Path, name: str) -> Any:
    cfg = base(work)
    return replace(cfg, stages=["train"], train=replace(cfg.train, out_dir=str(work / name)),
                   launcher=replace(cfg.launcher, nodes=2, tasks_per_node=1))


def across_nodes(work: Path) -> bool:
    cfg = two_nodes(work, "train-2node")
    started = time.time()
    out = submit(cfg, cfg.launcher, wait=True)
    summary = json.loads((work / "train-2node" / "summary.json").read_text())
    same = final(work / "train-2node") == final(work / "train")
    ok = same and summary["world_size"] == 2 and sorted(summary["hosts"]) == ["n1", "n2"]
    say(check="two nodes", jobs=out["jobs"], hosts=summary["hosts"], equals_one_node=same,
        seconds=round(time.time() - started, 1), ok=ok)
    return ok


def node_lost(work: Path, cluster: Cluster) -> bool:
    cfg = two_nodes(work, "train-lost")
    cfg = replace(cfg, launcher=replace(cfg.launcher, requeue=1,
                                        per_job={"train": {"nodelist": "n1,n2"}}))
    started = time.time()
    job = submit(cfg, cfg.launcher, wait=False)["jobs"]["train"][0]
    ckpts = work / "train-lost" / "checkpoints"
    wait_for("a checkpoint", lambda: any(ckpts.glob("step-*")) if ckpts.is_dir() else False)
    if (work / "train-lost" / "final").exists():
        raise SystemExit(f"slurm e2e: training ended before the node was killed; raise STEPS ({STEPS})")
    cluster.kill("n2")
    folder = sorted(Path(cfg.launcher.folder).glob("*-train"))[-1]  # this submission's (the newest) train job
    wait_for("the surviving rank's line", lambda: "requeueing job" in logs(folder), timeout_s=180)
    named = [line for line in logs(folder).splitlines() if "a collective failed" in line]
    # the node comes back once the lost run's processes on n1 are gone (its srun gives the dead node's
    # step up to 32 s): the requeued run reuses the step's id, and a late cancel of the old one would
    # hit it. Every process of the job names its folder (the batch script, srun, the ranks), or is its
    # slurmstepd.
    wait_for("the lost run's processes to end", lambda: all(subprocess.run(
        ["pgrep", "-f", pattern], capture_output=True).returncode != 0
        for pattern in (str(folder), rf"slurmstepd: \[{job}\.")), timeout_s=180)
    cluster.start("n2")
    state = wait_job(job)
    summary = json.loads((work / "train-lost" / "summary.json").read_text()) if state == "COMPLETED" else {}
    same = state == "COMPLETED" and final(work / "train-lost") == final(work / "train")
    ok = same and bool(named) and "lost rank 1 on n2" in named[0] and (summary.get("resumed_from_step") or 0) > 0
    say(check="node lost", job=job, state=state, named=named[:1], resumed_from_step=summary.get("resumed_from_step"),
        equals_uninterrupted=same, seconds=round(time.time() - started, 1), ok=ok)
    return ok


def online_cfg(work: Path, producer: str, trainer: str) -> Any:
    cfg = tiny_pipeline(work, kind="slurm")
    train = updated(cfg.train, {"data.mode": "online", "data.shard_window": 1, "data.eval_fraction": 0.0, "steps": 4,
                                "data.spool_wait_s": 600, "data.producer_stale_s": 5, "data.producer_grace_s": 180})
    return replace(cfg, train=train, harvest=replace(cfg.harvest, spool_budget_mb=0.2),
                   launcher=replace(cfg.launcher, cpus_per_task=1, timeout_min=20, tasks_per_node=1, harvest_shards=1,
                                    per_job={"produce": {"nodelist": producer}, "train": {"nodelist": trainer}}))


def offline_draft(cfg: Any) -> bytes:
    """The online run's draft as an offline run trains it (in this process, into ``out_dir/offline``)."""
    from recipes.pipeline import run_pipeline

    here = Path(cfg.out_dir) / "offline"
    run_pipeline(replace(cfg, train=updated(cfg.train, {"data.mode": "offline", "data.store": str(here / "harvest"),
                                                        "out_dir": str(here / "train")}),
                         harvest=replace(cfg.harvest, out_dir=str(here / "harvest")),
                         launcher=replace(cfg.launcher, kind="none")))
    return final(here / "train")


def online_across(work: Path) -> bool:
    cfg = online_cfg(work, producer="n1", trainer="n2")
    reference = offline_draft(cfg)
    started = time.time()
    out = submit(cfg, cfg.launcher, wait=True)
    produced = out["results"]["produce"][0]
    same = final(work / "train") == reference
    hosts = json.loads((work / "train" / "summary.json").read_text())["hosts"]
    ok = same and produced["stopped"] == "the trainer is done" and hosts == ["n2"]
    say(check="online across nodes", producer=produced, trainer_hosts=hosts, equals_offline=same,
        seconds=round(time.time() - started, 1), ok=ok)
    return ok


def producer_lost(work: Path, cluster: Cluster) -> bool:
    from recipes.launch import _array, produce_task

    cfg = online_cfg(work, producer="n2", trainer="n1")
    cfg = replace(cfg, train=replace(cfg.train, steps=12))
    reference = offline_draft(cfg)
    started = time.time()
    jobs = submit(cfg, cfg.launcher, wait=False)["jobs"]
    job = jobs["train"][0]
    record = work / "harvest" / "producer-0-of-1.json"
    wait_for("a shard made", lambda: record.is_file() and json.loads(record.read_text()).get("made", 0) >= 1)
    cluster.kill("n2")
    folder = sorted(Path(cfg.launcher.folder).glob("*-train"))[-1]
    wait_for("the trainer naming the producer", lambda: "waits on a lost producer" in logs(folder), timeout_s=120)
    named = [line for line in logs(folder).splitlines() if "waits on a lost producer" in line]
    token = json.loads((work / "harvest" / ".submitted.json").read_text())["token"]
    again = replace(cfg.launcher, per_job={"produce": {"nodelist": "n1"}})
    restarted = _array(again, "produce", produce_task, cfg, [], token)[0]
    state = wait_job(job)
    produced = restarted.results()[0]
    subprocess.run(["scancel", *jobs["produce"]], check=False)  # Slurm requeued the lost node's producer job
    cluster.start("n2")
    same = state == "COMPLETED" and final(work / "train") == reference
    ok = (same and bool(named) and "(pid" in named[0] and " on n2)" in named[0] and produced["host"] == "n1"
          and produced["stopped"] == "the trainer is done")
    say(check="producer's node lost", state=state, named=named[:1], restarted_producer=produced,
        equals_offline=same, seconds=round(time.time() - started, 1), ok=ok)
    return ok


def one_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__


def refused(what: str, cfg: Any, expect: str) -> bool:
    """``cfg``'s submission fails, and the line that says why contains ``expect``."""
    try:
        submit(cfg, cfg.launcher, wait=True)
    except LaunchError as err:
        text = str(err)
        ok = "\n" not in text.strip() and expect in text
        say(check=f"bad input: {what}", line=text[-800:], ok=ok)
        return ok
    say(check=f"bad input: {what}", line="accepted", ok=False)
    return False


def bad_input(work: Path, cluster: Cluster) -> bool:
    ok = True
    cfg = two_nodes(work, "train-bad")
    ok &= refused("a node Slurm does not know", replace(cfg, launcher=replace(cfg.launcher, per_job={"train": {
        "nodelist": "n9"}})), "n9")
    port = 29877
    listen = f"import socket, time; s = socket.socket(); s.bind(('', {port})); s.listen(); time.sleep(600)"
    squatter = subprocess.Popen(["nsenter", f"--net=/run/netns/{cluster.prefix}-n1", sys.executable, "-c", listen])
    try:
        time.sleep(2)
        ok &= refused("a rendezvous port in use", replace(cfg, launcher=replace(
            cfg.launcher, port=port, per_job={"train": {"nodelist": "n1,n2"}})), f"rendezvous port {port} is in use")
    finally:
        squatter.kill()
    private = cluster.folder / "private"  # a tmpfs of its own on every node
    spool = online_cfg(work / "unshared", producer="n1", trainer="n2")
    spool = replace(spool, harvest=replace(spool.harvest, out_dir=str(private / "spool")),
                    train=updated(spool.train, {"data.store": str(private / "spool")}))
    ok &= refused("a spool the producer's host does not see", spool, "does not see the submitter's")
    trained = any((work / "unshared" / "train").rglob("*.safetensors"))
    say(check="bad input: nothing trained", ok=not trained)
    return ok and not trained


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--cluster", required=True, help="the folder scripts/ci/slurm.sh made (hosts, prefix, nodes)")
    parser.add_argument("--only", nargs="*", help="run these checks only (by hand; names as printed)")
    args = parser.parse_args()
    work, cluster = Path(args.work), Cluster(Path(args.cluster))
    work.mkdir(parents=True, exist_ok=True)
    say(submit_host=socket.gethostname(), hosts=cluster.addr)
    checks = [
        ("harvest over two nodes, training on one", lambda: one_node(work / "offline")),
        ("two nodes", lambda: across_nodes(work / "offline")),
        ("node lost", lambda: node_lost(work / "offline", cluster)),
        ("online across nodes", lambda: online_across(work / "online")),
        ("producer's node lost", lambda: producer_lost(work / "producer-lost", cluster)),
        ("bad input", lambda: bad_input(work / "bad", cluster)),
    ]
    failed = []
    for name, check in checks:
        if args.only and name not in args.only:
            continue
        t0 = time.time()
        if not check():
            failed.append(name)
        print(f"slurm e2e: {name} took {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    say(failed=failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
