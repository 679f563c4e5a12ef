"""The checkpoints' half of `tx.db.records.Records`: reads scoped to one owner, an expiry that reads as missing,
and a save over a taken name setting the old row aside until the save settles (`tx.db.linked`). Also the
base every record store shares: the engine, the write lock, a session, one-row writes.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, or_
from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel, col, select

from tx.db.connect import WriteLock
from tx.db.tables import REPLACED, REPLACED_MARK, CheckpointRow, utcnow


class CheckpointRecords:
    """CRUD on the checkpoints table, scoped to one owner."""

    def __init__(self, engine: Engine, write_lock: WriteLock) -> None:
        self.engine = engine
        self.write_lock = write_lock

    def _session(self) -> Session:
        return Session(self.engine, expire_on_commit=False)

    def _add(self, row: SQLModel) -> None:
        with self.write_lock.held(), self._session() as session:
            session.add(row)
            session.commit()

    def get_checkpoint(
        self,
        run_id: str,
        checkpoint_id: str,
        owner: str,
        *,
        ready: bool = True,
        expired: bool = False,
        or_replaced: bool = False,
    ) -> CheckpointRow | None:
        """The owner's checkpoint by name; past its expiry it reads as missing unless `expired`. With
        `or_replaced`, while a save over the name is queued or running, the checkpoint it replaces (set aside,
        its files in place until the save swaps them): a sampler or loader reading the name found nothing
        for as long as the save waited, and failed for good."""
        query = select(CheckpointRow).where(
            CheckpointRow.run_id == run_id, CheckpointRow.checkpoint_id == checkpoint_id, CheckpointRow.owner == owner
        )
        if ready:
            query = query.where(CheckpointRow.status == "ready")
        aside = select(CheckpointRow).where(
            CheckpointRow.tinker_path == f"tinker://{run_id}/{checkpoint_id}", CheckpointRow.owner == owner,
            CheckpointRow.status == REPLACED,
        )  # fmt: skip
        with self._session() as session:
            row = session.exec(query).first()
            if row is None and ready and or_replaced:
                row = session.exec(aside.order_by(col(CheckpointRow.id).desc())).first()
        if row is not None and is_expired(row) and not expired:
            return None
        return row

    def expired_checkpoints(self, limit: int = 1000) -> list[CheckpointRow]:
        """Ready checkpoints past their expiry, every owner's, oldest expiry first: what the sweeper removes."""
        query = (
            select(CheckpointRow)
            .where(CheckpointRow.status == "ready", col(CheckpointRow.expires_at) < utcnow())
            .order_by(col(CheckpointRow.expires_at))
        )
        with self._session() as session:
            return list(session.exec(query.limit(limit)).all())

    def list_checkpoints(
        self, owner: str, run_id: str | None, limit: int, offset: int, types: Collection[str] | None = None
    ) -> tuple[list[CheckpointRow], int]:
        """`types`: only checkpoints of these types (None: all)."""
        conds = [CheckpointRow.owner == owner, CheckpointRow.status == "ready", unexpired()]
        if run_id is not None:
            conds.append(CheckpointRow.run_id == run_id)
        if types is not None:
            conds.append(col(CheckpointRow.checkpoint_type).in_(types))
        query = select(CheckpointRow).where(*conds).order_by(col(CheckpointRow.created_at).desc())
        with self._session() as session:
            total = session.exec(select(func.count()).select_from(CheckpointRow).where(*conds)).one()
            return list(session.exec(query.offset(offset).limit(limit)).all()), int(total)

    def checkpoint_usage(self, owner: str) -> tuple[int, int]:
        """(count, total bytes) of `owner`'s listed checkpoints, summed by the database (no row is read)."""
        conds = [CheckpointRow.owner == owner, CheckpointRow.status == "ready", unexpired()]
        size = func.coalesce(func.sum(CheckpointRow.size_bytes), 0)
        with self._session() as session:
            count, total = session.exec(select(func.count(), size).select_from(CheckpointRow).where(*conds)).one()
        return int(count), int(total or 0)

    def latest_checkpoints(self, owner: str, run_ids: list[str]) -> dict[tuple[str, str], CheckpointRow]:
        """(run id, checkpoint type) -> that run's newest listed checkpoint of that type, in two queries
        however many checkpoints the runs hold (a listing of runs read every checkpoint of each)."""
        conds = [CheckpointRow.owner == owner, CheckpointRow.status == "ready", unexpired()]
        conds.append(col(CheckpointRow.run_id).in_(run_ids))
        kind, run = col(CheckpointRow.checkpoint_type), col(CheckpointRow.run_id)
        newest = (
            select(run, kind, func.max(CheckpointRow.created_at).label("at")).where(*conds).group_by(run, kind)
        ).subquery()
        at = col(CheckpointRow.created_at)
        on = and_(run == newest.c.run_id, kind == newest.c.checkpoint_type, at == newest.c.at)
        with self._session() as session:
            rows = session.exec(select(CheckpointRow).join(newest, on).where(*conds)).all()
        latest: dict[tuple[str, str], CheckpointRow] = {}
        for row in rows:  # two saved within one clock tick: either is the newest
            latest.setdefault((row.run_id, row.checkpoint_type), row)
        return latest

    def add_rows(self, rows: list[SQLModel]) -> None:
        """Insert rows in one transaction (all or none); raises IntegrityError on a taken key."""
        with self.write_lock.held(), self._session() as session:
            session.add_all(rows)
            session.commit()

    def set_aside(self, row: CheckpointRow) -> None:
        """Free a ready checkpoint's name for a save over it without losing it: the row is hidden (`REPLACED`)
        until that save succeeds (the row goes) or fails (it comes back; `tx.db.queue`)."""
        self._update(
            CheckpointRow, row.id, status=REPLACED, checkpoint_id=f"{row.checkpoint_id}{REPLACED_MARK}{row.id}"
        )

    def put_back(self, row: CheckpointRow) -> None:
        """Undo `set_aside` (the save it was for was never queued), unless a save has taken the name since."""
        with self.write_lock.held(), self._session() as session:
            taken = session.exec(
                select(CheckpointRow).where(
                    CheckpointRow.run_id == row.run_id, CheckpointRow.checkpoint_id == row.checkpoint_id
                )
            ).first()
            current = session.get(CheckpointRow, row.id)
            if taken is None and current is not None and current.status == REPLACED:
                current.status, current.checkpoint_id = "ready", row.checkpoint_id
                session.add(current)
                session.commit()

    def delete_checkpoint(self, row: CheckpointRow, as_read: bool = False) -> bool:
        """Delete `row`; with `as_read`, only while its status is still the one `row` was read with. True
        when a row went."""
        with self.write_lock.held(), self._session() as session:
            current = session.get(CheckpointRow, row.id)
            if current is None or (as_read and current.status != row.status):
                return False
            session.delete(current)
            session.commit()
            return True

    def update_checkpoint(self, row: CheckpointRow, **values: Any) -> None:
        self._update(CheckpointRow, row.id, **values)

    def _update(self, table: type[SQLModel], key: Any, **values: Any) -> None:
        with self.write_lock.held(), self._session() as session:
            row = session.get(table, key)
            if row is not None:
                for name, value in values.items():
                    setattr(row, name, value)
                session.commit()


def is_expired(row: CheckpointRow) -> bool:
    return row.expires_at is not None and aware(row.expires_at) < utcnow()


def unexpired() -> Any:
    """The SQL condition for a checkpoint not past its expiry (or without one)."""
    return or_(col(CheckpointRow.expires_at).is_(None), col(CheckpointRow.expires_at) >= utcnow())


def aware(moment: datetime) -> datetime:
    """SQLite returns naive datetimes; ours are all UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=utcnow().tzinfo)
