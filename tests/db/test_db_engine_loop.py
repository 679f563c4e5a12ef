"""The engine loop over the real SQLite queue with scripted test runners."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from sqlmodel import Session

from tx.db import Database, open_database, owner_of
from tx.db.tables import FutureRow
from tx.engine.loop import Completion, Engine, StepError
from tx.engine.restart import RestartGate
from tx.protocol import (
    AdamParams,
    Datum,
    ForwardBackwardRequest,
    LostState,
    OptimStepRequest,
    OptimStepResult,
    SampledSequence,
    SampleRequest,
    SampleResult,
    SamplingParams,
    WorkItem,
)

OWNER = owner_of("tml-test")


class ScriptedRunner:
    """Test-only runner: completes items one step later; a token 7 raises StepError, 8 a bare exception."""

    def __init__(self) -> None:
        self.items: list[WorkItem] = []
        self.submitted_at: list[float] = []

    def submit(self, items: Sequence[WorkItem]) -> None:
        self.items.extend(items)
        self.submitted_at.extend(time.monotonic() for _ in items)

    def idle(self) -> bool:
        return not self.items

    def step(self) -> list[Completion]:
        items, self.items = self.items, []
        for item in items:
            token = item.payload.data[0].tokens[0]  # type: ignore[union-attr]
            if token == 7:
                self.items = [i for i in items if i is not item]
                raise StepError("boom", [item.future_id])
            if token == 8:
                raise RuntimeError("unattributable")
        return [Completion(item.future_id, OptimStepResult()) for item in items]


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Database:
    return open_database(None, tmp_path)


def _submit(db: Database, seq: int, token: int = 1) -> str:
    payload = ForwardBackwardRequest([Datum([token, 2], {"target_tokens": np.array([2, 3])})], "cross_entropy")
    return db.queue.submit(kind="forward_backward", payload=payload, owner=OWNER, model_id="m", seq_id=seq).future_id


def _wait_status(db: Database, future_id: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = db.queue.get(future_id)
        if row is not None and row.status in ("done", "failed"):
            return row.status
        time.sleep(0.01)
    raise AssertionError(f"{future_id} never finished")


def test_engine_wakes_immediately_and_completes(sqlite_db: Database, caplog: pytest.LogCaptureFixture) -> None:
    runner = ScriptedRunner()
    engine = Engine(sqlite_db.queue, runner, idle_wait_s=30.0)
    engine.start()
    try:
        time.sleep(0.1)  # the loop is now asleep in wait_for_work
        with caplog.at_level(logging.INFO, logger="tx.engine"):
            start = time.monotonic()
            future_id = _submit(sqlite_db, 1)
            assert _wait_status(sqlite_db, future_id, timeout=20.0) == "done"
            # Woken by the submission, not by the 30 s idle timeout (a loaded CI runner can take a second).
            assert runner.submitted_at[0] - start < 10.0
        assert any("ok forward_backward model=m" in r.message for r in caplog.records)
    finally:
        engine.stop()


def test_step_error_fails_only_affected_future(sqlite_db: Database) -> None:
    runner = ScriptedRunner()
    good, bad = _submit(sqlite_db, 1), _submit(sqlite_db, 2, token=7)
    engine = Engine(sqlite_db.queue, runner)
    engine.run_once()  # claim + step: raises StepError for `bad`
    engine.run_once()
    assert sqlite_db.queue.get(bad).status == "failed"  # type: ignore[union-attr]
    assert sqlite_db.queue.get(bad).error_category == "server"  # type: ignore[union-attr]
    assert sqlite_db.queue.get(good).status == "done"  # type: ignore[union-attr]


def test_unattributable_exception_fails_inflight_and_loop_survives(sqlite_db: Database) -> None:
    runner = ScriptedRunner()
    engine = Engine(sqlite_db.queue, runner)
    first = _submit(sqlite_db, 1, token=8)
    engine.run_once()
    row = sqlite_db.queue.get(first)
    assert row is not None and row.status == "failed" and "unattributable" in (row.error or "")
    later = _submit(sqlite_db, 2)
    engine.run_once()
    assert sqlite_db.queue.get(later).status == "done"  # type: ignore[union-attr]


class BatchRecorder(ScriptedRunner):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def submit(self, items: Sequence[WorkItem]) -> None:
        self.batches.append(len(items))
        super().submit(items)


def test_burst_waits_for_a_request_still_being_written(sqlite_db: Database) -> None:
    """A client's burst lands over several commits; the engine starts only once none is in flight."""
    runner = BatchRecorder()
    engine = Engine(sqlite_db.queue, runner, gather_s=1.0)
    engine.start()
    try:
        sqlite_db.queue.notifier.submission_started()  # another API thread is writing its request
        first = _submit(sqlite_db, 0)
        time.sleep(0.1)  # far past the quiet gap that would otherwise end the burst
        second = _submit(sqlite_db, 1)
        sqlite_db.queue.notifier.submission_ended()
        assert _wait_status(sqlite_db, first) == "done" and _wait_status(sqlite_db, second) == "done"
    finally:
        engine.stop()
    assert runner.batches == [2]


