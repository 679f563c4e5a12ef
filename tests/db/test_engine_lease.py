"""One engine per data directory and per database: a second is refused before its recovery can fail the
first one's running work (`tx.db.lease`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Connection

from tx.api.__main__ import main
from tx.db import Database
from tx.db.connect import open_engine
from tx.db.lease import EngineBusy, EngineLease, take_engine_lease
from tx.protocol import SampleRequest, SamplingParams, WorkItem


def test_a_second_engine_on_the_same_data_or_database_is_refused(db: Database, tmp_path: Path) -> None:
    first = take_engine_lease(db.engine, tmp_path / "a")
    with pytest.raises(EngineBusy, match="data directory"):
        take_engine_lease(db.engine, tmp_path / "a")
    if db.engine.dialect.name == "postgresql":  # another directory, the same database (schema)
        with pytest.raises(EngineBusy, match="database"):
            take_engine_lease(db.engine, tmp_path / "b")
    else:
        take_engine_lease(db.engine, tmp_path / "b").release()
    first.release()
    take_engine_lease(db.engine, tmp_path / "a").release()  # released: the next engine takes it


def test_a_refused_engine_leaves_the_live_ones_work_alone(tmp_path: Path) -> None:
    """`python -m tx.api` started again on a live server's data directory exits naming it, and the request
    the live engine is running stays running (the second's `recover` would have failed it)."""
    from tx.db import open_database

    db = open_database(None, tmp_path)
    request = SampleRequest([1, 2], 1, SamplingParams(max_tokens=2), "m")
    future = db.queue.submit(kind="sample", payload=request, owner="owner", model_id="m").future_id
    (claimed,) = db.queue.claim(8)
    assert isinstance(claimed, WorkItem) and claimed.future_id == future
    lease = take_engine_lease(db.engine, tmp_path)  # the live engine's
    with pytest.raises(SystemExit, match=f"engine .* is running on the data directory {tmp_path}"):
        main(["--data-dir", str(tmp_path), "--base-model", str(tmp_path / "no-model"), "--port", "0"])
    row = db.queue.get(future)
    assert row is not None and row.status == "running"
    lease.release()
    db.close()


def _kill_lease_connection(db: Database, lease: EngineLease) -> None:
    """What a database restart does to the lock: its connection ends (the lock with it)."""
    from sqlalchemy import text

    assert lease._connection is not None
    pid = lease._connection.execute(text("SELECT pg_backend_pid()")).scalar()
    with db.engine.connect() as conn:
        conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        conn.commit()
        # the termination is asynchronous: the backend holds the lock until it has exited
        _within(20, lambda: _backend_gone(conn, pid), "the lease's backend did not exit")


def _backend_gone(conn: Connection, pid: int) -> bool:
    """pg_stat_activity is read once per transaction: each look ends its own, or it never changes."""
    from sqlalchemy import text

    gone = bool(conn.execute(text("SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}).scalar())
    conn.rollback()
    return gone


def _cut_lease(db: Database, tmp_path: Path, check_s: float) -> tuple[EngineLease, list[str]]:
    """A Postgres engine's lease whose lock connection was just ended; the list records `on_lost` calls."""
    if db.engine.dialect.name != "postgresql":
        pytest.skip("the advisory lock is Postgres's")
    lost: list[str] = []
    lease = take_engine_lease(db.engine, tmp_path / "a")
    held = lease._connection
    lease.check_s, lease.on_lost = check_s, lambda: lost.append("lost")
    _kill_lease_connection(db, lease)
    assert held is not None
    return lease, lost


def _within(seconds: float, done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_an_engine_takes_its_lease_again_after_the_database_restarts(db: Database, tmp_path: Path) -> None:
    """A Postgres restart dropped the advisory lock with its connection and nothing noticed: a second
    engine then started, recovered (failing the live one's running work, unloading its runs) and claimed
    beside it. The watchdog takes the lock again; an engine starting after that is refused."""
    first, lost = _cut_lease(db, tmp_path, 0.1)
    killed = first._connection
    _within(20, lambda: first._connection is not killed, "the lease was not taken again")
    with pytest.raises(EngineBusy, match="database"):
        take_engine_lease(db.engine, tmp_path / "b")
    assert not lost
    first.release()


def test_an_engine_whose_lease_another_took_meanwhile_stops(db: Database, tmp_path: Path) -> None:
    first, lost = _cut_lease(db, tmp_path, 3.0)
    second = take_engine_lease(db.engine, tmp_path / "b")  # in the gap, before the watchdog's next check
    _within(20, lambda: bool(lost), "the lost lease went unnoticed")
    second.release()
    first.release()


def test_an_engine_stops_while_its_database_has_stopped_answering(db: Database, tmp_path: Path) -> None:
    """A database gone silent (a vanished host, a paused machine): the watchdog's check waits on it, and
    `release`, SIGTERM's orderly stop, waited with it for the lease's lock, so the engine could not be stopped."""
    from e2e.tcp_proxy import CuttingProxy
    from sqlalchemy import create_engine, text

    if db.engine.dialect.name != "postgresql":
        pytest.skip("the advisory lock is Postgres's")
    proxy = CuttingProxy(int(db.engine.url.port or 5432))
    lease = take_engine_lease(create_engine(db.engine.url.set(port=proxy.port)), tmp_path / "a")
    assert lease._connection is not None
    pid = lease._connection.execute(text("SELECT pg_backend_pid()")).scalar()
    proxy.silent = True
    _within(20, lambda: proxy.swallowed > 0, "the watchdog did not check")  # its first check comes after 5 s
    stopping = threading.Thread(target=lease.release)
    stopping.start()
    stopping.join(5)
    released = not stopping.is_alive()
    with db.engine.connect() as conn:  # the lease's backend ends: the stuck check fails, the lock is free
        conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        conn.commit()
        _within(20, lambda: _backend_gone(conn, pid), "the lease's backend did not exit")
    stopping.join(20)
    proxy.close()
    assert released


def test_every_postgres_connection_finds_a_vanished_database_in_seconds(db: Database) -> None:
    """Only the LISTEN connection had keepalives and `tcp_user_timeout`: a pooled connection's query to a
    vanished host waited out the kernel's retransmissions (about 15 minutes), and the engine thread and every
    API worker waited with it."""
    if db.engine.dialect.name != "postgresql":
        pytest.skip("libpq's settings")
    with db.engine.connect() as conn:
        settings = conn.connection.driver_connection.info.get_parameters()  # type: ignore[union-attr]
    assert settings["keepalives"] == "1" and int(settings["keepalives_idle"]) <= 30
    assert int(settings["tcp_user_timeout"]) <= 30_000 and int(settings["connect_timeout"]) <= 30
    own = db.engine.url.update_query_dict({"connect_timeout": "42", "keepalives_idle": "77"})
    engine = open_engine(own.render_as_string(hide_password=False))  # what the URL sets wins
    with engine.connect() as conn:
        settings = conn.connection.driver_connection.info.get_parameters()  # type: ignore[union-attr]
    engine.dispose()
    assert (settings["connect_timeout"], settings["keepalives_idle"], settings["keepalives"]) == ("42", "77", "1")


def test_a_lease_released_during_its_check_frees_the_lock(db: Database, tmp_path: Path) -> None:
    """`release` leaves a connection the watchdog is querying to the watchdog; it returned it to the pool
    still holding the advisory lock, and no engine could take the lease while this process lived."""
    from sqlalchemy import event

    if db.engine.dialect.name != "postgresql":
        pytest.skip("the advisory lock is Postgres's")
    checking = threading.Event()

    def slow_check(conn, cursor, statement, *args) -> None:  # type: ignore[no-untyped-def]
        if statement == "SELECT 1" and threading.current_thread().name == "tx-lease":
            checking.set()
            time.sleep(2)

    event.listen(db.engine, "before_cursor_execute", slow_check)
    try:
        lease = take_engine_lease(db.engine, tmp_path / "a")
        _within(20, checking.is_set, "the watchdog did not check")  # its first check comes after 5 s
        lease.release()
        taken: list[EngineLease] = []

        def take() -> bool:
            with contextlib.suppress(EngineBusy):
                taken.append(take_engine_lease(db.engine, tmp_path / "b"))
            return bool(taken)

        _within(20, take, "the released lease's lock stayed held")
        taken[0].release()
    finally:
        event.remove(db.engine, "before_cursor_execute", slow_check)
