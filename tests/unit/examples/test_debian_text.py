"""examples.debian_text: a package's files fetched without root, through a stand-in apt-get.

``apt-get`` is replaced on PATH by a script that "downloads" a ``.deb`` built here with
``dpkg-deb`` (no network); ``dpkg -x`` is Debian's own. Skipped where dpkg is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from examples.debian_text import DebianFetchError, fortunes_text

pytestmark = pytest.mark.skipif(
    shutil.which("dpkg-deb") is None or shutil.which("dpkg") is None, reason="needs dpkg"
)


def fake_apt_get(tmp_path: Path, files: dict[str, str], fail: bool = False) -> Path:
    """A directory holding an ``apt-get`` whose ``download`` copies a .deb of ``files``."""
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        "Package: fortunes\nVersion: 1\nArchitecture: all\nMaintainer: t <t@t>\nDescription: test\n"
    )
    for name, text in files.items():
        path = root / "usr/share/games/fortunes" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    deb = tmp_path / "fortunes_1_all.deb"
    subprocess.run(["dpkg-deb", "--build", str(root), str(deb)], check=True, capture_output=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "apt-get"
    body = "echo 'E: Unable to locate package' >&2; exit 100" if fail else f"cp {deb} ."
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return bin_dir


def test_the_fortune_files_are_read_in_name_order_without_their_index_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {"b": "Second.\n%\nThird.\n", "a": "First.\n", "a.dat": "binary index"}
    monkeypatch.setenv("PATH", f"{fake_apt_get(tmp_path, files)}{os.pathsep}{os.environ['PATH']}")

    text = fortunes_text()

    assert text == "First.\n\nSecond.\n\nThird.\n"


def test_a_failed_download_says_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = fake_apt_get(tmp_path, {"a": "x\n"}, fail=True)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # not root: no apt-get update

    with pytest.raises(DebianFetchError, match="apt-get download fortunes failed"):
        fortunes_text()
