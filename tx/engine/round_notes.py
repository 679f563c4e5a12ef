"""What the runner remembers between planning a round and reporting its results, per request and per run.

Per request: its queue wait (logged when planned, INFO from a second on) and the host bytes its run was
paged in from; both go into the request's metrics when it completes, and are forgotten then or when the
request is discarded. Per run: the last round it had items in, from which come the planner's turn keys
(`RoundLimits.turns`): the run served least recently goes first, a paged-out run only after waiting a few
rounds longer (paging is costly: round-robin over more runs than slots would move one in and out each turn).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable

from tx.engine.loop import Completion
from tx.engine.planner import Plan
from tx.protocol import WorkItem

log = logging.getLogger("tx.engine")

QUEUE_WAIT = "queue_wait_s:max"  # seconds from submission to the start of execution, per request
PAGED_IN = "paged_in_bytes:max"  # host memory the request's run was paged in from before it ran (if it was)
PAGE_PATIENCE = 64  # rounds a run in host memory waits beyond the device's runs before it is paged back in


class RoundNotes:
    def __init__(self) -> None:
        self.rounds = 0
        self.served: dict[str, int] = {}  # run -> the last round it had items in
        self.waits: dict[str, float] = {}  # future id -> seconds it waited in the queue
        self.paged_in: dict[str, int] = {}  # future id -> host bytes its run was paged in from

    def planned(self, plan: Plan, live_runs: Collection[str]) -> None:
        """A round is about to run `plan`: its runs' turn and each request's queue wait."""
        self.rounds += 1
        self.served = {r: n for r, n in self.served.items() if r in live_runs}
        self.served.update({str(item.model_id): self.rounds for item in plan.items})
        now = time.time()
        for item in plan.items:
            wait = self.waits[item.future_id] = max(now - item.created_at, 0.0)
            log.log(logging.INFO if wait >= 1.0 else logging.DEBUG, "%s %s of %s waited %.3f s in the queue",
                    item.kind, item.future_id, item.model_id, wait)  # fmt: skip

    def turns(self, in_host_memory: Collection[str]) -> dict[str, int]:
        """The planner's turn keys: the last round each run was served in, later by `PAGE_PATIENCE` rounds for
        a run in host memory, so runs on the device take turns among themselves and a paged-out run takes a
        slot (a page move each way) only once it has waited that much longer than them."""
        return {run: n + PAGE_PATIENCE * (run in in_host_memory) for run, n in self.served.items()}

    def paged(self, items: Iterable[WorkItem], nbytes: int) -> None:
        """`items`' run was paged in from `nbytes` of host memory for them."""
        self.paged_in.update({item.future_id: nbytes for item in items})

    def forget(self, future_ids: Iterable[str]) -> None:
        for future_id in future_ids:
            self.waits.pop(future_id, None)
            self.paged_in.pop(future_id, None)

    def report(self, completion: Completion) -> Completion:
        """The request's queue wait, and the host bytes its run was paged in from, in its metrics."""
        wait = self.waits.pop(completion.future_id, None)
        paged = self.paged_in.pop(completion.future_id, None)
        metrics = getattr(completion.result, "metrics", None)
        if wait is not None and isinstance(metrics, dict):
            metrics[QUEUE_WAIT] = wait
        if paged is not None and isinstance(metrics, dict):
            metrics[PAGED_IN] = float(paged)
        return completion