class SampleRecorder:
    """Completes sample requests one step after they arrive, recording how they were batched."""

    def __init__(self) -> None:
        self.items: list[WorkItem] = []
        self.batches: list[int] = []

    def submit(self, items: Sequence[WorkItem]) -> None:
        self.batches.append(len(items))
        self.items.extend(items)

    def idle(self) -> bool:
        return not self.items

    def step(self) -> list[Completion]:
        items, self.items = self.items, []
        return [Completion(i.future_id, SampleResult([SampledSequence([1], [-0.5], "length")])) for i in items]


def _submit_sample(db: Database, seq: int) -> str:
    payload = SampleRequest([1, 2], 1, SamplingParams(max_tokens=1), "base")
    return db.queue.submit(kind="sample", payload=payload, owner=OWNER, model_id="s", seq_id=seq).future_id


def test_a_sample_burst_as_large_as_the_last_waits_past_quiet_gaps(sqlite_db: Database) -> None:
    """An RL loop's next round of sample calls is kept together although its requests arrive with gaps
    longer than the quiet gap: the engine expects as many as the previous burst (up to gather_s)."""
    runner = SampleRecorder()
    engine = Engine(sqlite_db.queue, runner, gather_s=1.0, gather_quiet_s=0.01)
    engine.start()
    try:
        for round_ in range(2):
            futures = []
            for i in range(3):
                futures.append(_submit_sample(sqlite_db, 10 * round_ + i))
                if round_ == 0 or i < 2:
                    time.sleep(0.001 if round_ == 0 else 0.1)  # round 1: gaps 10x the quiet gap
            assert all(_wait_status(sqlite_db, f) == "done" for f in futures)
        lone = _submit_sample(sqlite_db, 99)  # fewer than expected: waits for gather_s at most, then runs
        assert _wait_status(sqlite_db, lone) == "done"
    finally:
        engine.stop()
    assert runner.batches == [3, 3, 1]


class ResultsOfOneStep(ScriptedRunner):
    """Finishes everything in one step; the second result cannot be stored (not a protocol type)."""

    def step(self) -> list[Completion]:
        items, self.items = self.items, []
        results: list = [OptimStepResult(), object()]
        return [Completion(item.future_id, results[i % 2]) for i, item in enumerate(items)]


def test_step_results_recorded_together_and_a_bad_one_fails_alone(sqlite_db: Database) -> None:
    good, bad = _submit(sqlite_db, 0), _submit(sqlite_db, 1)  # queued before the engine starts: one step
    engine = Engine(sqlite_db.queue, ResultsOfOneStep())
    engine.start()
    try:
        assert _wait_status(sqlite_db, good) == "done"
        assert _wait_status(sqlite_db, bad) == "failed"
    finally:
        engine.stop()
    row = sqlite_db.queue.get(bad)
    assert row is not None and "could not store the result" in (row.error or "")


class PickyRunner(ScriptedRunner):
    """submit: an item with token 5 is refused by a StepError naming it (the others are taken); a token 6
    refuses the whole batch with a bare exception."""

    def submit(self, items: Sequence[WorkItem]) -> None:
        tokens = [item.payload.data[0].tokens[0] for item in items]  # type: ignore[union-attr]
        if 6 in tokens:
            raise RuntimeError("cannot take token 6")
        super().submit([item for item, t in zip(items, tokens, strict=True) if t != 5])
        if 5 in tokens:
            raise StepError("refused", [item.future_id for item, t in zip(items, tokens, strict=True) if t == 5])


