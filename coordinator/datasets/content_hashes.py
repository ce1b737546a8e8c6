"""Content hashes of data sets, computed once per version of their files.

A train job's file data set is named to its workers by the sha256 of its bytes
(``shared.training.data_files.content_hash``), which keys their shard caches
(``worker.training.shard_cache``). Hashing reads every byte, so it is done once per file
version: the cache key is each file's (name, size, mtime_ns) (``data_files.file_version``);
a file rewritten in place gets a new mtime and is hashed again.
"""

from __future__ import annotations

import threading
from pathlib import Path

from shared.logging import get_logger
from shared.training.data_files import FileVersion, content_hash, file_version

log = get_logger(__name__)


class ContentHashes:
    """Hashes of data sets by file version; thread-safe (jobs open their data in threads)."""

    def __init__(self, max_entries: int = 256) -> None:
        """Keep at most ``max_entries`` hashes (the oldest are forgotten first)."""
        self._hashes: dict[FileVersion, str] = {}
        self._max = max_entries
        self._lock = threading.Lock()

    def get(self, path: Path) -> str:
        """The sha256 (hex) of the data set at ``path`` (an ``.npz`` or a directory).

        Blocking (reads the files the first time a version is seen): call it in a thread.

        Raises:
            OSError: a file cannot be read.
        """
        version = file_version(path)
        with self._lock:
            known = self._hashes.get(version)
        if known is not None:
            return known
        digest = content_hash(path)
        if file_version(path) != version:  # changed while it was read: do not keep it
            return digest
        with self._lock:
            while len(self._hashes) >= self._max:
                self._hashes.pop(next(iter(self._hashes)))
            self._hashes[version] = digest
        log.info("dataset_hashed", path=path.name, sha256=digest)
        return digest
