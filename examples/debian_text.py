"""Fetch a Debian package's files without root: ``apt-get download`` then ``dpkg -x``.

``apt-get download`` writes the package's ``.deb`` into the working directory and needs no
root when the machine's package lists are there; ``dpkg -x`` unpacks it into a directory of
ours, installing nothing. Root is needed only when the lists are missing (a fresh container):
then, as root, ``apt-get update`` is run once and the download tried again; as another user
the error says which command to run.

The text of the README's language-model example is Debian's ``fortunes`` package: the
fortune cookie files of fortune-mod (quotations, jokes, poems), fortunes separated by lines
holding ``%``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

FORTUNES_DIR = "usr/share/games/fortunes"


class DebianFetchError(RuntimeError):
    """A package could not be downloaded or unpacked; the message says what to run."""


def download_deb(package: str, into: Path, timeout_s: float = 300.0) -> Path:
    """Download ``package``'s ``.deb`` into ``into`` with ``apt-get download``.

    Args:
        package: a Debian binary package name.
        into: an existing directory.
        timeout_s: the longest one apt-get call may take, seconds.

    Returns:
        The downloaded ``.deb``.

    Raises:
        DebianFetchError: apt-get is missing, or the download failed (as root after one
            ``apt-get update``).
    """
    if shutil.which("apt-get") is None:
        raise DebianFetchError("apt-get is not installed: a Debian or Ubuntu machine is needed")

    def attempt() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["apt-get", "download", "-q", package],
            cwd=into,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    done = attempt()
    if done.returncode != 0 and os.geteuid() == 0:
        # No package lists yet (a fresh container): root may fetch them once.
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=timeout_s)
        done = attempt()
    debs = sorted(into.glob(f"{package}_*.deb"))
    if done.returncode != 0 or not debs:
        raise DebianFetchError(
            f"apt-get download {package} failed ({done.stderr.strip() or done.returncode}); "
            "the package lists may be missing: run `sudo apt-get update` once, or pass a "
            "text file of your own"
        )
    return debs[-1]


def extract_deb(deb: Path, into: Path, timeout_s: float = 120.0) -> Path:
    """Unpack a ``.deb``'s files under ``into`` with ``dpkg -x`` (no root, nothing installed).

    Raises:
        DebianFetchError: dpkg is missing or failed.
    """
    if shutil.which("dpkg") is None:
        raise DebianFetchError("dpkg is not installed: a Debian or Ubuntu machine is needed")
    done = subprocess.run(
        ["dpkg", "-x", str(deb), str(into)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise DebianFetchError(f"dpkg -x {deb.name} failed: {done.stderr.strip()}")
    return into


def fortunes_text(package: str = "fortunes") -> str:
    """The text of every fortune file of Debian's ``fortunes`` package, in file name order.

    The files are read as UTF-8 (invalid bytes replaced); each fortune's ``%`` separator line
    becomes an empty line. The package is downloaded into a temporary directory, removed
    before this returns.

    Returns:
        The text, about 2.5 million characters for bookworm's fortunes 1:1.99.1-7.3.

    Raises:
        DebianFetchError: the package could not be fetched or holds no fortune files.
    """
    with tempfile.TemporaryDirectory(prefix="neuroshard-fortunes-") as tmp:
        root = extract_deb(download_deb(package, Path(tmp)), Path(tmp) / "root")
        files = sorted(
            p
            for p in (root / FORTUNES_DIR).glob("*")
            if p.is_file() and not p.is_symlink() and p.suffix not in (".dat", ".u8")
        )
        if not files:
            raise DebianFetchError(f"{package} holds no fortune files under /{FORTUNES_DIR}")
        parts = []
        for path in files:
            text = path.read_bytes().decode("utf-8", errors="replace")
            parts.append("\n".join("" if line == "%" else line for line in text.splitlines()))
        return "\n\n".join(parts) + "\n"
