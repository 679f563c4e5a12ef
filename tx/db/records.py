"""Metadata the API reads and writes directly: sessions, runs, sampling sessions, checkpoints.

Every read takes the caller's `owner` and filters by it, so another key's runs, samplers and
checkpoints look exactly like ones that do not exist. Rows with status `pending`/`failed` (their
creating request has not succeeded) are invisible to listings. Queued work goes through
`tx.db.queue` instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import col, select

from tx.db.checkpoint_records import CheckpointRecords, aware, unexpired
from tx.db.connect import WriteLock
from tx.db.tables import (
    LIVE_SESSION,
    CheckpointRow,
    FutureRow,
    MetricRow,
    SamplerSnapshotRow,
    SamplingSessionRow,
    SessionRow,
    TrainingRunRow,
    utcnow,
)


def owner_of(api_key: str) -> str:
    """Stable, non-reversible owner id for an API key."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:24]


class Records(CheckpointRecords):
    """CRUD on the metadata tables, always scoped to one owner (the checkpoints' half: `CheckpointRecords`)."""

    def __init__(
        self,
        engine: Engine,
        write_lock: WriteLock,
        session_timeout_s: float = 600.0,
        open_session_timeout_s: float = 86400.0,
    ) -> None:
        super().__init__(engine, write_lock)
        self.session_timeout = timedelta(seconds=session_timeout_s)
        self.open_session_timeout = timedelta(seconds=open_session_timeout_s)  # no heartbeats: idle this long
        self._creating = threading.Lock()

    @contextlib.contextmanager
    def run_creation(self) -> Iterator[None]:
        """Held around counting the live runs and inserting a new one (`--max-runs`, `--max-runs-per-key`):
        across threads and, on Postgres, across API processes (an advisory lock). Eight creates racing on two
        processes each saw room, and one key ended with six runs on a share of two."""
        with self._creating:
            if self.engine.dialect.name != "postgresql":
                yield
                return
            with self.engine.connect() as conn:
                conn.execute(text("SELECT pg_advisory_lock(hashtext(current_schema() || '/smolgym-runs'))"))
                try:
                    yield
                finally:
                    conn.execute(text("SELECT pg_advisory_unlock(hashtext(current_schema() || '/smolgym-runs'))"))
                    conn.commit()

    # ---- sessions -----------------------------------------------------------------------------

    def create_session(
        self,
        owner: str,
        tags: list[str],
        user_metadata: dict[str, Any],
        sdk_version: str | None,
        status: str = "active",
    ) -> str:
        session_id = str(uuid.uuid4())
        row = SessionRow(
            id=session_id,
            owner=owner,
            status=status,
            sdk_version=sdk_version,
            tags_json=json.dumps(tags),
            user_metadata_json=json.dumps(user_metadata),
        )
        self._add(row)
        return session_id

    def get_session(self, session_id: str, owner: str) -> SessionRow | None:
        with self._session() as session:
            row = session.get(SessionRow, session_id)
        if row is None or row.owner != owner:
            return None
        if row.status == "active" and utcnow() - aware(row.last_heartbeat_at) > self.session_timeout:
            row.status = "expired"
        return row

    def heartbeat(self, session_id: str, owner: str) -> str:
        """'ok', 'missing' (unknown to this owner) or 'gone' (finished or expired)."""
        row = self.get_session(session_id, owner)
        if row is None:
            return "missing"
        if row.status != "active":
            return "gone"
        self._update(SessionRow, session_id, last_heartbeat_at=utcnow())
        return "ok"

    def finish_session(self, session_id: str, owner: str, reason: str) -> list[TrainingRunRow] | None:
        """Mark the session finished (the first reason wins); None when the owner has no such session.

        Returns the runs to unload: the session's still-loaded runs when this call ended an active
        session (also one already past its heartbeat timeout but not yet reaped), else none.
        """
        with self.write_lock.held(), self._session() as session:
            row = session.get(SessionRow, session_id)
            if row is None or row.owner != owner:
                return None
            if row.finish_reason is not None:
                return []
            was_active = row.status in LIVE_SESSION
            row.status, row.finish_reason = "finished", reason
            runs: list[TrainingRunRow] = []
            if was_active:
                query = select(TrainingRunRow).where(
                    TrainingRunRow.session_id == session_id, TrainingRunRow.status == "ready"
                )
                runs = list(session.exec(query).all())
            session.commit()
        return runs

    def expire_sessions(self) -> list[TrainingRunRow]:
        """Mark sessions silent for longer than the timeout expired, and `open` ones (runs made without a
        session, no heartbeats) none of whose runs finished a request within the open timeout; returns their
        still-loaded runs."""
        cutoff, idle = utcnow() - self.session_timeout, utcnow() - self.open_session_timeout
        # a run is in use while it has work queued or running, or was sent any within the timeout (forwards
        # and samples finish without touching `last_request_at`)
        live = col(FutureRow.status).in_(("pending", "running"))
        used = select(FutureRow.model_id).where(or_(live, col(FutureRow.created_at) >= idle.timestamp()))
        recent = or_(col(TrainingRunRow.last_request_at) >= idle, col(TrainingRunRow.id).in_(used))
        busy = select(TrainingRunRow.session_id).where(recent)
        silent = and_(col(SessionRow.status) == "active", col(SessionRow.last_heartbeat_at) < cutoff)
        unused = and_(col(SessionRow.created_at) < idle, col(SessionRow.id).not_in(busy))
        idle_open = and_(col(SessionRow.status) == "open", unused)
        with self.write_lock.held(), self._session() as session:
            stale = session.exec(select(SessionRow).where(or_(silent, idle_open))).all()
            ids = [row.id for row in stale]
            for row in stale:
                row.status = "expired"
            runs = session.exec(
                select(TrainingRunRow).where(col(TrainingRunRow.session_id).in_(ids), TrainingRunRow.status == "ready")
            ).all()
            session.commit()
        return list(runs)

    def stranded_runs(self) -> list[TrainingRunRow]:
        """Loaded runs of finished or expired sessions that no unload was ever queued for: those whose
        unload queueing failed part-way (a database error after the session was marked). The reaper
        queues them again, so no run keeps its slot after its session ended."""
        ended = select(SessionRow.id).where(col(SessionRow.status).in_(["finished", "expired"]))
        unloads = select(FutureRow.model_id).where(
            FutureRow.kind == "unload_model", col(FutureRow.model_id).is_not(None)
        )
        query = select(TrainingRunRow).where(
            TrainingRunRow.status == "ready",
            col(TrainingRunRow.session_id).in_(ended),
            col(TrainingRunRow.id).not_in(unloads),
        )
        with self._session() as session:
            return list(session.exec(query).all())

    def list_sessions(self, owner: str, limit: int, offset: int) -> list[str]:
        query = select(SessionRow.id).where(SessionRow.owner == owner).order_by(col(SessionRow.created_at).desc())
        with self._session() as session:
            return list(session.exec(query.offset(offset).limit(limit)).all())

    def session_children(self, session_id: str) -> tuple[list[str], list[str]]:
        """The session's training runs (those `get_run` readers see: created, not pending or failed) and its
        sampling sessions."""
        visible = col(TrainingRunRow.status).in_(["ready", "unloaded"])
        with self._session() as session:
            runs = session.exec(select(TrainingRunRow.id).where(TrainingRunRow.session_id == session_id, visible)).all()
            samplers = session.exec(select(SamplingSessionRow.id).where(SamplingSessionRow.session_id == session_id))
            return list(runs), list(samplers.all())

    def owner_sessions(
        self,
        owner: str,
        *,
        before: tuple[datetime, str] | None = None,
        session_id: str | None = None,
        limit: int | None = None,
    ) -> list[SessionRow]:
        """The owner's sessions, newest first (ties by id, descending), expiry applied: those strictly after
        the `before` = (created_at, id) cursor in that order, only `session_id` if given, at most `limit`."""
        query = select(SessionRow).where(SessionRow.owner == owner)
        if session_id is not None:
            query = query.where(SessionRow.id == session_id)
        if before is not None:
            moment, last_id = before
            created = col(SessionRow.created_at)
            query = query.where(or_(created < moment, and_(created == moment, col(SessionRow.id) < last_id)))
        query = query.order_by(col(SessionRow.created_at).desc(), col(SessionRow.id).desc()).limit(limit)
        with self._session() as session:
            rows = list(session.exec(query).all())
        now = utcnow()
        for row in rows:
            if row.status == "active" and now - aware(row.last_heartbeat_at) > self.session_timeout:
                row.status = "expired"
        return rows

    def session_checkpoint_stats(self, owner: str, session_ids: list[str]) -> dict[str, tuple[int, int]]:
        """(ready checkpoint count, total size in bytes) per session id, over the sessions' runs."""
        query = (
            select(TrainingRunRow.session_id, CheckpointRow.size_bytes)
            .join(CheckpointRow, col(CheckpointRow.run_id) == col(TrainingRunRow.id))
            .where(
                col(TrainingRunRow.session_id).in_(session_ids),
                CheckpointRow.owner == owner,
                CheckpointRow.status == "ready",
                unexpired(),
            )
        )
        stats: dict[str, tuple[int, int]] = {}
        with self._session() as session:
            for session_id, size in session.exec(query).all():
                count, total = stats.get(session_id, (0, 0))
                stats[session_id] = (count + 1, total + (size or 0))
        return stats

    # ---- training runs ------------------------------------------------------------------------

    def get_run(self, model_id: str, owner: str) -> TrainingRunRow | None:
        with self._session() as session:
            row = session.get(TrainingRunRow, model_id)
        return row if row is not None and row.owner == owner else None

    def live_run_count(self, owner: str | None = None) -> int:
        """Training runs holding engine memory on this server, every model, `owner`'s (None: every owner's):
        created or being created."""
        live = col(TrainingRunRow.status).in_(["pending", "ready"])
        query = select(func.count()).select_from(TrainingRunRow).where(live)
        if owner is not None:
            query = query.where(TrainingRunRow.owner == owner)
        with self._session() as session:
            return int(session.exec(query).one())

    def list_runs(self, owner: str, limit: int, offset: int) -> tuple[list[TrainingRunRow], int]:
        visible = (TrainingRunRow.owner == owner, col(TrainingRunRow.status).in_(["ready", "unloaded"]))
        query = select(TrainingRunRow).where(*visible).order_by(col(TrainingRunRow.created_at).desc())
        with self._session() as session:
            total = session.exec(select(func.count()).select_from(TrainingRunRow).where(*visible)).one()
            return list(session.exec(query.offset(offset).limit(limit)).all()), int(total)

    def latest_metrics(self, model_id: str, limit: int = 100) -> list[MetricRow]:
        query = select(MetricRow).where(MetricRow.model_id == model_id).order_by(col(MetricRow.id).desc())
        with self._session() as session:
            rows = list(session.exec(query.limit(limit)).all())
        for row in rows:
            row.value = math.nan if row.value is None else row.value
        return rows

    # ---- sampling -----------------------------------------------------------------------------

    def add_sampling_session(self, row: SamplingSessionRow) -> SamplingSessionRow:
        """Insert, or return the existing row for a repeated (session, seq) id: also when a retry racing this
        call inserted it first (on Postgres, or from another API process: a 500 the SDK retried)."""
        with self.write_lock.held(), self._session() as session:
            existing = session.get(SamplingSessionRow, row.id)
            if existing is not None:
                return existing
            session.add(row)
            try:
                session.commit()
            except IntegrityError:
                session.rollback()
                raced = session.get(SamplingSessionRow, row.id)
                if raced is None:
                    raise
                return raced
        return row

    def get_sampling_session(self, sampler_id: str, owner: str) -> SamplingSessionRow | None:
        with self._session() as session:
            row = session.get(SamplingSessionRow, sampler_id)
        return row if row is not None and row.owner == owner else None

    def get_snapshot(self, snapshot_id: str) -> SamplerSnapshotRow | None:
        with self._session() as session:
            return session.get(SamplerSnapshotRow, snapshot_id)
