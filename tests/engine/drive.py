"""Drive a real `JaxRunner` one work item at a time, as the engine loop does, for tests without a queue."""

from __future__ import annotations

import itertools
from typing import Any

from tx.engine.runner import JaxRunner
from tx.protocol import WorkItem

_ids = itertools.count()


def run(runner: JaxRunner, kind: str, model_id: str, payload: Any) -> Any:
    """Submit one item of `kind` for `model_id` and step the runner until its result (or fail the test)."""
    item = WorkItem(f"f{next(_ids)}", kind, model_id, payload, created_at=0.0)  # type: ignore[arg-type]
    runner.submit([item])
    for _ in range(100):
        done = runner.step()
        if done:
            return done[0].result
    raise AssertionError(f"{kind} did not finish")
