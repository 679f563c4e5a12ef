"""Open the database: a SQLite file in WAL mode inside the data directory, or Postgres by URL.

SQLite allows one writer at a time; `Database.write_lock` serializes our own writers in-process so
that they queue on a cheap Python lock instead of spinning on SQLITE_BUSY. On Postgres the lock is
a no-op and the database does the concurrency control.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine, create_engine
from sqlmodel import SQLModel

from tx.db import tables  # noqa: F401  (registers the tables on SQLModel.metadata)


def database_url(url: str | None, data_dir: str | Path) -> str:
    """The URL to use: explicit, else `<data_dir>/smolgym.db`. Accepts plain `postgresql://` URLs."""
    if not url:
        path = Path(data_dir).resolve()
        path.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{path / 'smolgym.db'}"
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def open_engine(url: str) -> Engine:
    """Create the SQLAlchemy engine and the tables (idempotent)."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False}, pool_size=16, max_overflow=16)
        event.listen(engine, "connect", _sqlite_pragmas)
    else:
        engine = create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True)
    SQLModel.metadata.create_all(engine)
    return engine


def is_sqlite(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite"


class WriteLock:
    """Serializes writers on SQLite; free on other databases."""

    def __init__(self, enabled: bool) -> None:
        self._lock = threading.Lock() if enabled else None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        if self._lock is None:
            yield
            return
        with self._lock:
            yield
