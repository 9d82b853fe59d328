"""Worker processes end with their parent, however it ends (a killed run leaves nothing writing)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PARENT = """
import multiprocessing, sys, time
from pathlib import Path

def worker(path):
    from eagle3.processes import exit_with_parent
    if sys.argv[2] == "watched":
        exit_with_parent()
    import os
    Path(path).write_text(str(os.getpid()))
    time.sleep(60)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    ctx.Process(target=worker, args=(sys.argv[1],), daemon=True).start()
    time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("kind", ["watched", "plain"])
def test_a_killed_parents_worker_exits_only_when_it_watches(tmp_path: Path, kind: str) -> None:
    script, pid_file = tmp_path / "parent.py", tmp_path / "worker.pid"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(pid_file), kind], cwd=Path(__file__).parents[1])
    deadline = time.time() + 60
    while not (pid_file.is_file() and pid_file.read_text()):
        assert time.time() < deadline and parent.poll() is None, "the worker did not start"
        time.sleep(0.1)
    worker = int(pid_file.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while _alive(worker) and time.time() < deadline:
        time.sleep(0.1)
    try:
        # the negative control: a daemon worker without the watcher outlives its killed parent
        assert _alive(worker) is (kind == "plain")
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
