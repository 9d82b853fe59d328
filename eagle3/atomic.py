"""Write files and folders so that a reader never sees half of them.

Everything the project persists goes through here: write under a temporary name in the
same directory, fsync, then rename over the final name (atomic on POSIX).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from eagle3.errors import OutputExistsError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; the final file gets the usual mode
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str], *,
               replaces: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it is renamed to ``path``.

    On any error the temporary folder is removed and ``path`` is left untouched. An
    existing ``path`` is replaced only after the new folder is complete. ``replaces``: for
    folders a user names (an ``--out``), see :func:`check_replaceable`.
    """
    path = Path(path)
    if replaces is not None:
        check_replaceable(path, replaces)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; the final folder gets the usual mode
    try:
        yield tmp
        mode = 0o666 & ~_umask()  # the usual mode: some writers (safetensors' save_file) create their files 0600
        for child in tmp.rglob("*"):
            if child.is_file():
                os.chmod(child, mode)
                with open(child, "rb") as f:
                    os.fsync(f.fileno())
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_leftovers(folder: str | os.PathLike[str], names: list[str]) -> list[str]:
    """Undo what a kill left of the writers above for each of ``names`` in ``folder``: their
    temporaries are deleted, and a folder killed between ``atomic_dir``'s two renames gets its
    previous version back. Returns the names of the entries removed or restored."""
    folder = Path(folder)
    touched = []
    for name in names:
        for tmp in sorted(folder.glob(f".{glob.escape(name)}.*.tmp")):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            touched.append(tmp.name)
        old = folder / f".{name}.old"
        if old.is_dir():
            if (folder / name).exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(old, folder / name)
            touched.append(old.name)
    return touched


def check_replaceable(path: str | os.PathLike[str], replaces: Callable[[Path], bool]) -> None:
    """Raise OutputExistsError (a FileExistsError) unless ``path`` is absent, an empty folder, or a folder that
    ``replaces`` says is an earlier output of the same writer: a mistyped ``--out`` must never
    delete a user's file or folder. Writers call it again before their work, to fail early."""
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return
    if not path.is_dir() or path.is_symlink() or (any(path.iterdir()) and not replaces(path)):
        raise OutputExistsError(f"{path} exists and is not an earlier output of this command; "
                                "choose another output path, or delete it first")


def holds_only(*names: str) -> Callable[[Path], bool]:
    """A ``replaces`` test for :func:`atomic_dir`: the folder holds nothing but these names."""
    return lambda folder: all(child.name in names for child in folder.iterdir())


@contextlib.contextmanager
def output_dir(path: str | os.PathLike[str], *, scratch: tuple[str, ...] = ()) -> Iterator[Path]:
    """Create ``path`` (with its parents) for a run's output; if the run fails and the folder
    is one this call created that holds nothing but ``scratch`` entries (lock files), remove it
    again: a failed first run leaves no empty output behind that looks like a result."""
    path = Path(path)
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    except BaseException:
        if created and path.is_dir() and all(child.name in scratch for child in path.iterdir()):
            shutil.rmtree(path, ignore_errors=True)
        raise
