"""The spool: shards in the store's format through a folder bounded by a byte budget."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from eagle3.store.shards import HarvestSpec, Sample, StoreError, encode_shard
from eagle3.store.spool import Spool

SPEC = HarvestSpec(target="t", weights_fingerprint="w", tokenizer_sha256="k", chat_template_sha256="c", num_layers=4,
                   hidden_size=8, vocab_size=32, aux_layer_ids=(1, 2, 3), dtype="float32")


def samples(seed: int, n: int = 2, length: int = 5) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample(id=f"s{seed}-{i}", input_ids=torch.randint(0, 32, (length,), generator=g),
                   loss_mask=torch.rand(length, generator=g) > 0.5, aux=torch.randn(length, 3, 8, generator=g),
                   last=torch.randn(length, 8, generator=g)) for i in range(n)]


def shard_bytes() -> int:
    return len(encode_shard(samples(0), SPEC)[0])


def test_a_shard_goes_through_unchanged_and_is_gone_once_released(tmp_path: Path) -> None:
    spool = Spool(tmp_path, SPEC, budget_bytes=10 * shard_bytes(), plan_sha256="p")
    want = samples(3)
    assert spool.put("e0-00000", 0, want) == shard_bytes()
    got = spool.get("e0-00000", 0)
    assert [s.id for s in got] == [s.id for s in want]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.aux, b.aux) and torch.equal(a.last, b.last)
    assert spool.put("e0-00000", 0, want) == shard_bytes()  # a rerun of its producer: already there
    spool.release("e0-00000")
    assert spool.used_bytes() == 0 and not list((tmp_path / "shards").glob("e0-*"))


def test_producers_wait_for_room_and_never_pass_the_budget_by_more_than_one_shard(tmp_path: Path) -> None:
    one = shard_bytes()
    spool = Spool(tmp_path, SPEC, budget_bytes=int(2.5 * one), plan_sha256="p")
    peak, names = [0], [f"e0-{i:05d}" for i in range(12)]

    def produce(worker: int) -> None:  # as data_gen.produce does: the first missing shard of its own, again
        mine = list(range(worker, 12, 3))
        while (floor := spool.released_below()) < 12:
            todo = [i for i in mine if i >= floor and not spool.is_committed(names[i])]
            if not todo:
                time.sleep(0.005)
                continue
            i = todo[0]

            def urgent(i: int = i) -> bool:
                return any(w < i and w in mine for w in spool.waiting())

            spool.put(names[i], i, samples(i), alive=lambda urgent=urgent: not urgent())

    producers = [threading.Thread(target=produce, args=(w,)) for w in range(3)]
    for t in producers:
        t.start()
    for name in names:  # the reader consumes in plan order, slowly
        got = spool.get(name, int(name[-5:]), timeout_s=30)
        assert got[0].id == f"s{int(name[-5:])}-0"
        peak[0] = max(peak[0], spool.used_bytes())
        time.sleep(0.01)
        spool.release_below(int(name[-5:]) + 1)
    for t in producers:
        t.join(timeout=30)
    assert peak[0] <= 2.5 * one + one  # the budget, and at most the one shard the reader waits for
    assert spool.used_bytes() == 0


def test_an_empty_spool_takes_a_shard_larger_than_its_budget(tmp_path: Path) -> None:
    spool = Spool(tmp_path, SPEC, budget_bytes=10, plan_sha256="p")
    spool.put("a", 0, samples(1))
    stopped = []
    assert spool.put("b", 1, samples(2), alive=lambda: stopped.append(1) or len(stopped) < 3) == 0  # gave up
    assert spool.used_bytes() == shard_bytes()  # one shard over the budget, never two


def test_the_shard_a_reader_waits_for_evicts_the_work_made_furthest_ahead(tmp_path: Path) -> None:
    one = shard_bytes()
    spool = Spool(tmp_path, SPEC, budget_bytes=int(2.5 * one), plan_sha256="p")
    spool.put("s2", 2, samples(2))
    spool.put("s3", 3, samples(3))  # producers ran ahead: the spool is full
    waiting = threading.Thread(target=lambda: spool.get("s0", 0, timeout_s=10))
    waiting.start()  # the reader waits for seq 0
    while spool.waited_for() != 0:
        time.sleep(0.01)
    assert spool.put("s0", 0, samples(0)) == one
    waiting.join(timeout=10)
    assert sorted(spool.committed()) == ["s0", "s2"]  # s3, the furthest ahead, went to make room
    assert spool.used_bytes() <= 2.5 * one


def test_bad_spools_and_shards_are_named(tmp_path: Path) -> None:
    Spool(tmp_path, SPEC, budget_bytes=1000, plan_sha256="p")
    other = HarvestSpec(**{**SPEC.to_json(), "aux_layer_ids": (1, 2, 4)})
    with pytest.raises(StoreError, match=r"spool.json: a spool of another harvest \(spec.aux_layer_ids differ"):
        Spool(tmp_path, other, budget_bytes=1000, plan_sha256="p")
    with pytest.raises(StoreError, match=r"spool.json: plan_sha256 is 'p' there, 'q' here"):
        Spool(tmp_path, SPEC, budget_bytes=1000, plan_sha256="q")
    Spool(tmp_path, SPEC, budget_bytes=2000, plan_sha256="p")  # another budget on a rerun is fine
    spool = Spool(tmp_path, SPEC, budget_bytes=10**6, plan_sha256="p")
    spool.put("x", 0, samples(1))
    path = tmp_path / "shards" / "x.safetensors"
    path.write_bytes(path.read_bytes()[:-7])  # truncated
    with pytest.raises(StoreError, match=r"x.safetensors: missing, or its sha256 differs from x.json"):
        spool.get("x", 0)
    with pytest.raises(StoreError, match=r"y.json: not produced within 0 s"):
        spool.get("y", 1, timeout_s=0.0)
    with pytest.raises(StoreError, match=r"z.json: not produced, and no producer is left"):
        spool.get("z", 2, alive=lambda: False)


def test_a_dead_silent_or_stopped_producer_is_named(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    from eagle3.store.spool import Heartbeat, missing_producer

    assert missing_producer(tmp_path, 0, stale_s=60) is None  # no producer yet: the reader's wait limit decides
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = Heartbeat(tmp_path, 0, 2)
    dead.record["pid"] = gone.pid
    dead.beat(made=3)
    Heartbeat(tmp_path, 1, 2).beat(force=True)  # this process: alive
    assert missing_producer(tmp_path, 3, stale_s=60) is None  # seq 3 is worker 1's
    why = missing_producer(tmp_path, 4, stale_s=60)
    assert why is not None and f"producer 0/2 (pid {gone.pid} on " in why and "died" in why and "3 shards" in why
    assert "--shard 0/2" in why
    Heartbeat(tmp_path, 1, 2).beat(state="stopped: 1 epochs made")
    assert "producer 1/2 (pid" in missing_producer(tmp_path, 5, stale_s=60) and "stopped: 1 epochs made" in \
        missing_producer(tmp_path, 5, stale_s=60)
    alive = Heartbeat(tmp_path, 1, 2)
    alive.beat(force=True)
    time.sleep(0.05)
    assert "silent for" in missing_producer(tmp_path, 5, stale_s=0.01)  # a producer on another node: its heartbeat
