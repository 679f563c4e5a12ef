"""Device slots for more runs than fit: page idle training runs to host memory and back, exactly.

`--max-lora-adapters` is the number of device slots. When an owner (a training run about to be planned,
a new run, a sampler snapshot) needs one and none is free, the least recently used owner that may go is
moved out to the bank's host store, bit for bit: a training run (`Trainer.page_out`: adapter, gradients,
Adam moments, step) or a sampler snapshot (`AdapterBank.stash_snapshot`), which comes back when it is
next sampled. Never moved: the runs of the round being executed (`protect`) and the snapshots the
sampler is decoding from, which hold at most all slots but one (`check_sampling_room`), so training
always has one. A run is paged back in (`Trainer.page_in`) before its next item runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

from tx.engine.trainer import Trainer, lora_targets
from tx.lora.slots import OwnerKind, ReadSlotsBusy, SlotsExhausted
from tx.protocol import LoraConfig

log = logging.getLogger("tx.engine")
EVERY_KIND: frozenset[OwnerKind] = frozenset({"run", "sampler", "retired"})
RETIRED: frozenset[OwnerKind] = frozenset({"retired"})


@dataclasses.dataclass
class PageStats:
    """Counts and seconds of page moves since start (for benchmarks and logs)."""

    page_ins: int = 0
    page_outs: int = 0
    seconds: float = 0.0


class Pager:
    """Slot claims for one adapter bank; `busy()` names the slots the sampler is decoding from."""

    def __init__(self, trainer: Trainer, busy: Callable[[], set[int]]) -> None:
        self.trainer, self.bank, self.busy = trainer, trainer.bank, busy
        self.stats = PageStats()

    def claim(self, owner: str, kind: OwnerKind, lora: LoraConfig, protect: frozenset[str]) -> int:
        """A slot for `owner` in the table, making room first if every slot is held."""
        self._make_room(protect | {owner})
        info = self.bank.allocate(owner, kind, lora.rank, lora.alpha, lora_targets(lora))
        return info.slot

    def ensure_resident(self, run_id: str, protect: frozenset[str]) -> int:
        """Page `run_id` in if it is in host memory; the host bytes it held there (0: it was on the device).
        Raises `SlotsExhausted` if no slot can be freed."""
        run = self.trainer.runs.get(run_id)
        if run is None or run.resident:
            if run_id in self.bank.slots:
                self.bank.slots.touch(run_id)
            return 0
        assert run.lora is not None
        start = time.perf_counter()
        nbytes = self.bank.host[run_id].nbytes
        slot = self.claim(run_id, "run", run.lora, protect)
        with self._released_on_failure(run_id, slot):
            self.trainer.page_in(run_id, slot)
        self.stats.page_ins += 1
        self.stats.seconds += time.perf_counter() - start
        log.info("paged run %s into slot %d from %.2f MiB of host memory", run_id, slot, nbytes / 2**20)
        return nbytes

    @contextlib.contextmanager
    def _released_on_failure(self, owner: str, slot: int) -> Iterator[None]:
        """A page-in that raises (a device out of memory) gives its slot back, cleared; the host copy stays.
        The slot had stayed allocated: the run read an empty adapter or failed for good, a snapshot sampled
        the base model, and paging another owner out later tripped over the half-made slot."""
        try:
            yield
        except BaseException:
            try:
                self.bank.clear(slot)
            except Exception:
                log.exception("could not clear slot %d after a failed page-in of %s", slot, owner)
            if owner in self.bank.slots:
                self.bank.release(owner)
            raise

    def _make_room(self, protect: frozenset[str]) -> None:
        slots = self.bank.slots
        if len(slots) < slots.max_adapters:
            return
        busy = self.busy()
        keep = protect | {info.owner for info in slots if info.slot in busy}
        # a retired copy (replaced weights whose samples are done) is of no further use: it goes first
        victim = slots.eviction_victim(keep, RETIRED) or slots.eviction_victim(keep, EVERY_KIND)
        if victim is None:
            raise SlotsExhausted(
                f"all {slots.max_adapters} LoRA slots are held by runs of this round or snapshots being sampled; "
                f"restart with --max-lora-adapters {2 * slots.max_adapters} to raise the limit"
            )
        if slots.lookup(victim).kind == "retired":  # replaced weights whose samples are done: nothing to keep
            self.bank.clear(self.bank.release(victim).slot)
            return
        start = time.perf_counter()
        if slots.lookup(victim).kind == "sampler":
            nbytes = self.bank.stash_snapshot(victim).nbytes
        else:
            nbytes = self.trainer.page_out(victim).nbytes
        self.stats.page_outs += 1
        self.stats.seconds += time.perf_counter() - start
        log.info("paged %s out to %.2f MiB of host memory (%s)", victim, nbytes / 2**20, self.host_report())

    def check_sampling_room(self, snapshot_id: str) -> None:
        """Sampling reads at most `max_adapters - 1` adapter slots at once (the one slot, with one), so a
        training run always finds a slot: a backlog of samples over as many snapshots as slots held them all
        and training waited until it drained. Raises `ReadSlotsBusy` (the sample waits for a later step)
        when reading `snapshot_id` would make one slot too many."""
        slots = self.bank.slots
        info = slots.get(snapshot_id)
        busy = self.busy() - {0}
        if (info is not None and info.slot in busy) or slots.max_adapters == 1:
            return
        if len(busy) >= slots.max_adapters - 1:
            raise ReadSlotsBusy(f"{len(busy)} snapshots are being sampled: one slot stays free for training")

    def host_report(self) -> str:
        """What the host store holds: runs and snapshots, and their bytes (each run's too)."""
        runs, snaps = self.bank.host, self.bank.host_snapshots
        per_run = ", ".join(f"{r} {h.nbytes / 2**20:.1f} MiB" for r, h in list(runs.items())[-4:])
        total = sum(h.nbytes for h in runs.values()) + sum(h.nbytes for h in snaps.values())
        return f"{len(runs)} runs, {len(snaps)} snapshots, {total / 2**20:.1f} MiB in all; latest runs: {per_run}"

    def restore_snapshot(self, snapshot_id: str, protect: frozenset[str]) -> int | None:
        """Bring a stashed snapshot back onto the device, never moving a `protect`ed run (one between the
        micro-batches of a long request); None if it is not in host memory."""
        host = self.bank.host_snapshots.get(snapshot_id)
        if host is None:
            return None
        self.check_sampling_room(snapshot_id)
        start = time.perf_counter()
        info = host.info
        self._make_room(protect | {snapshot_id})
        slot = self.bank.allocate(snapshot_id, "sampler", info.rank, info.alpha, info.targets).slot
        with self._released_on_failure(snapshot_id, slot):
            self.bank.restore_snapshot(snapshot_id, slot)
        self.stats.page_ins += 1
        self.stats.seconds += time.perf_counter() - start
        return slot
