"""Full fine-tuning sampler checkpoints read from disk on a thread of their own.

A sample that names a full sampler checkpoint no longer in memory needs a whole weight set read from disk: 2.4
GB for Qwen3-0.6B in float32, seconds, and every tenant's training and sampling steps waited on the engine
thread meanwhile. `FullLoads.take` starts the read on a loader thread and raises `LoadWaiting` (a
`SlotsExhausted`: the runner keeps the sample waiting and retries it each step) until the weights are in; a
failed read fails the samples that asked for it. One read at a time: samples naming many checkpoints must not
hold many whole weight sets in memory at once (the kept snapshots are bounded, reads must be too). An engine
over several processes reads in line: its processes step in lockstep, and a thread finishing at different
moments would split their decisions.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tx.lora.slots import SlotsExhausted

Flat = dict[tuple[str, ...], Any]


class LoadWaiting(SlotsExhausted):
    """The sample's weights are being read from disk: it waits, and nothing else does."""


class FullLoads:
    """`load(directory)` reads a full sampler checkpoint; `background`: on a loader thread (one process)."""

    def __init__(self, load: Callable[[Path], Flat], background: bool) -> None:
        self._load, self._background = load, background
        self._reads: dict[str, concurrent.futures.Future] = {}  # snapshot id -> its read in flight
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None  # made at the first read

    def take(self, snapshot_id: str, directory: Path) -> Flat:
        """The snapshot's weights once read; raises `LoadWaiting` while they are read, or the read's error."""
        if not self._background:
            return self._load(directory)
        read = self._reads.get(snapshot_id)
        if read is None and self._reads:  # one weight set read (or waiting to be taken) at a time
            raise LoadWaiting(f"sampler checkpoint {directory.name} waits for another checkpoint's read")
        if read is None:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tx-snapshot-load")
            self._reads[snapshot_id] = self._executor.submit(self._load, directory)
            raise LoadWaiting(f"sampler checkpoint {directory.name} is being read from disk")
        if not read.done():
            raise LoadWaiting(f"sampler checkpoint {directory.name} is being read from disk")
        del self._reads[snapshot_id]
        return read.result()

    def pending(self) -> list[concurrent.futures.Future]:
        return [read for read in self._reads.values() if not read.done()]

    def keep_only(self, wanted: set[str]) -> None:
        """Drop the reads no waiting sample asks for any more (discarded, or the snapshot was saved anew): a
        finished one holds a whole weight set, and a later sample must not take one read before a save."""
        for snapshot_id in set(self._reads) - wanted:
            self._reads.pop(snapshot_id).cancel()
