"""Wake-ups without polling: new work for the engine, finished futures for long-polling clients.

In-process, `submit` and `complete` call `Notifier.work_submitted` / `result_ready` right after
their transaction commits; the engine thread blocks on a `threading.Event` and each long-poll holds
an `asyncio.Future` resolved thread-safely on its own event loop. With Postgres, `PgListener` also
turns `LISTEN/NOTIFY` messages from other processes into the same calls.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from typing import Any

from tx.db.connect import tcp_settings
from tx.failures import FailureLog

log = logging.getLogger("tx.db")

WORK_CHANNEL = "smolgym_work"
DONE_CHANNEL = "smolgym_done"
PING_S = 10.0  # a quiet listener checks its connection this often


class Notifier:
    """Thread-safe fan-out of 'work submitted' and 'future finished' signals."""

    def __init__(self) -> None:
        self._work = threading.Event()
        self._lock = threading.Lock()
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = defaultdict(list)
        self._submitting = 0

    def work_submitted(self) -> None:
        self._work.set()

    def submission_started(self) -> None:
        with self._lock:
            self._submitting += 1

    def submission_ended(self) -> None:
        with self._lock:
            self._submitting -= 1

    def submitting(self) -> bool:
        """True while an API thread of this process is writing a request into the queue."""
        return self._submitting > 0

    def take_work_flag(self) -> bool:
        """Clear the 'new work' flag; True if it was set (call before looking for work)."""
        was_set = self._work.is_set()
        self._work.clear()
        return was_set

    def wait_for_work(self, timeout_s: float) -> None:
        self._work.wait(timeout_s)

    def add_waiter(self, future_id: str) -> asyncio.Future[None]:
        """An asyncio future (on the running loop) resolved when `future_id` finishes."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._waiters[future_id].append((loop, waiter))
        return waiter

    def remove_waiter(self, future_id: str, waiter: asyncio.Future[None]) -> None:
        with self._lock:
            entries = self._waiters.get(future_id, [])
            entries[:] = [(loop, w) for loop, w in entries if w is not waiter]
            if not entries:
                self._waiters.pop(future_id, None)

    def wake_all(self) -> None:
        """Every waiter looks again, and the engine: what finished or arrived while no listener was connected
        (each long poll re-reads its row, and waits on if it is still running)."""
        self.work_submitted()
        with self._lock:
            future_ids = list(self._waiters)
        for future_id in future_ids:
            self.result_ready(future_id)

    def result_ready(self, future_id: str) -> None:
        with self._lock:
            entries = list(self._waiters.get(future_id, []))
        for loop, waiter in entries:
            try:
                loop.call_soon_threadsafe(_resolve, waiter)
            except RuntimeError:  # the loop is closed (server shutting down)
                pass


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class PgListener:
    """Relays Postgres NOTIFY on our two channels into a `Notifier` (for multi-process setups)."""

    def __init__(self, conninfo: str, notifier: Notifier) -> None:
        self.conninfo = conninfo
        self.notifier = notifier
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tx-pg-listen", daemon=True)
        self.backend_pid: int | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import psycopg

        again, failures = False, FailureLog(log, "postgres LISTEN connection")
        while not self._stop.is_set():
            try:
                given = psycopg.conninfo.conninfo_to_dict(self.conninfo)
                with psycopg.connect(self.conninfo, autocommit=True, **tcp_settings(given)) as conn:
                    self.backend_pid = conn.info.backend_pid  # the server's process for it (logs, tests)
                    conn.execute(f"LISTEN {WORK_CHANNEL}")
                    conn.execute(f"LISTEN {DONE_CHANNEL}")
                    if again:  # what was sent while no connection listened is lost: everyone looks again
                        self.notifier.wake_all()
                    again = True
                    failures.succeeded()
                    self._listen(conn)
            except Exception as err:  # reconnects every second
                failures.failed(err)
                self._stop.wait(1.0)

    def _listen(self, conn: Any) -> None:
        """Relay notifications; after `PING_S` without one, a query proves the connection alive. A listener
        only reads, so a connection a NAT or load balancer dropped without a word went unnoticed: every long
        poll ran to its 25 s deadline, for good. The query fails (at worst after `tcp_user_timeout`) and the
        caller reconnects."""
        heard = time.monotonic()
        while not self._stop.is_set():
            for note in conn.notifies(timeout=1.0):
                self._dispatch(note.channel, note.payload)
                heard = time.monotonic()
            if time.monotonic() - heard > PING_S:
                conn.execute("SELECT 1")
                heard = time.monotonic()

    def _dispatch(self, channel: str, payload: str) -> None:
        if channel == WORK_CHANNEL:
            self.notifier.work_submitted()
        elif channel == DONE_CHANNEL:
            self.notifier.result_ready(payload)