def test_a_request_the_runner_refuses_fails_alone(sqlite_db: Database) -> None:
    engine = Engine(sqlite_db.queue, PickyRunner(), idle_wait_s=0.0)
    named, beside = _submit(sqlite_db, 1, token=5), _submit(sqlite_db, 2)
    engine.run_once()  # the StepError names one future: it fails, the other runs
    row = sqlite_db.queue.get(named)
    assert row is not None and row.status == "failed" and "runner rejected the request: refused" in (row.error or "")
    row = sqlite_db.queue.get(beside)
    assert row is not None and (row.status, row.error) == ("done", None)
    bare, fine = _submit(sqlite_db, 3, token=6), _submit(sqlite_db, 4)
    engine.run_once()  # a bare exception: each item is submitted again alone, so only token 6 fails
    row = sqlite_db.queue.get(bare)
    assert row is not None and row.status == "failed" and "cannot take token 6" in (row.error or "")
    assert sqlite_db.queue.get(fine).status == "done"  # type: ignore[union-attr]


class ForgetfulRunner(ScriptedRunner):
    """Says it is idle with an item still in hand, and cannot discard."""

    def idle(self) -> bool:
        return True

    def discard(self, future_ids: Sequence[str]) -> None:
        raise RuntimeError("discard failed")


def test_requests_a_runner_loses_are_failed_and_a_failing_discard_is_survived(sqlite_db: Database) -> None:
    engine = Engine(sqlite_db.queue, ForgetfulRunner(), idle_wait_s=0.0)
    lost = _submit(sqlite_db, 1)
    engine.run_once()
    row = sqlite_db.queue.get(lost)
    assert row is not None and row.status == "failed" and "lost track" in (row.error or "")
    runner = ScriptedRunner()
    runner.discard = ForgetfulRunner().discard  # type: ignore[attr-defined]
    engine = Engine(sqlite_db.queue, runner)
    boom = _submit(sqlite_db, 2, token=8)
    engine.run_once()  # the step fails, the discard that follows fails too: both are logged, the future fails
    assert sqlite_db.queue.get(boom).status == "failed"  # type: ignore[union-attr]
    later = _submit(sqlite_db, 3)
    engine.run_once()
    assert sqlite_db.queue.get(later).status == "done"  # type: ignore[union-attr]


def _claim_failing_at(db: Database, call: int, message: str) -> list[int]:
    """Make the queue's `call`-th claim raise `message`; returns the list every claim call is recorded in."""
    queue = db.queue
    claim, calls = queue.claim, []

    def failing(limit: int, per_owner: int | None = None, max_bytes: int | None = None) -> list[WorkItem]:
        calls.append(limit)
        if len(calls) == call:
            raise RuntimeError(message)
        return claim(limit, per_owner, max_bytes)

    queue.claim = failing  # type: ignore[method-assign]
    return calls


def test_the_engine_thread_survives_a_queue_failure(sqlite_db: Database) -> None:
    queue = sqlite_db.queue
    calls = _claim_failing_at(sqlite_db, 1, "database is locked")
    future_id = _submit(sqlite_db, 1)
    engine = Engine(queue, ScriptedRunner(), idle_wait_s=0.05)
    engine.start()
    try:
        assert _wait_status(sqlite_db, future_id) == "done"
    finally:
        engine.stop()
    assert len(calls) > 1


