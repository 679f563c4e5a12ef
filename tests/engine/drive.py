"""Drive a real `JaxRunner` one work item at a time, as the engine loop does, for tests without a queue."""

from __future__ import annotations

import itertools
from pathlib import Path
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


def tiny_runner(model_dir: Path, data_dir: Path, slots: int) -> JaxRunner:
    """A real runner over a tiny checkpoint: float32, `slots` adapter slots of rank up to 8, 4 decode rows."""
    from tx.engine import AdapterConfig, EngineConfig, build_runner
    from tx.engine.sampler import SamplerConfig

    built, _ = build_runner(
        EngineConfig(base_model=str(model_dir), data_dir=data_dir, dtype="float32",
            adapters=AdapterConfig(slots, 8), sampler=SamplerConfig(max_rows=4, max_seq_len=64))
    )  # fmt: skip
    return built
