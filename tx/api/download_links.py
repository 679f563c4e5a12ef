"""Unauthenticated download links that every API process of a server honours, and that survive its restarts.

The SDK fetches a checkpoint's archive and an export's files with plain GETs, no API key: the link itself is
the permission. A link is `<directory>.<expiry>.<signature>`: the checkpoint directory relative to the data
directory (base64), when the link stops working (unix seconds), and an HMAC-SHA256 over both under a key kept
in the data directory (`.download-key`, made once by whichever process needs it first). API servers behind a
load balancer share the data directory, so a link one of them issued works on any other; kept in one
process's memory, half the links reached a server that did not know them, and a restart lost every one.

Expiries are rounded up to a multiple of half the time to live, so a client asking again and again within
that half gets the same link back, valid for between half and all of `ttl_s`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import os
import secrets
import time
from pathlib import Path

KEY_FILE = ".download-key"


class DownloadLinks:
    def __init__(self, data_dir: Path, ttl_s: float) -> None:
        self.data_dir, self.ttl_s = Path(data_dir).resolve(), ttl_s
        self._key: bytes | None = None

    def issue(self, directory: Path) -> tuple[str, float]:
        """A link to `directory` (which lies in the data directory) and the time it stops working."""
        relative = Path(directory).resolve().relative_to(self.data_dir).as_posix()
        period = max(self.ttl_s / 2, 1.0)
        expires = int((math.floor(time.time() / period) + 2) * period)
        name = base64.urlsafe_b64encode(relative.encode()).decode().rstrip("=")
        return f"{name}.{expires}.{self._sign(name, expires)}", float(expires)

    def resolve(self, token: str) -> Path | None:
        """The directory a link names; None for a link this server did not issue, a changed one, or an
        expired one. The directory is checked to lie in the data directory once more."""
        parts = token.split(".")
        if not token.isascii() or len(parts) != 3 or not parts[1].isdigit() or len(parts[1]) > 12:
            return None  # "²" is a digit to isdigit, and compare_digest raises on other non-ASCII text
        name, expires, signature = parts[0], int(parts[1]), parts[2]
        if not hmac.compare_digest(signature, self._sign(name, expires)) or expires < time.time():
            return None
        try:
            relative = base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode()
        except ValueError:
            return None
        directory = (self.data_dir / relative).resolve()
        return directory if directory.is_relative_to(self.data_dir) and directory != self.data_dir else None

    def _sign(self, name: str, expires: int) -> str:
        digest = hmac.new(self._secret(), f"{name}\n{expires}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest[:24]).decode()

    def _secret(self) -> bytes:
        if self._key is None:
            self._key = _shared_key(self.data_dir / KEY_FILE)
        return self._key


def _shared_key(path: Path) -> bytes:
    """The key in `path`, made first if there is none: written to a temporary file and linked into place,
    so two processes starting together both end up reading the one that won."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(secrets.token_bytes(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
        except OSError:  # a filesystem without hard links: the first to create the name writes it
            _write_once(path, tmp.read_bytes())
        finally:
            tmp.unlink()
    for _ in range(100):  # a key another process is still writing (no hard links) reads short for a moment
        key = path.read_bytes()
        if len(key) == 32:
            return key
        time.sleep(0.01)
    raise RuntimeError(f"{path} is not a download key (32 bytes); remove it and restart")


def _write_once(path: Path, key: bytes) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as file:
        file.write(key)
