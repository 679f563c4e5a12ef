"""The files under an upload (`tx.upload_store`): a chunk written in place and checked, the staging state,
file hashes, and the `flock`s that keep API processes sharing the data directory apart. Leaf module.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HASH_READ = 8 << 20  # bytes read at a time when hashing a file


class UploadError(Exception):
    """A refused upload operation: `status` is the HTTP status the API answers with. Two are transient, and
    the client retries them: 423 (another request holds the upload) and 416 (a chunk at another offset
    than the bytes held: ask again where the file stands)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ChunkWriter:
    """Writes one chunk in place as its pieces arrive, hashing them; cut back to `offset` unless committed."""

    def __init__(self, path: Path, offset: int, length: int) -> None:
        self.offset, self.length, self.written = offset, length, 0
        self.accepted = False
        self._hash = hashlib.sha256()
        self._file = open(path, "r+b" if path.exists() else "w+b")  # noqa: SIM115 (closed by close())
        self._file.truncate(offset)  # bytes past the last verified chunk are not ours to keep
        self._file.seek(offset)

    def write(self, piece: bytes) -> None:
        if self.written + len(piece) > self.length:
            raise UploadError(400, f"chunk is longer than its declared {self.length} bytes")
        self._file.write(piece)
        self._hash.update(piece)
        self.written += len(piece)

    def commit(self, sha256: str) -> None:
        if self.written != self.length:
            raise UploadError(400, f"chunk ended after {self.written} of {self.length} bytes")
        if self._hash.hexdigest() != sha256:
            raise UploadError(400, "chunk does not match its X-Chunk-Sha256; send it again")
        self._file.flush()
        self.accepted = True

    def close(self) -> None:
        if not self.accepted:
            self._file.truncate(self.offset)
        self._file.close()


@contextmanager
def flocked(path: Path, name: str) -> Iterator[None]:
    """Hold an exclusive `flock` on `path`, or refuse at once if another process holds it. The lock files stay
    (one per upload name, empty): unlinking one while it is held would let a third process lock a new file of
    the same name."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UploadError(423, f"upload {name!r} is busy with another request; retry") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def read_state(staging: Path) -> dict[str, Any]:
    path = staging / "state.json"
    return json.loads(path.read_text()) if path.is_file() else {"files": [], "received": {}}


def write_state(staging: Path, state: dict[str, Any]) -> None:
    tmp = staging / ".state.json.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, staging / "state.json")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_READ):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive `flock` on `path` (made if missing): API processes sharing the data directory queue here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock
