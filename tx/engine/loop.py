"""The engine loop: claim queued work, feed it to the runner, step the runner, record results.

The loop owns no model state and no database handle of its own: it receives a `WorkQueue` (the
durable queue, implemented in `tx.db`) and a `Runner` (the JAX executor, or a fake in tests)
through its constructor. One background thread repeats `claim -> runner.submit -> runner.step ->
queue.complete`; it blocks on `queue.wait_for_work` only while the runner has nothing in flight, so
new work is picked up the moment it is submitted and a busy runner is never put to sleep.
A runner exception fails only the futures it concerns (category "server") and the loop carries on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tx.engine.errors import EXITS, scrub_paths
from tx.engine.run_memory import host_memory_bytes
from tx.failures import FailureLog
from tx.protocol import (
    ForwardBackwardRequest,
    QueueUnavailable,
    RequestError,
    Result,
    SampleRequest,
    SampleResult,
    WorkItem,
)

log = logging.getLogger("tx.engine")


@dataclass
class Completion:
    """A finished work item: its result, or the error it failed with."""

    future_id: str
    result: Result | RequestError


class StepError(Exception):
    """Raised by `Runner.step`/`submit` when the failure can be pinned to specific futures."""

    def __init__(self, message: str, future_ids: Sequence[str]) -> None:
        super().__init__(message)
        self.future_ids = list(future_ids)


class WorkQueue(Protocol):
    """The durable request queue as the engine sees it."""

    def claim(self, limit: int, per_owner: int | None = None, max_bytes: int | None = None) -> list[WorkItem]:
        """Pending items (at most `limit`, none past an owner's `per_owner`-th unfinished one, no more stored
        bytes than `max_bytes` but the first), marked running."""
        ...

    def wait_for_work(self, timeout_s: float) -> None:
        """Return as soon as new work is submitted (or `wake` is called), or after `timeout_s`."""
        ...

    def wake(self) -> None:
        """Make a pending `wait_for_work` return now (used to stop the engine promptly)."""
        ...

    # Optional: `submitting() -> bool`, True while the API is writing a request (the burst is not over).

    def complete(self, future_id: str, result: Result) -> None: ...

    def fail(self, future_id: str, error: RequestError) -> None: ...

    # Optional: `finish_many([(future_id, result or RequestError), ...])`, all in one transaction.


class Runner(Protocol):
    """Executes work items in bounded steps (one training batch or one decode chunk per `step`)."""

    def submit(self, items: Sequence[WorkItem]) -> None:
        """Take ownership of claimed items; the runner decides order, batching and barriers. An item it
        cannot take fails through a later `step` (or a `StepError` naming it, the others taken); any other
        exception means no item was taken (the engine submits each again alone, so one that was taken
        would run twice)."""
        ...

    def step(self) -> list[Completion]:
        """Do one bounded unit of work and return the items it finished (possibly none)."""
        ...

    def idle(self) -> bool:
        """True when nothing submitted is still waiting or running."""
        ...

    # Optional: `discard(future_ids)`, forget items the engine failed itself after an unexpected error.


RERUNNABLE = frozenset({"sample", "forward"})  # kinds that change no state: safe to run again after a stop


@dataclass
class _Inflight:
    item: WorkItem
    claimed_at: float


class Engine:
    """Drives a `Runner` from a `WorkQueue` in a background thread."""

    def __init__(
        self,
        queue: WorkQueue,
        runner: Runner,
        *,
        claim_limit: int = 256,
        max_in_flight: int = 512,
        max_in_flight_bytes: int | None = None,
        idle_wait_s: float = 5.0,
        gather_s: float = 0.2,
        gather_quiet_s: float = 0.01,
    ) -> None:
        self.gather_s = gather_s
        self.gather_quiet_s = gather_quiet_s
        self.queue = queue
        self.runner = runner
        self.claim_limit = claim_limit
        self.max_in_flight = max_in_flight
        # the stored requests held at once: 512 forward_backward bodies of 64 MB each were 32 GB of host memory
        self.max_in_flight_bytes = max_in_flight_bytes or host_memory_bytes() // 8
        self.idle_wait_s = idle_wait_s
        self._inflight: dict[str, _Inflight] = {}
        self._unrecorded: list[tuple[Completion, _Inflight | None]] = []  # finished; the queue took no write
        self._last_sample_burst = 0  # sample requests in the last burst gathered from idle
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tx-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; once it has stopped, store the results the queue refused earlier, and hand back the
        claimed requests that change no state (`RERUNNABLE`) to run after a restart: an orderly stop failed
        every claimed sample, hundreds of which had never started."""
        self._stop.set()
        self.queue.wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return
        self._record_kept()
        release = getattr(self.queue, "release", None)
        rerun = [f for f, entry in self._inflight.items() if entry.item.kind in RERUNNABLE]
        if release is not None and rerun:
            try:
                log.info("handed back %d unfinished requests to run after a restart", release(rerun))
            except Exception:
                log.exception("could not hand back %d unfinished requests", len(rerun))

    def in_flight(self) -> list[str]:
        """The future ids claimed and not yet recorded (safe to call from another thread)."""
        return list(self._inflight) + [completion.future_id for completion, _ in list(self._unrecorded)]

    def _run(self) -> None:
        log.info("engine loop started")
        failures = FailureLog(log, "engine iteration")
        while not self._stop.is_set():
            try:
                self.run_once()
            except EXITS:
                raise
            except BaseException as err:  # the loop must survive anything, queue errors and native panics included
                failures.failed(err)
                time.sleep(0.5)
                continue
            failures.succeeded()

    def run_once(self) -> None:
        """One iteration: admit new work, then step the runner or sleep until work arrives."""
        self._record_kept()
        self._admit(self._claim_burst())
        if self.runner.idle():
            if self._inflight:  # the runner says it is done but never reported these
                self._fail_many(list(self._inflight), "the engine lost track of this request")
            self.queue.wait_for_work(1.0 if self._unrecorded else self.idle_wait_s)
            return
        self._step()

    def _claim_burst(self) -> list[WorkItem]:
        """Claim pending work. When the runner was idle, keep claiming while requests keep arriving: a
        client's burst (eight `sample` calls, several runs' `forward_backward`) lands over a few
        milliseconds, and starting on its first request alone would split the batch (a second prefill,
        and rows that finish a chunk later). The burst ends after a quiet gap with no new request
        (`gather_quiet_s` once a sample request is among them, whose decode dwarfs the wait; 2 ms for
        training alone) while no request is still being written by the API, or after `gather_s` in all.
        A sample burst smaller than the previous one waits past quiet gaps (up to `gather_s`): an RL loop
        sends the same number of `sample` calls every step, and 32 of them through the SDK arrive with
        gaps of tens of milliseconds; a split burst decodes in two rounds and compiles another shape.
        Arrivals wake the wait at once; nothing polls."""
        items = self._claim()
        if not items or not self.runner.idle():
            return items
        deadline = time.monotonic() + self.gather_s
        while (left := deadline - time.monotonic()) > 0:
            samples = sum(item.kind == "sample" for item in items)
            expecting = 0 < samples < self._last_sample_burst
            quiet = self.gather_quiet_s if samples else 0.002
            self.queue.wait_for_work(left if expecting else min(quiet, left))
            try:
                more = self._claim(items)
            except Exception:  # what is claimed already is `running`: it must run, or nothing would ever finish it
                log.exception("claiming more of a burst failed; running the %d requests claimed", len(items))
                break
            if not more and not self._submitting():
                break
            items += more
        samples = sum(item.kind == "sample" for item in items)
        if samples:
            self._last_sample_burst = samples
        return items

    def _claim(self, gathered: Sequence[WorkItem] = ()) -> list[WorkItem]:
        """At most `claim_limit` pending requests, and none past `max_in_flight` claimed and unfinished (half
        of that for one owner, whose requests parked on a model being loaded held every other tenant off;
        parked ones count only in that share, `_parked`) or past `max_in_flight_bytes` of stored requests:
        the rest stay queued (not decoded into the engine's memory, not failed by a restart) until there is
        room."""
        held = [entry.item for entry in self._inflight.values()] + list(gathered)
        room = min(self.claim_limit, self.max_in_flight - len(held) + self._parked())
        room_bytes = self.max_in_flight_bytes - sum(item.nbytes for item in held)
        if room <= 0 or room_bytes <= 0:
            return []
        return self.queue.claim(room, max(self.max_in_flight // 2, 1), room_bytes)

    def _parked(self) -> int:
        """Requests the runner holds for a model still loading or downloading (its optional `parked()`): they
        count in bytes, and in each owner's share, but not in the room, which two owners' floods on a
        loading model had filled, holding every other tenant's requests queued until the load (56 s, or a
        download's hours)."""
        parked = getattr(self.runner, "parked", None)
        return int(parked()) if parked is not None else 0

    def _submitting(self) -> bool:
        submitting = getattr(self.queue, "submitting", None)
        return bool(submitting()) if submitting is not None else False

    def _admit(self, items: list[WorkItem]) -> None:
        if not items:
            return
        now = time.monotonic()
        for item in items:
            self._inflight[item.future_id] = _Inflight(item, now)
        try:
            self.runner.submit(items)
        except StepError as exc:
            self._fail_many(exc.future_ids, f"runner rejected the request: {exc}")
        except Exception:
            log.exception("runner.submit failed for a batch of %d; retrying one by one", len(items))
            self._submit_one_by_one(items)

    def _submit_one_by_one(self, items: list[WorkItem]) -> None:
        for item in items:
            try:
                self.runner.submit([item])
            except Exception as exc:
                log.exception("runner.submit failed for %s", item.future_id)
                self._fail_many([item.future_id], f"runner rejected the request: {exc}")

    def _step(self) -> None:
        try:
            completions = self.runner.step()
        except StepError as exc:
            log.exception("runner step failed")
            self._fail_many(exc.future_ids, f"internal error while executing the request: {exc}")
            self._discard(exc.future_ids)
            return
        except EXITS:
            raise
        except BaseException as exc:
            log.exception("runner step failed; failing %d in-flight requests", len(self._inflight))
            lost = list(self._inflight)
            self._fail_many(lost, f"internal error while executing the request: {type(exc).__name__}: {exc}")
            self._discard(lost)
            return
        self._finish_all(completions)

    def _discard(self, future_ids: list[str]) -> None:
        """Tell the runner to drop items failed here, so that it never runs them again."""
        discard = getattr(self.runner, "discard", None)
        if discard is not None:
            try:
                discard(future_ids)
            except Exception:
                log.exception("runner.discard failed")

    def _finish_all(self, completions: list[Completion]) -> None:
        """Record a step's completions in one queue transaction when the queue can (`finish_many`); if that
        fails, record them one by one so that only a result that cannot be stored fails."""
        finish_many = getattr(self.queue, "finish_many", None)
        if finish_many is None or len(completions) < 2:
            for completion in completions:
                self._finish(completion)
            return
        try:
            finish_many([(c.future_id, c.result) for c in completions])
        except Exception:
            log.exception("recording %d results together failed; recording them one by one", len(completions))
            for completion in completions:
                self._finish(completion)
            return
        for completion in completions:
            self._log_done(completion, self._inflight.pop(completion.future_id, None))

    def _finish(self, completion: Completion) -> None:
        entry = self._inflight.pop(completion.future_id, None)
        if self._record(completion):
            self._log_done(completion, entry)
        else:
            self._unrecorded.append((completion, entry))

    def _record(self, completion: Completion, retry: bool = False) -> bool:
        """Store a result (a result that cannot be stored fails its future instead). False when the queue
        takes no write at all (a full disk, a lost database): the result is kept to store later, and
        retries that fail again log one line, not a traceback a second."""
        result = completion.result
        try:
            if isinstance(result, RequestError):
                self.queue.fail(completion.future_id, result)
            else:
                self.queue.complete(completion.future_id, result)
            return True
        except QueueUnavailable as exc:  # a result it would store later: failing it now would report work done
            log.error("the queue takes no writes (%s): %s is kept to record again", exc, completion.future_id)
            return False
        except Exception as exc:
            log.error("recording the result of %s failed: %s", completion.future_id, exc, exc_info=not retry)
            error = RequestError(f"could not store the result: {exc}", "server")
        try:
            self.queue.fail(completion.future_id, error)
            return True
        except Exception as exc:
            log.error("the queue takes no writes (%s): %s is kept to record again", exc, completion.future_id)
            return False

    def _record_kept(self) -> None:
        """Store the results the queue refused earlier, oldest first, until it refuses again."""
        while self._unrecorded:
            completion, entry = self._unrecorded[0]
            if not self._record(completion, retry=True):
                return
            self._unrecorded.pop(0)
            self._log_done(completion, entry)

    def _fail_many(self, future_ids: Sequence[str], message: str) -> None:
        for future_id in future_ids:
            self._finish(Completion(future_id, RequestError(scrub_paths(message, ()), "server")))

    @staticmethod
    def _log_done(completion: Completion, entry: _Inflight | None) -> None:
        if entry is None:
            log.info("done %s (not in flight)", completion.future_id)
            return
        item = entry.item
        status = "failed" if isinstance(completion.result, RequestError) else "ok"
        seconds = time.monotonic() - entry.claimed_at
        tokens = _tokens(item, completion.result)
        log.info(
            "%s %s model=%s tokens=%d %.3fs future=%s",
            status,
            item.kind,
            item.model_id,
            tokens,
            seconds,
            item.future_id,
        )


def _tokens(item: WorkItem, result: object) -> int:
    """Tokens a request processed: trained/scored tokens, or prompt + generated tokens for a sample."""
    payload = item.payload
    if isinstance(payload, ForwardBackwardRequest):
        return sum(len(d.tokens) for d in payload.data)
    if isinstance(payload, SampleRequest):
        generated = sum(len(s.tokens) for s in result.sequences) if isinstance(result, SampleResult) else 0
        return len(payload.prompt) + generated
    return 0
