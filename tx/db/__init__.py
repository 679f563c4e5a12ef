"""Persistence: SQLModel tables, the durable work queue and the metadata the API serves.

`open_database(url, data_dir)` returns a `Database` with `.queue` (the engine's `WorkQueue`, plus
submit/long-poll for the API) and `.records` (sessions, runs, samplers, checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import Engine

from tx.db.connect import WriteLock, database_url, is_sqlite, open_engine
from tx.db.notify import Notifier, PgListener
from tx.db.queue import SqlQueue
from tx.db.records import Records, owner_of
from tx.db.submit import DuplicateRequestError, Submitted

__all__ = ["Database", "DuplicateRequestError", "Records", "SqlQueue", "Submitted", "open_database", "owner_of"]


@dataclass
class Database:
    engine: Engine
    notifier: Notifier
    queue: SqlQueue
    records: Records
    listener: PgListener | None = None

    def close(self) -> None:
        if self.listener is not None:
            self.listener.stop()
        self.engine.dispose()


def open_database(
    url: str | None, data_dir: str | Path, *, session_timeout_s: float = 600.0, open_session_timeout_s: float = 86400.0
) -> Database:
    """Open (and create) the database; with Postgres also start the LISTEN relay."""
    full_url = database_url(url, data_dir)
    engine = open_engine(full_url)
    notifier = Notifier()
    lock = WriteLock(enabled=is_sqlite(engine))
    listener = None
    if not is_sqlite(engine):
        listener = PgListener(engine.url.set(drivername="postgresql").render_as_string(hide_password=False), notifier)
        listener.start()
    return Database(
        engine,
        notifier,
        SqlQueue(engine, notifier, lock),
        Records(engine, lock, session_timeout_s, open_session_timeout_s),
        listener,
    )