def test_a_database_outage_logs_one_traceback_and_its_end(
    sqlite_db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """The loop retries every half second; it logged a traceback each time (82 in a 40 s Postgres outage)."""
    queue, claim, calls = sqlite_db.queue, sqlite_db.queue.claim, []

    def away(limit: int, per_owner: int | None = None, max_bytes: int | None = None) -> list[WorkItem]:
        calls.append(limit)
        if len(calls) <= 4:
            raise RuntimeError("connection to server failed: Connection refused")
        return claim(limit, per_owner, max_bytes)

    queue.claim = away  # type: ignore[method-assign]
    future_id = _submit(sqlite_db, 1)
    engine = Engine(queue, ScriptedRunner(), idle_wait_s=0.05)
    with caplog.at_level(logging.INFO, logger="tx.engine"):
        engine.start()
        try:
            assert _wait_status(sqlite_db, future_id) == "done"
        finally:
            engine.stop()
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert [r.getMessage() for r in tracebacks] == ["engine iteration failed"]
    assert any("works again after 4 failures" in r.getMessage() for r in caplog.records)


def test_results_the_queue_cannot_take_are_kept_and_recorded_once_it_can(sqlite_db: Database) -> None:
    """A full disk refuses every write: the step's results stay with the engine (still in flight) instead of
    being lost with their futures running forever, and land, as results, once writes succeed again."""
    queue, full = sqlite_db.queue, [True]

    def refusing(method):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            if full[0]:
                raise OSError(28, "database or disk is full")
            return method(*args, **kwargs)

        return call

    for name in ("complete", "fail", "finish_many"):
        setattr(queue, name, refusing(getattr(queue, name)))
    futures = [_submit(sqlite_db, 1), _submit(sqlite_db, 2)]
    engine = Engine(queue, ScriptedRunner(), idle_wait_s=0.0)
    engine.run_once()  # claimed and stepped; neither result nor failure can be written
    engine.run_once()
    assert sorted(engine.in_flight()) == sorted(futures)
    assert {queue.get(f).status for f in futures} == {"running"}  # type: ignore[union-attr]
    full[0] = False
    engine.run_once()
    assert [(queue.get(f).status, queue.get(f).error) for f in futures] == [("done", None)] * 2  # type: ignore[union-attr]
    assert engine.in_flight() == []


def test_a_burst_whose_later_claim_fails_still_runs_what_it_claimed(sqlite_db: Database) -> None:
    """The first claim of a burst marks its rows running; a database error on the next claim left them
    running for good (never admitted, never claimed again). They run, and the loop claims on later."""
    queue = sqlite_db.queue
    calls = _claim_failing_at(sqlite_db, 2, "server closed the connection unexpectedly")
    first = _submit(sqlite_db, 1)
    engine = Engine(queue, ScriptedRunner(), idle_wait_s=0.0)
    engine.run_once()  # claims `first`, then the burst's next claim fails
    engine.run_once()
    assert len(calls) >= 2 and queue.get(first).status == "done"  # type: ignore[union-attr]


def test_a_result_too_large_for_a_nearly_full_database_is_kept_not_failed(sqlite_db: Database) -> None:
    """SQLite with room for a failure but not for the result (`max_page_count` stands in for a nearly full
    disk): the write of the result fails, and the work it reports was done, so it is kept and written once
    there is room, not recorded as a failure (a client retrying a failed forward_backward applies it twice)."""
    from sqlalchemy import event

    pages = int(sqlite_db.engine.connect().exec_driver_sql("PRAGMA page_count").scalar())  # type: ignore[arg-type]

    def cramped(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
        dbapi_conn.execute(f"PRAGMA max_page_count = {pages + 4}")

    future = _submit(sqlite_db, 1)
    engine = Engine(sqlite_db.queue, LargeResultRunner(), idle_wait_s=0.0)
    sqlite_db.engine.dispose()
    event.listen(sqlite_db.engine, "connect", cramped)
    engine.run_once()
    engine.run_once()
    assert sqlite_db.queue.get(future).status == "running" and engine.in_flight() == [future]  # type: ignore[union-attr]
    event.remove(sqlite_db.engine, "connect", cramped)
    sqlite_db.engine.dispose()
    engine.run_once()
    row = sqlite_db.queue.get(future)
    assert row is not None and (row.status, row.error) == ("done", None) and engine.in_flight() == []


class LargeResultRunner(ScriptedRunner):
    """Completes each item with a sample result of 64k tokens (about 1 MB stored)."""

    def step(self) -> list[Completion]:
        items, self.items = self.items, []
        tokens = list(range(1 << 16))
        sequence = SampledSequence(tokens, [0.0] * len(tokens), "length")
        return [Completion(item.future_id, SampleResult([sequence])) for item in items]


class _Holding:
    """A runner that takes everything and finishes nothing (a long decode, a model still loading)."""

    def __init__(self) -> None:
        self.items: list[WorkItem] = []

    def submit(self, items: Sequence[WorkItem]) -> None:
        self.items.extend(items)

    def idle(self) -> bool:
        return not self.items

    def step(self) -> list[Completion]:
        return []


def test_the_engine_claims_no_more_than_it_may_hold_in_flight(sqlite_db: Database) -> None:
    """Before, every iteration of a busy engine claimed another `claim_limit` rows until the table was empty: a
    flood of requests was decoded into the engine's memory, and a restart failed all of it as running."""
    runner = _Holding()
    engine = Engine(sqlite_db.queue, runner, claim_limit=16, max_in_flight=40, gather_s=0.0)
    ids = [_submit_as(sqlite_db, owner, seq) for seq in range(50) for owner in (OWNER, "tml-b")]  # interleaved
    for _ in range(10):
        engine.run_once()
    assert len(runner.items) == 40 and sorted(engine.in_flight(), key=int) == ids[:40]
    statuses = [sqlite_db.queue.get(i).status for i in ids]  # type: ignore[union-attr]
    assert statuses == ["running"] * 40 + ["pending"] * 60
    engine._finish_all([Completion(item.future_id, OptimStepResult()) for item in runner.items[:20]])
    runner.items = runner.items[20:]
    engine.run_once()  # 16 a claim
    engine.run_once()
    assert len(runner.items) == 40 and [i.future_id for i in runner.items[20:]] == ids[40:60]


def _submit_as(db: Database, owner: str, seq: int) -> str:
    payload = ForwardBackwardRequest([Datum([1, 2, 3], {})], "cross_entropy")
    model = f"m-{owner}"
    return db.queue.submit(kind="forward_backward", payload=payload, owner=owner, model_id=model, seq_id=seq,
        dedupe_key=f"{model}#{seq}").future_id  # fmt: skip


def test_one_owner_holds_at_most_half_of_the_room_in_flight(sqlite_db: Database) -> None:
    """Requests the engine holds (parked on a model being loaded, say) count against `max_in_flight`: one
    owner's flood took all of it, and no other owner's request was claimed until the flood drained."""
    runner = _Holding()
    engine = Engine(sqlite_db.queue, runner, claim_limit=16, max_in_flight=40, gather_s=0.0)
    flood = [_submit(sqlite_db, seq) for seq in range(100)]
    for _ in range(5):
        engine.run_once()
    assert [i.future_id for i in runner.items] == flood[:20]
    other = sqlite_db.queue.submit(kind="optim_step", payload=OptimStepRequest(AdamParams(1e-3)), owner="tml-b",
        model_id="mb", seq_id=1).future_id  # fmt: skip
    engine.run_once()
    assert [i.future_id for i in runner.items] == [*flood[:20], other]
    engine._finish_all([Completion(flood[0], OptimStepResult())])  # the flood's owner has room for one more
    runner.items = runner.items[1:]
    engine.run_once()  # no new submit: the finish itself makes the engine look again
    assert [i.future_id for i in runner.items][-1] == flood[20]


class _Parking(_Holding):
    """Holds every item as the model pool holds requests for a model still loading (`parked`)."""

    def parked(self) -> int:
        return len(self.items)


def test_two_owners_parked_on_a_loading_model_leave_room_for_a_third(sqlite_db: Database) -> None:
    """Two owners' floods on a model being loaded (each at its half of `max_in_flight`) filled the room: a
    third owner's forward_backward on a loaded model waited 57 s in the queue, until the load ended. Parked
    requests count in each owner's share and in bytes, not in the room."""
    runner = _Parking()
    gated = RestartGate(runner, LostState({}, frozenset()))  # as the server wraps its runner
    engine = Engine(sqlite_db.queue, gated, claim_limit=16, max_in_flight=40, gather_s=0.0)
    floods = [_submit_as(sqlite_db, owner, seq) for seq in range(50) for owner in ("tml-a", "tml-b")]
    for _ in range(6):
        engine.run_once()
    assert sorted(engine.in_flight(), key=int) == floods[:40]  # 20 each: the owners' shares
    other = _submit_as(sqlite_db, "tml-c", 1)
    engine.run_once()
    assert other in engine.in_flight() and len(engine.in_flight()) == 41


class _NativePanic(BaseException):
    """What pyo3 raises for a panic in a native extension: not an Exception."""


class _PanicsOnce(ScriptedRunner):
    def __init__(self) -> None:
        super().__init__()
        self.panicked = False

    def step(self) -> list[Completion]:
        if not self.panicked:
            self.panicked, self.items = True, []
            raise _NativePanic("Onig: Regex search error: retry-limit-in-match over")
        return super().step()


def test_a_native_panic_in_a_step_fails_its_requests_and_the_engine_keeps_serving(sqlite_db: Database) -> None:
    """A BaseException from a step escaped `except Exception` and killed the engine thread: requests stayed
    pending for good while the API kept accepting them."""
    engine = Engine(sqlite_db.queue, _PanicsOnce())
    engine.start()
    try:
        first = _submit(sqlite_db, 1)
        assert _wait_status(sqlite_db, first) == "failed"
        assert "Onig" in (sqlite_db.queue.get(first).error or "")  # type: ignore[union-attr]
        assert _wait_status(sqlite_db, _submit(sqlite_db, 2)) == "done"
        assert engine._thread is not None and engine._thread.is_alive()
    finally:
        engine.stop()


def test_the_engine_holds_no_more_stored_bytes_in_flight_than_its_bound(sqlite_db: Database) -> None:
    """In-flight requests were bounded in number only: 512 forward_backward bodies of 64 MB are 32 GB of host
    memory. Past `max_in_flight_bytes` of stored requests the rest wait queued (the first always goes); a
    finish makes room for the next."""
    runner = _Holding()
    big = [_submit_as(sqlite_db, owner, seq) for seq in range(10) for owner in (OWNER, "tml-b")]
    with Session(sqlite_db.queue.engine) as session:
        size = len(session.get(FutureRow, int(big[0])).payload)  # type: ignore[union-attr, arg-type]
    engine = Engine(sqlite_db.queue, runner, claim_limit=16, max_in_flight=40, max_in_flight_bytes=3 * size,
        gather_s=0.0)  # fmt: skip
    for _ in range(3):
        engine.run_once()
    assert [i.future_id for i in runner.items] == big[:3] and all(i.nbytes == size for i in runner.items)
    engine._finish_all([Completion(big[0], OptimStepResult())])
    runner.items = runner.items[1:]
    engine.run_once()
    assert [i.future_id for i in runner.items] == big[1:4]


class HoldingRunner(ScriptedRunner):
    """Takes every item and finishes none: the engine stops with all of them claimed."""

    def step(self) -> list[Completion]:
        return []

    def idle(self) -> bool:
        return False


def test_an_orderly_stop_hands_back_the_claimed_requests_that_change_no_state(tmp_path: Path) -> None:
    """SIGTERM failed every claimed request at the restart ("its effect is unknown"), hundreds of samples
    that had never started among them. Samples and forwards go back to the queue and run after the
    restart; a claimed forward_backward, which may have accumulated its gradient, still fails then."""
    db = open_database(None, tmp_path)
    trained = _submit(db, 1)
    sampled = _submit_sample(db, 1)
    forward = ForwardBackwardRequest([Datum([1, 2], {"target_tokens": np.array([2, 3])})], "cross_entropy", {}, True)
    looked = db.queue.submit(kind="forward", payload=forward, owner=OWNER, model_id="m", seq_id=2).future_id
    engine = Engine(db.queue, HoldingRunner(), idle_wait_s=0.05)
    engine.start()
    deadline = time.monotonic() + 20
    while {db.queue.get(f).status for f in (trained, sampled, looked)} != {"running"}:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.stop()
    assert [db.queue.get(f).status for f in (trained, sampled, looked)] == ["running", "pending", "pending"]  # type: ignore[union-attr]
    db.close()
    reopened = open_database(None, tmp_path)
    reopened.queue.recover()
    assert [reopened.queue.get(f).status for f in (trained, sampled, looked)] == ["failed", "pending", "pending"]  # type: ignore[union-attr]
    reopened.close()
