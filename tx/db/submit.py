"""Group commit for queue submissions.

Concurrent API threads each hand their new request to `GroupCommit.submit`. One of them becomes
the leader and writes every request waiting at that moment in a single transaction (one dedupe
lookup and one insert each, then one commit); the others sleep until the leader has written theirs,
and the next waiter whose request is still unwritten leads the next batch. A burst of large
submissions therefore costs one commit per batch instead of one per request. If the batch
transaction fails, its entries are retried one transaction each so only the faulty one fails. A request
without a key of its own gets one for its retries (`NewRequest.retry_key`): a commit that landed and then
raised (a connection lost after the server committed) wrote such requests twice, and they ran twice.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.engine import CursorResult, Engine
from sqlmodel import Session, SQLModel

from tx.db.connect import WriteLock
from tx.db.tables import FutureRow, SamplerSnapshotRow

_FUTURES = FutureRow.__table__  # type: ignore[attr-defined]


class DuplicateRequestError(Exception):
    """The dedupe key was already used for a different request."""


@dataclass(frozen=True)
class Submitted:
    future_id: str
    sequence_ids: list[str]
    duplicate: bool


@dataclass
class NewRequest:
    """One request to insert, with the rows it brings into existence."""

    kind: str
    blob: bytes
    digest: str
    owner: str
    model_id: str | None
    seq_id: int | None
    dedupe_key: str | None
    sequence_ids: list[str]
    rows: Sequence[SQLModel] = ()
    outcome: Submitted | Exception | None = None
    done: bool = field(default=False, repr=False)
    retry_key: str = field(default_factory=lambda: f"~{uuid.uuid4().hex}", repr=False)  # when dedupe_key is None

    @property
    def key(self) -> str:
        return self.dedupe_key if self.dedupe_key is not None else self.retry_key


class GroupCommit:
    """Batches concurrent `submit` calls into shared transactions."""

    def __init__(self, engine: Engine, write_lock: WriteLock, after_commit: Callable[[Session], None]) -> None:
        self.engine = engine
        self.write_lock = write_lock
        self.before_commit = after_commit
        self._cond = threading.Condition()
        self._pending: list[NewRequest] = []
        self._leader = False

    def submit(self, request: NewRequest) -> Submitted:
        with self._cond:
            self._pending.append(request)
            while not request.done and self._leader:
                self._cond.wait()
            if not request.done:
                self._leader = True
                batch, self._pending = self._pending, []
        if not request.done:
            self._write_batch(batch)
            with self._cond:
                for entry in batch:
                    entry.done = True
                self._leader = False
                self._cond.notify_all()
        if isinstance(request.outcome, Exception):
            raise request.outcome
        assert request.outcome is not None
        return request.outcome

    def _write_batch(self, batch: list[NewRequest]) -> None:
        try:
            self._write(batch)
        except Exception:
            for entry in batch:  # isolate the entry that broke the shared transaction
                try:
                    self._write([entry])
                except Exception as exc:
                    entry.outcome = exc

    def _write(self, batch: list[NewRequest]) -> None:
        outcomes: list[Submitted | Exception] = []
        with self.write_lock.held(), Session(self.engine, expire_on_commit=False) as session:
            for entry in batch:
                try:
                    outcomes.append(_insert(session, entry))
                except DuplicateRequestError as exc:
                    outcomes.append(exc)
            self.before_commit(session)
            session.commit()
        for entry, outcome in zip(batch, outcomes, strict=True):
            entry.outcome = outcome


def _insert(session: Session, entry: NewRequest) -> Submitted:
    found = session.execute(
        select(_FUTURES.c.id, _FUTURES.c.payload_hash, _FUTURES.c.sequence_ids_json).where(
            _FUTURES.c.dedupe_key == entry.key
        )
    ).first()
    if found is not None:
        if found.payload_hash != entry.digest:
            what = entry.key.replace("#", " seq_id ")
            raise DuplicateRequestError(f"{what} was already used for a different request")
        ids = json.loads(found.sequence_ids_json) if found.sequence_ids_json else []
        return Submitted(str(found.id), ids, duplicate=True)
    values = {
        "kind": entry.kind,
        "model_id": entry.model_id,
        "seq_id": entry.seq_id,
        "dedupe_key": entry.key,
        "payload_hash": entry.digest,
        "payload": entry.blob,
        "owner": entry.owner,
        "status": "pending",
        "sequence_ids_json": json.dumps(entry.sequence_ids) if entry.sequence_ids else None,
        "created_at": time.time(),
    }
    result: CursorResult[Any] = session.execute(insert(_FUTURES).values(**values))  # type: ignore[assignment]
    key = result.inserted_primary_key
    assert key is not None
    future_id = str(key[0])
    for linked in entry.rows:
        if hasattr(linked, "future_id"):
            linked.future_id = future_id
        if isinstance(linked, SamplerSnapshotRow):
            session.merge(linked)  # keyed by the weights' name: a save under a taken name replaces it, atomically
        else:
            session.add(linked)
    if entry.rows:
        session.flush()
    return Submitted(future_id, entry.sequence_ids, duplicate=False)
