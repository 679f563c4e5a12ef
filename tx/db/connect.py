"""Open the database: a SQLite file in WAL mode inside the data directory, or Postgres by URL.

SQLite allows one writer at a time; `Database.write_lock` serializes our own writers in-process so
that they queue on a cheap Python lock instead of spinning on SQLITE_BUSY. On Postgres the lock is
a no-op and the database does the concurrency control.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Index, event, text
from sqlalchemy.engine import Connection, Engine, create_engine, make_url
from sqlmodel import SQLModel

from tx.db import tables  # noqa: F401  (registers the tables on SQLModel.metadata)

log = logging.getLogger("tx.db")

# libpq's TCP settings for every Postgres connection: a vanished peer is found in seconds (unacknowledged data:
# `tcp_user_timeout`; an idle connection: keepalives), not after the kernel's quarter hour of retransmissions,
# and a connection attempt gives up after `connect_timeout` seconds.
KEEPALIVE: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
             "tcp_user_timeout": 15000}  # fmt: skip
CONNECT_TIMEOUT_S = 10


def tcp_settings(given: Collection[str]) -> dict[str, Any]:
    """`KEEPALIVE` and `CONNECT_TIMEOUT_S` as libpq keywords, less those the URL sets itself (which win)."""
    return {k: v for k, v in {**KEEPALIVE, "connect_timeout": CONNECT_TIMEOUT_S}.items() if k not in given}


# Held while the tables are created: two processes creating them at once both see them missing, and the
# second's CREATE TABLE fails on Postgres's catalog (a unique violation on pg_type).
SCHEMA_LOCK_KEY = 0x736D6F6C  # "smol"


def database_url(url: str | None, data_dir: str | Path) -> str:
    """The URL to use: explicit, else `<data_dir>/smolgym.db`. Accepts plain `postgresql://` URLs."""
    if not url:
        path = Path(data_dir).resolve()
        path.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{path / 'smolgym.db'}"
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def is_postgres_url(url: str | None) -> bool:
    """True for a Postgres URL (any driver spelling); None means the SQLite file in the data directory."""
    return bool(url) and str(url).startswith(("postgresql:", "postgresql+", "postgres:"))


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
        settings = tcp_settings(make_url(url).query)
        engine = create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True, connect_args=settings)
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":  # API and engine processes starting together on a new schema
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
        SQLModel.metadata.create_all(conn)
        if engine.dialect.name != "postgresql":
            for index in _indexes():  # a database made before an index was added gets it
                index.create(conn, checkfirst=True)
        _allow_nan_metrics(engine, conn)
        _widen_integers(engine, conn)
    if engine.dialect.name == "postgresql":
        _add_indexes_concurrently(engine)
    return engine


def _indexes() -> list[Index]:
    return [index for table in SQLModel.metadata.sorted_tables for index in table.indexes]


def _add_indexes_concurrently(engine: Engine) -> None:
    """Postgres databases made before an index was added: built beside live servers (a plain CREATE INDEX
    blocks every write to a large `futures` table while it builds), outside any transaction."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for index in _indexes():
            columns = ", ".join(column.name for column in index.columns)
            try:
                conn.exec_driver_sql(
                    f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {index.name} ON {index.table.name} ({columns})"  # type: ignore[union-attr]
                )
            except Exception:  # another process building it at the same moment, say: it is there or will be
                log.warning("could not add index %s; it is only an optimisation", index.name, exc_info=True)


def _widen_integers(engine: Engine, conn: Connection) -> None:
    """Postgres databases made before `checkpoints.size_bytes` and `futures.seq_id` were 64-bit (SQLite's
    integers always are): a checkpoint past 2 GiB or a seq_id past 2^31 failed to store."""
    if engine.dialect.name == "postgresql":
        for table, column in (("checkpoints", "size_bytes"), ("futures", "seq_id")):
            if _pg_column(conn, table, column)[0] != "bigint":
                conn.exec_driver_sql(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE BIGINT")


def _pg_column(conn: Connection, table: str, column: str) -> tuple[str, str]:
    """(data_type, is_nullable) of a column in the current schema. Read before any ALTER TABLE: an ALTER
    takes an exclusive lock even when it changes nothing, and a server starting beside live ones (a
    restarted API server) then deadlocks against their queries."""
    row = conn.execute(
        text(
            "SELECT data_type, is_nullable FROM information_schema.columns"
            " WHERE table_schema = current_schema() AND table_name = :table AND column_name = :column"
        ),
        {"table": table, "column": column},
    ).one()
    return str(row[0]), str(row[1])


def _allow_nan_metrics(engine: Engine, conn: Connection) -> None:
    """Databases made before metric values could be NaN (stored as NULL) have `metrics.value NOT NULL`."""
    if engine.dialect.name == "sqlite":
        columns = conn.exec_driver_sql("PRAGMA table_info(metrics)").fetchall()
        if any(c[1] == "value" and c[3] for c in columns):
            conn.exec_driver_sql("ALTER TABLE metrics RENAME TO metrics_old")
            for index in conn.exec_driver_sql("PRAGMA index_list(metrics_old)").fetchall():
                if not index[1].startswith("sqlite_autoindex"):
                    conn.exec_driver_sql(f'DROP INDEX "{index[1]}"')
            tables.MetricRow.__table__.create(conn)  # type: ignore[attr-defined]
            conn.exec_driver_sql("INSERT INTO metrics SELECT * FROM metrics_old")
            conn.exec_driver_sql("DROP TABLE metrics_old")
    elif engine.dialect.name == "postgresql" and _pg_column(conn, "metrics", "value")[1] == "NO":
        conn.exec_driver_sql("ALTER TABLE metrics ALTER COLUMN value DROP NOT NULL")


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
