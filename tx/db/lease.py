"""One engine per data directory and per database, held for the engine process's life.

A starting engine settles what the previous one left (`SqlQueue.recover`: work it had claimed fails, its
runs become `unloaded`) and sweeps half-written checkpoints. Run while another engine is live on the same
data, that recovery fails the other's running requests and strands its runs, and the sweep removes the
files its saves are writing. So an engine first takes the lease: an exclusive `flock` on
`<data dir>/engine.lock` (released by the kernel when the process dies, however it dies) and, on Postgres,
a session-level advisory lock keyed by the schema, on a connection of its own (released when that
connection closes). A second engine is refused before it touches anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger("tx.db")
LOCK_FILE = "engine.lock"
_ADVISORY = text("SELECT pg_try_advisory_lock(hashtext(current_schema() || :key))")
_ADVISORY_KEY = {"key": "/smolgym-engine"}


class EngineBusy(RuntimeError):
    """Another engine holds the data directory or the database."""


def _exit_lost() -> None:
    log.critical("another engine took the database's engine lease while it was lost; exiting (status 4)")
    os._exit(4)


class EngineLease:
    """Held until `release`. On Postgres a watchdog checks the lock's connection every `check_s`: a
    database restart drops the advisory lock with the connection, and a second engine could then start,
    recover (failing this one's running work, unloading its runs) and claim beside it. The watchdog takes
    the lock again as soon as the database answers; if another engine took it meanwhile, `on_lost` (exit,
    status 4) ends this one."""

    def __init__(
        self,
        fd: int,
        connection: Connection | None,
        engine: Engine | None = None,
        check_s: float = 5.0,
        on_lost: Callable[[], None] = _exit_lost,
    ) -> None:
        self._fd, self._connection, self._engine = fd, connection, engine
        self.check_s, self.on_lost = check_s, on_lost
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._checking = threading.Lock()  # held while the watchdog's query runs on the lock's connection
        if connection is not None and engine is not None:
            threading.Thread(target=self._watch, name="tx-lease", daemon=True).start()

    def _watch(self) -> None:
        """The check runs outside the lock: against a database that stopped answering it may wait for minutes,
        and `release` (a SIGTERM's orderly stop) must not wait with it."""
        while not self._stop.wait(self.check_s):
            with self._lock:
                connection = self._connection
            if connection is None:
                return
            try:
                with self._checking:
                    if self._stop.is_set():
                        return
                    connection.execute(text("SELECT 1"))
                if self._stop.is_set():  # released during the check, which `release` left alone
                    _drop(connection)
                    return
                continue
            except Exception:
                if self._stop.is_set():
                    _drop(connection)
                    return
                log.warning("the engine lease's database connection was lost; taking the lease again")
                with contextlib.suppress(Exception):
                    connection.invalidate()
            self._retake()

    def _retake(self) -> None:
        assert self._engine is not None
        while not self._stop.is_set():
            try:
                connection = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
                taken = bool(connection.execute(_ADVISORY, _ADVISORY_KEY).scalar())
            except Exception:  # the database is still away
                self._stop.wait(1.0)
                continue
            with self._lock:
                if self._stop.is_set():
                    _drop(connection)  # it may hold the lock it just took: never back into the pool
                    return
                if taken:
                    self._connection = connection
                    log.warning("engine lease taken again")
                    return
            connection.close()
            self.on_lost()
            return

    def release(self) -> None:
        """Ends the lease. A connection the watchdog is still checking is left to the watchdog, which drops it
        once its query returns (closing it under a running query is not safe), or to the process's exit."""
        self._stop.set()
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None and self._checking.acquire(blocking=False):
            try:
                _drop(connection)
            finally:
                self._checking.release()
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1


def _drop(connection: Connection) -> None:
    """Closed, not returned to the pool still holding the advisory lock (a database already gone released
    the lock with the connection)."""
    with contextlib.suppress(Exception):
        connection.invalidate()
        connection.close()


def take_engine_lease(engine: Engine, data_dir: Path) -> EngineLease:
    """The lease, or `EngineBusy` naming what holds it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = _lock_file(data_dir / LOCK_FILE)
    if engine.dialect.name != "postgresql":
        return EngineLease(fd, None)
    connection = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    if not connection.execute(_ADVISORY, _ADVISORY_KEY).scalar():
        connection.close()
        os.close(fd)
        raise EngineBusy(
            f"another SmolGym engine is running on the database {engine.url.render_as_string(hide_password=True)}"
            " (its schema): run one engine per database, and API-only processes beside it (--role api)"
        )
    return EngineLease(fd, connection, engine)


def _lock_file(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise EngineBusy(
            f"another SmolGym engine (pid {holder}) is running on the data directory {path.parent}: stop it, or "
            "give this one its own --data-dir (API-only processes share it with --role api)"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd
