"""Worker processes that die with the run that started them.

A spawned worker marked ``daemon`` is stopped when its parent exits normally, but not when the
parent is killed (SIGTERM, SIGKILL, an out-of-memory kill): it would go on generating and writing
into a folder its run no longer owns, perhaps one a new run has started over in. A worker that
calls :func:`exit_with_parent` first exits within moments of its parent, whatever killed it.
"""

from __future__ import annotations

import multiprocessing
import os
import threading


def exit_with_parent(code: int = 1) -> None:
    """In a spawned worker: a watcher thread that ends this process (``os._exit``, nothing more run)
    as soon as the parent process is gone. Outside a ``multiprocessing`` worker: nothing."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns when the parent's end of its sentinel closes: the parent is gone
        os._exit(code)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


__all__ = ["exit_with_parent"]
