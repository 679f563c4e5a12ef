"""The durable work queue: the `futures` table, implementing the engine's `WorkQueue` protocol.

`submit` stores a serialized request (deduplicated by a caller-chosen key such as
`"{model_id}#{seq_id}"`: the same key with the same payload returns the same future, with a
different payload it raises `DuplicateRequestError`), together with any rows the request brings into
existence. The engine `claim`s pending rows in creation order and reports back with `complete` or
`fail`, which also flip those linked rows to ready/failed. Finished futures keep their result, so a
client may poll again at any time. Nothing here sleeps in a loop: waits are on `Notifier` signals.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import defer
from sqlmodel import Session, SQLModel, col, select

from tx.db import codec
from tx.db.connect import WriteLock, is_sqlite
from tx.db.linked import (
    CHECKPOINTS,
    RUNS,
    lost_runs,
    lost_snapshots,
    mark_linked,
    put_back_orphans,
    saved_result,
    table_of,
)
from tx.db.notify import DONE_CHANNEL, WORK_CHANNEL, Notifier
from tx.db.submit import GroupCommit, NewRequest, Submitted
from tx.db.tables import (
    CheckpointRow,
    FutureRow,
    MetricRow,
    utcnow,
)
from tx.db.turns import turns, within
from tx.protocol import (
    CheckpointResult,
    ForwardBackwardResult,
    LostState,
    OptimStepResult,
    Payload,
    QueueUnavailable,
    RequestError,
    Result,
    WorkItem,
)

log = logging.getLogger("tx.db")

FINISHED = ("done", "failed")
RESULT_RETENTION_S = 86400.0  # a result is kept this long after its request finished (the SDK asks at once)
DROP_BATCH = 1000  # results forgotten per statement (`drop_old_results`)
RUNNING_AT_RESTART = "the server stopped while this request was running, so its effect is unknown; it was not run again"


# Results are recorded with Core statements on the tables: an ORM `update(Model)` flushes the session and
# plans a bulk update first (about 1 ms a statement here, most of a round's queue writes).
FUTURES, METRICS = table_of(FutureRow), table_of(MetricRow)
# The kinds of the many requests of every step; they bring no rows into existence (`submit` refuses them
# any), so finishing them flips no linked rows.
UNLINKED_KINDS = frozenset({"sample", "forward", "forward_backward", "optim_step", "unload_model"})


@dataclass(frozen=True)
class Recovery:
    """What `SqlQueue.recover` found: requests failed (they were running), requests left queued, state lost."""

    failed: int
    pending: int
    lost: LostState


class SqlQueue:
    """Queue operations over one SQLAlchemy engine (SQLite or Postgres).

    Without a work signal (lost, or sent by a process that cannot reach this one) `claim` still looks at
    the table every `rescan_s` seconds (default 2), so unsignalled work waits at most that long.
    """

    def __init__(self, engine: Engine, notifier: Notifier, write_lock: WriteLock, rescan_s: float = 2.0) -> None:
        self.engine = engine
        self.notifier = notifier
        self.write_lock = write_lock
        self.rescan_s = rescan_s
        self._last_scan = float("-inf")
        # what the last claim left for want of room: owners at their share, and whether the bytes cut it short
        self._left_owners: set[str] = set()
        self._left_for_bytes = False
        self._uncertain: list[int | None] = []  # ids of the claim whose commit raised
        self._postgres = not is_sqlite(engine)
        self._group = GroupCommit(engine, write_lock, lambda session: self._pg_notify(session, WORK_CHANNEL, ""))

    # ---- API side -----------------------------------------------------------------------------

    def submit(
        self,
        *,
        kind: str,
        payload: Payload,
        owner: str,
        model_id: str | None = None,
        seq_id: int | None = None,
        dedupe_key: str | None = None,
        sequence_ids: Sequence[str] = (),
        rows: Sequence[SQLModel] = (),
    ) -> Submitted:
        """Queue one request; returns the existing future for a repeated `dedupe_key`."""
        if rows and kind in UNLINKED_KINDS:
            raise ValueError(f"a {kind} request brings no rows into existence (UNLINKED_KINDS)")
        self.notifier.submission_started()  # the engine's burst gathering waits for requests in flight
        try:
            blob = codec.encode(payload)
            digest = hashlib.blake2b(blob, digest_size=20).hexdigest()
            request = NewRequest(kind, blob, digest, owner, model_id, seq_id, dedupe_key, list(sequence_ids), rows)
            submitted = self._group.submit(request)
            if not submitted.duplicate:
                self.notifier.work_submitted()
            return submitted
        finally:
            self.notifier.submission_ended()

    def get_by_key(self, dedupe_key: str) -> FutureRow | None:
        with Session(self.engine, expire_on_commit=False) as session:
            return session.exec(select(FutureRow).where(FutureRow.dedupe_key == dedupe_key)).first()

    def get(self, future_id: str) -> FutureRow | None:
        """The row of a future id (the decimal row number we issued); None for anything else, never an error:
        not '²' (a digit to `isdigit`), not 5000 digits (past `int`'s limit), not 2^31 (past Postgres' SERIAL).
        Without its request's payload: a poll of a queued 8 MB request read and held all of it, every poll."""
        if not (future_id.isascii() and future_id.isdigit() and len(future_id) <= 10 and int(future_id) < 1 << 31):
            return None
        with Session(self.engine, expire_on_commit=False) as session:
            return session.get(FutureRow, int(future_id), options=[defer(FutureRow.payload, raiseload=True)])  # type: ignore[arg-type]

    async def wait_finished(self, future_id: str, timeout_s: float, owner: str | None = None) -> FutureRow | None:
        """The future's row once finished, or as it is after `timeout_s`; None if unknown or (when `owner` is
        given) another owner's, at once: nobody waits on a future that is not theirs. A wake that finds it
        still unfinished (a notification for another schema's future of that id) waits on: returned early,
        it cost the client another round trip."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        waiter = self.notifier.add_waiter(future_id)
        try:
            row = await asyncio.to_thread(self.get, future_id)
            if row is None or (owner is not None and row.owner != owner):
                return None
            while row is not None and row.status not in FINISHED and (left := deadline - loop.time()) > 0:
                try:
                    await asyncio.wait_for(waiter, left)
                except TimeoutError:
                    pass
                self.notifier.remove_waiter(future_id, waiter)
                waiter = self.notifier.add_waiter(future_id)  # before the read: no wake is missed
                row = await asyncio.to_thread(self.get, future_id)
            return row
        finally:
            self.notifier.remove_waiter(future_id, waiter)

    # ---- engine side (WorkQueue) --------------------------------------------------------------

    def wait_for_work(self, timeout_s: float) -> None:
        self.notifier.wait_for_work(timeout_s)

    def submitting(self) -> bool:
        """A request is being written by this process's API right now (more work is about to arrive)."""
        return self.notifier.submitting()

    def wake(self) -> None:
        self.notifier.work_submitted()

    def claim(self, limit: int, per_owner: int | None = None, max_bytes: int | None = None) -> list[WorkItem]:
        """Pending requests, marked running: by turn, each owner's in id order (`turns`), returned in id
        order; none past an owner's `per_owner`-th unfinished request (its running ones count), and in turn
        order no more stored bytes than `max_bytes` but the first (which always goes). A claim whose
        commit raised may still have landed (a connection lost after the server committed): its rows are
        looked up first on the next claim, and those found running are returned then (one engine holds the
        lease, so they are this engine's)."""
        if reclaimed := self._reclaim_uncertain():
            return self._decode_items(reclaimed)
        signalled = self.notifier.take_work_flag()
        if not signalled and time.monotonic() - self._last_scan < self.rescan_s:
            return []
        with self.write_lock.held(), Session(self.engine, expire_on_commit=False) as session:
            scanned_at = time.monotonic()
            ranked = session.execute(turns(limit)).all()
            self._last_scan = scanned_at  # a failed scan is not one: the next claim looks again at once
            chosen, self._left_owners, self._left_for_bytes = within(ranked, per_owner, max_bytes)
            query = select(FutureRow).where(col(FutureRow.id).in_(chosen), FutureRow.status == "pending")
            query = query.order_by(col(FutureRow.id))
            if self._postgres:
                query = query.with_for_update(skip_locked=True)
            rows = list(session.exec(query).all())
            if not rows:
                return []
            ids = [row.id for row in rows]
            session.execute(FUTURES.update().where(FUTURES.c.id.in_(ids)).values(status="running"))
            self._uncertain = ids
            try:
                session.commit()
            except Exception:
                self.notifier.work_submitted()  # look again at once: the rows may still be pending
                raise
            self._uncertain = []
        if len(rows) == limit:  # there may be more: look again on the next claim
            self.notifier.work_submitted()
        return self._decode_items(rows)

    def release(self, future_ids: Sequence[str]) -> int:
        """Claimed requests a stopping engine left unfinished, pending again (the engine picks those that change
        no state: run again they do what they would have done). Returns how many."""
        ids = [int(f) for f in future_ids]
        if not ids:
            return 0
        with self.write_lock.held(), Session(self.engine) as session:
            running = FUTURES.c.id.in_(ids) & (FUTURES.c.status == "running")
            released = session.execute(select(func.count()).select_from(FUTURES).where(running)).scalar_one()
            session.execute(FUTURES.update().where(running).values(status="pending"))
            session.commit()
        return int(released)

    def drop_old_results(self, older_than_s: float = RESULT_RETENTION_S, batch: int = DROP_BATCH) -> int:
        """Forget the results of up to `batch` requests finished more than `older_than_s` ago: a poll of one
        reads a failure saying so. Kept for good, every sample's tokens and every forward's outputs filled the
        database. The rows stay (their ids are never reused). Returns how many went."""
        cutoff = time.time() - older_than_s
        old = select(FutureRow.id).where(FutureRow.status == "done", col(FutureRow.completed_at) < cutoff)
        message = f"this request's result was kept {older_than_s / 3600:g} hours after it finished and is gone"
        with self.write_lock.held(), Session(self.engine) as session:
            ids = list(session.exec(old.order_by(col(FutureRow.completed_at)).limit(batch)).all())
            if ids:
                dropped = dict(status="failed", result=None, error=message, error_category="user")
                session.execute(FUTURES.update().where(FUTURES.c.id.in_(ids)).values(**dropped))
                session.commit()
        return len(ids)

    def _reclaim_uncertain(self) -> list[FutureRow]:
        if not self._uncertain:
            return []
        with Session(self.engine, expire_on_commit=False) as session:
            query = select(FutureRow).where(col(FutureRow.id).in_(self._uncertain), FutureRow.status == "running")
            rows = list(session.exec(query.order_by(col(FutureRow.id))).all())
        self._uncertain = []
        if rows:
            log.warning("a claim whose commit raised had landed: running its %d requests", len(rows))
        return rows

    def _decode_items(self, rows: list[FutureRow]) -> list[WorkItem]:
        """The claimed rows as work items; an unreadable one fails. If that write fails too, its row is looked
        at again on the next claim (`_uncertain`): raising here lost every other row of the claim, left
        running for good."""
        items, unreadable = [], []
        for row in rows:
            try:
                payload = codec.decode(row.payload or b"null")
            except Exception as exc:
                unreadable.append((str(row.id), RequestError(f"stored request is unreadable: {exc}", "server")))
                continue
            nbytes = len(row.payload or b"")
            item = WorkItem(str(row.id), row.kind, row.model_id, payload, row.created_at, row.seq_id, row.owner, nbytes)  # type: ignore[arg-type]
            items.append(item)
        try:
            self.finish_many(unreadable) if unreadable else None
        except Exception:
            log.exception("could not fail %d unreadable requests; trying again on the next claim", len(unreadable))
            self._uncertain += [int(future_id) for future_id, _ in unreadable]
        return items

    def complete(self, future_id: str, result: Result) -> None:
        self.finish_many([(future_id, result)])

    def fail(self, future_id: str, error: RequestError) -> None:
        self.finish_many([(future_id, error)])

    def finish_many(self, outcomes: Sequence[tuple[str, Result | RequestError]]) -> None:
        """Record results and failures in one transaction (a decode chunk finishes many requests at once),
        then wake their long polls. All or nothing: on an error none is recorded. The rows are read in one
        query and their linked rows flipped in one statement per table (8 results: 1 + 3 statements, not
        8 + 24). A future already finished keeps its first outcome (a request the engine failed while a
        sampler still held it must not turn done later, nor flip the rows it made)."""
        blobs = [None if isinstance(out, RequestError) else codec.encode(out) for _, out in outcomes]
        try:
            found, owners = self._record_outcomes(outcomes, blobs)
        except OperationalError as exc:  # the database refuses writes now, not this result
            raise QueueUnavailable(str(exc.orig)) from exc
        for future_id, _, _ in found:
            self.notifier.result_ready(future_id)
        if found and (self._left_for_bytes or owners & self._left_owners):
            self.notifier.work_submitted()  # look again: what the last claim left has room now

    def _record_outcomes(
        self, outcomes: Sequence[tuple[str, Result | RequestError]], blobs: list[bytes | None]
    ) -> tuple[list[tuple[str, Result | RequestError, bytes | None]], set[str]]:
        """The outcomes recorded (a future already finished keeps its first), and their owners."""
        with self.write_lock.held(), Session(self.engine) as session:
            ids = [int(future_id) for future_id, _ in outcomes]
            query = select(FutureRow).where(col(FutureRow.id).in_(ids)).options(defer(FutureRow.payload))  # type: ignore[arg-type]
            rows = {row.id: row for row in session.exec(query)}  # their payloads are dropped, never read
            open_ = {row_id for row_id, row in rows.items() if row.status not in FINISHED}
            found = [(f, out, blob) for (f, out), blob in zip(outcomes, blobs, strict=True) if int(f) in open_]
            owners = {rows[int(f)].owner for f, _, _ in found}
            linking = [(f, out) for f, out, _ in found if rows[int(f)].kind not in UNLINKED_KINDS]
            # Linked rows first: an unload finished after its run's creation leaves the run unloaded.
            mark_linked(session, [f for f, out in linking if not isinstance(out, RequestError)], "ready")
            mark_linked(session, [f for f, out in linking if isinstance(out, RequestError)], "failed")
            metrics: list[dict[str, Any]] = []
            for future_id, outcome, blob in found:
                row = rows[int(future_id)]
                if isinstance(outcome, RequestError):
                    self._fail_row(row, outcome)
                else:
                    self._complete_row(session, row, outcome, blob)
                    metrics += self._metric_rows(row, outcome)
                self._pg_notify(session, DONE_CHANNEL, future_id)
            if metrics:
                session.execute(METRICS.insert(), metrics)
            session.commit()
        return found, owners

    def _complete_row(self, session: Session, row: FutureRow, result: Result, blob: bytes | None) -> None:
        future_id = str(row.id)
        row.status, row.result, row.payload, row.completed_at = "done", blob, None, time.time()
        if isinstance(result, CheckpointResult) and result.size_bytes is not None:
            session.execute(
                CHECKPOINTS.update().where(CHECKPOINTS.c.future_id == future_id).values(size_bytes=result.size_bytes)
            )
        if row.kind == "unload_model":
            session.execute(RUNS.update().where(RUNS.c.id == row.model_id).values(status="unloaded"))
        if row.model_id is not None and row.kind not in ("sample", "forward", "forward_backward"):
            session.execute(RUNS.update().where(RUNS.c.id == row.model_id).values(last_request_at=utcnow()))

    @staticmethod
    def _fail_row(row: FutureRow, error: RequestError) -> None:
        row.status, row.payload, row.completed_at = "failed", None, time.time()
        row.error, row.error_category = error.message, error.category

    def settle_saved(self, saved: Callable[[Path, str], bool]) -> int:
        """Before `recover`: the saves claimed by the previous engine whose files are in place (`saved(directory,
        future id)`, the engine's marker) finish as done, with what they made: failed, the checkpoint row they
        had replaced came back over their new files. Returns how many."""
        saves = ("save_state", "save_weights_for_sampler", "save_weights_external")
        running = select(FutureRow.id, FutureRow.kind).where(
            FutureRow.status == "running", col(FutureRow.kind).in_(saves)
        )
        with Session(self.engine) as session:
            kinds = {str(future_id): kind for future_id, kind in session.execute(running).all()}
            made = select(CheckpointRow.future_id, CheckpointRow.tinker_path, CheckpointRow.directory)
            rows = session.execute(made.where(col(CheckpointRow.future_id).in_(list(kinds)))).all()
        done: list[tuple[str, Result | RequestError]] = [
            (str(future_id), saved_result(kinds[str(future_id)], path))
            for future_id, path, directory in rows
            if saved(Path(directory), str(future_id))
        ]
        if done:
            self.finish_many(done)
        return len(done)

    def recover(self) -> Recovery:
        """Start of a new engine: settle what the previous engine process left. Work it had claimed
        (`running`: maybe half done, its effect unknown) fails, with what it would have created; `pending`
        work stays queued and runs now. Every `ready` run becomes `unloaded`: its state lived in that
        process. Which queued requests needed that state is the engine's call (`tx.engine.restart`), from
        the returned `LostState`."""
        with self.write_lock.held(), Session(self.engine) as session:
            stale = session.exec(select(FutureRow).where(FutureRow.status == "running")).all()
            for row in stale:
                row.status, row.payload, row.completed_at = "failed", None, time.time()
                row.error, row.error_category = RUNNING_AT_RESTART, "server"
            mark_linked(session, [str(row.id) for row in stale], "failed")
            for row in stale:  # long polls on other API processes waited out their deadline (25 s)
                self._pg_notify(session, DONE_CHANNEL, str(row.id))
            put_back_orphans(session)
            lost = LostState(lost_runs(session), lost_snapshots(session))
            session.execute(RUNS.update().where(RUNS.c.status == "ready").values(status="unloaded"))
            session.commit()
            queued = select(func.count()).select_from(FutureRow).where(FutureRow.status == "pending")
            pending = session.exec(queued).one()
        return Recovery(len(stale), int(pending), lost)

    # ---- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _metric_rows(row: FutureRow, result: Result) -> list[dict[str, Any]]:
        if not isinstance(result, ForwardBackwardResult | OptimStepResult) or row.model_id is None:
            return []
        now = utcnow()
        return [
            # NULL = NaN (see MetricRow.value)
            dict(model_id=row.model_id, future_id=str(row.id), kind=row.kind, name=name, created_at=now,
                 value=None if math.isnan(value) else float(value))
            for name, value in result.metrics.items()
        ]  # fmt: skip

    def _pg_notify(self, session: Session, channel: str, payload: str) -> None:
        if self._postgres:
            session.execute(text("SELECT pg_notify(:channel, :payload)"), {"channel": channel, "payload": payload})
