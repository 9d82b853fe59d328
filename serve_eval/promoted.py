"""Promoted drafts: what a live trainer publishes and a server picks up between requests.

A live folder (``--live DIR``) holds, beside the server's ``capture/``::

    serving.json          the draft to serve: version, folder, every file's sha256, the versions
                          before it (replaced atomically, under ``serving.lock``)
    drafts/v<NNNN>/       each promoted draft (copied under a temporary name, then renamed)
    events.jsonl          every promotion, refusal, swap and rollback, with its figures

Version 0 is the draft the server started with (``serving.json`` absent). The server checks a new
version's checksums and its fit to the target before it serves it; a version that fails either is
never served (an event says why). A request runs on the draft it started with: the server swaps
between requests only. A rollback (:func:`rollback`, the live trainer's, on a drop in served
acceptance) is a pointer change like a promotion: the server follows it the same way.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3.atomic import atomic_write_text
from eagle3.errors import Eagle3Error
from eagle3.fingerprint import sha256_file

SERVING = "serving.json"
EVENTS = "events.jsonl"
DRAFTS = "drafts"


class PromotionError(Eagle3Error, ValueError):
    """A candidate that cannot be served (another target or vocabulary, a damaged file): never promoted."""


def checksums(folder: Path) -> dict[str, str]:
    """sha256 of every file of a draft folder, by relative name."""
    return {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def check_files(folder: Path, files: dict[str, str]) -> str | None:
    """Why ``folder`` does not hold exactly ``files`` (a name and what differs), or None."""
    try:
        found = checksums(folder)
    except OSError as err:
        return f"{folder}: {err}"
    for name, digest in files.items():
        if name not in found:
            return f"{folder}/{name} is missing"
        if found[name] != digest:
            return f"{folder}/{name}: sha256 {found[name][:12]} differs from the promoted {digest[:12]}"
    extra = sorted(set(found) - set(files))
    return f"{folder}/{extra[0]} was not promoted" if extra else None


@contextlib.contextmanager
def _locked(live: Path) -> Iterator[None]:
    live.mkdir(parents=True, exist_ok=True)
    with (live / "serving.lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_serving(live: str | Path) -> dict[str, Any] | None:
    """The promotion pointer, or None (version 0 serves: the server's own draft)."""
    path = Path(live) / SERVING
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except ValueError as err:  # written atomically: only a hand edit gets here
        raise PromotionError(f"{path}: {err}") from None


def log_event(live: str | Path, event: str, **figures: Any) -> dict[str, Any]:
    """Append one event line (one write: whole or not at all) and print it on stderr."""
    entry = {"event": event, "time": round(time.time(), 3), **figures}
    line = json.dumps(entry, sort_keys=True)
    with (Path(live) / EVENTS).open("a", encoding="utf-8") as f:
        f.write(line + "\n")
    print(f"live: {line}", file=sys.stderr)
    return entry


def serving_version(live: str | Path) -> int:
    pointer = read_serving(live)
    return int(pointer["version"]) if pointer else 0


def check_candidate(live: Path, source: Path) -> None:
    """Refuse a draft folder that cannot serve the target whose requests ``live/capture`` holds:
    hidden size, vocabulary, aux layer ids or tokenizer, named."""
    from eagle3.export import check_draft_fits_target, load_draft
    from serve_eval.capture import read_spec

    try:
        loaded = load_draft(source)
    except (Eagle3Error, ValueError, OSError) as err:
        raise PromotionError(f"{source}: not a draft folder ({err})") from None
    spec_path = live / "capture"
    if not (spec_path / "capture.json").is_file():
        return
    spec = read_spec(spec_path)
    try:
        check_draft_fits_target(loaded, hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
                                aux_layer_ids=spec.aux_layer_ids)
    except Eagle3Error as err:
        raise PromotionError(f"not promoted: {err} (the target of {spec_path}/capture.json)") from None
    trained_with = loaded.meta.get("tokenizer_sha256")
    if trained_with and trained_with != spec.tokenizer_sha256:
        raise PromotionError(f"not promoted: {source}: tokenizer_sha256 {trained_with[:12]} differs from the "
                             f"served target's {spec.tokenizer_sha256[:12]} ({spec_path}/capture.json)")


def publish(live: str | Path, source: str | Path, figures: dict[str, Any]) -> int:
    """Promote draft folder ``source`` (checked against the served target first): copied to
    ``drafts/v<N>`` (temp name, then rename), then the pointer replaced. Returns the new version."""
    live, source = Path(live), Path(source)
    check_candidate(live, source)
    files = checksums(source)
    with _locked(live):
        pointer = read_serving(live)
        version = max([int(pointer["version"]) if pointer else 0, *_known_versions(live)]) + 1
        dest = live / DRAFTS / f"v{version:04d}"
        tmp = live / DRAFTS / f".v{version:04d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp)
        why = check_files(tmp, files)
        if why is not None:
            raise PromotionError(f"copying {source}: {why}")
        tmp.rename(dest)
        atomic_write_text(dest.with_suffix(".json"), json.dumps({"source": str(source.resolve()), **figures}))
        history = [*(pointer.get("history", []) if pointer else []),
                   *([_entry(pointer)] if pointer else [{"version": 0}])]
        new = {"version": version, "path": str(dest.relative_to(live)), "files": files, "source": str(source),
               "digest": _digest(files), "history": history[-16:], "rolled_back": (pointer or {}).get(
                   "rolled_back", [])}
        atomic_write_text(live / SERVING, json.dumps(new, indent=2))
    log_event(live, "promoted", version=version, source=str(source), **figures)
    return version


def published_from(live: str | Path, source: str | Path) -> int | None:
    """The version a draft folder ``source`` was published as (whatever serves now), or None."""
    wanted = str(Path(source).resolve())
    for path in sorted((Path(live) / DRAFTS).glob("v[0-9]*.json")):
        try:
            if json.loads(path.read_text(encoding="utf-8")).get("source") == wanted:
                return int(path.stem[1:])
        except (OSError, ValueError):
            continue
    return None


def rollback(live: str | Path, version: int, to: int, **figures: Any) -> dict[str, Any] | None:
    """Point back from ``version`` (if it still serves) to version ``to`` (one it promoted before); the
    new pointer, or None."""
    live = Path(live)
    with _locked(live):
        pointer = read_serving(live)
        if not pointer or int(pointer["version"]) != version:
            return None
        history = pointer.get("history", [])
        at = next((i for i in range(len(history) - 1, -1, -1) if int(history[i]["version"]) == to), None)
        if at is None:
            return None
        new = {**history[at], "history": history[:at],
               "rolled_back": [*pointer.get("rolled_back", []), version]}
        atomic_write_text(live / SERVING, json.dumps(new, indent=2))
    log_event(live, "rolled_back", version=version, to=to, **figures)
    return new


def _entry(pointer: dict[str, Any]) -> dict[str, Any]:
    return {k: pointer[k] for k in ("version", "path", "files", "digest", "source") if k in pointer}


def _digest(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _known_versions(live: Path) -> list[int]:
    return [int(p.name[1:]) for p in (live / DRAFTS).glob("v[0-9]*") if p.name[1:].isdigit()]


class DraftFollower:
    """The server's side: between requests, serve the version the pointer names (a promotion or a
    rollback), its files and fit checked first. A version that cannot be served is refused and the
    pointer put back on the version that serves, so the pointer always names what serves."""

    def __init__(self, live: str | Path, load: Any) -> None:
        """``load(folder)``: the draft of a promoted folder, checked against the target (None: the
        server's own draft, version 0)."""
        self.live, self.load = Path(live), load
        self.version = 0
        self.refused: set[int] = set()  # versions never to try again
        self.counts = {"swapped": 0, "refused": 0}
        self._seen: tuple[int, int, int] | None = None

    def follow(self, swap: Any) -> bool:
        """Where the pointer names another version: load and check it, then ``swap(draft)``; the
        version moves only once the swap succeeded. Cheap when nothing changed (one stat). True on a
        swap."""
        path = self.live / SERVING
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # replaced atomically: a new inode each time
        if stamp == self._seen:
            return False
        try:
            pointer = read_serving(self.live)
        except PromotionError as err:  # edited by hand: said once, the draft serving kept
            self._seen = stamp
            log_event(self.live, "refused_by_server", why=str(err))
            return False
        self._seen = stamp
        version = int(pointer["version"]) if pointer else 0
        if pointer is None or version == self.version or version in self.refused:
            return False
        folder = self.live / pointer["path"] if "path" in pointer else None  # None: the server's own draft
        why = check_files(folder, pointer["files"]) if folder is not None else None
        if why is None:
            try:
                swap(self.load(folder))
            except Exception as err:  # a draft that cannot serve: refused, the one serving kept
                why = f"{folder}: {type(err).__name__}: {err}"
        if why is not None:
            self.refused.add(version)
            self.counts["refused"] += 1
            log_event(self.live, "refused_by_server", version=version, why=why)
            if rollback(self.live, version, self.version, why="refused by the server") is not None:
                self._seen = None
            return False
        previous, self.version = self.version, version
        self.counts["swapped"] += 1
        log_event(self.live, "swapped", version=version, previous=previous)
        return True


def live_parts(live: str | Path, draft: str | None, target_name: str, target: Any, chat: Any, max_model_len: int,
               capture_bytes: int, capture_dtype: str) -> tuple[Any, DraftFollower | None]:
    """A server's ``--live DIR``: the capture into ``DIR/capture`` and, where a draft serves, the
    follower of ``DIR/serving.json`` (its drafts loaded and checked against ``target`` as the
    server's own ``draft``)."""
    from serve_eval.capture import CaptureWriter, serving_spec

    live = Path(live)
    spec = serving_spec(target, target_name, chat, capture_dtype, max_model_len)
    capture = CaptureWriter(live / "capture", spec, capture_bytes)
    if draft is None:
        return capture, None

    def load(folder: Path | None) -> Any:
        from eagle3.export import fit_to_target, load_draft

        loaded = load_draft(folder if folder is not None else draft)
        fit_to_target(loaded, target)
        return loaded.draft.to(device=target.device, dtype=target.dtype).eval()

    return capture, DraftFollower(live, load)


__all__ = ["DraftFollower", "PromotionError", "check_files", "checksums", "live_parts", "log_event", "publish",
           "published_from", "read_serving", "rollback", "serving_version"]
