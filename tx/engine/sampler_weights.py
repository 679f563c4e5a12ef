"""The weights a sample reads: sampler snapshots saved from runs, loaded from disk, and exports.

`SamplerWeights` belongs to one `JaxRunner`. A LoRA run's snapshot is a copy of its adapter in a slot of
its own (claimed through the `Pager`, so idle runs are paged out before a snapshot is refused); a full
fine-tuning run's snapshot is a whole weight set with a sampler over it (`FullSnapshots`). A snapshot
saved again under a name that queued samples still read is retired, not overwritten: those samples
finish with the weights they asked for. `resolve` finds (or loads) the slot a sample's weights are in;
`export` writes a run's files without making a snapshot.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax

from tx.engine.full_loads import FullLoads
from tx.engine.paging import Pager
from tx.engine.sampler import Sampler
from tx.engine.snapshots import FullSnapshots
from tx.engine.trainer import Run, Trainer
from tx.engine.weights_io import WeightsIO
from tx.lora.slots import ReadSlotsBusy
from tx.models.causal_lm import decode_layout
from tx.protocol import CheckpointResult, LoraConfig, RequestError, SampleRequest, SaveSamplerRequest

PathCheck = Callable[[str], Path]


class SamplerWeights:
    """Each call takes `path` (checks a checkpoint directory a request names) and `protect` (the runs of the
    round being executed, whose slots a snapshot may not take) from the runner: held here, they would tie
    the runner into a reference cycle, and an unloaded model's arrays would wait for the cyclic collector."""

    def __init__(self, trainer: Trainer, sampler: Sampler, io: WeightsIO, pager: Pager, full: FullSnapshots) -> None:
        self.trainer, self.sampler, self.io, self.pager, self.full = trainer, sampler, io, pager, full
        self.bank = trainer.bank
        # late-bound (a test may stand in for the read); over `io`, not self: no reference cycle
        self.loads = FullLoads(lambda directory: io.load_full(directory), background=jax.process_count() == 1)

    def save(
        self, run: Run, p: SaveSamplerRequest, path: PathCheck, protect: frozenset[str], tenant: str = ""
    ) -> CheckpointResult:
        """A sampler snapshot of the run under `p.snapshot_id` (and its files, when `p.dest_dir`), counted in
        `tenant`'s share of the host snapshots (`AdapterBank.trim_snapshots`)."""
        if run.lora is None:
            return self._save_full(run, p, path)
        slot = self._slot_for(p.snapshot_id, run.lora, protect)
        self.bank.tenants[p.snapshot_id] = tenant
        size = None
        try:
            self.bank.copy(run.slot, slot, self.trainer.run_params(run))
            if p.dest_dir:
                size = self.io.save_peft(path(p.dest_dir), self.bank, slot, run.lora)
        except BaseException:  # the save fails, and its name keeps the files it had: samples read those
            self.bank.clear(self.bank.release(p.snapshot_id).slot)
            raise
        return CheckpointResult(path=p.tinker_path, sampling_session_id=p.answer_session, size_bytes=size)

    def export(self, run: Run, p: SaveSamplerRequest, path: PathCheck) -> CheckpointResult:
        """`save_weights_external`: the files a named sampler save writes (PEFT, or a HF directory), straight
        from the run: an export is not sampled, so it takes no adapter slot and no sampler copy."""
        assert p.dest_dir is not None
        dest = path(p.dest_dir)
        if run.lora is None:
            assert run.params is not None
            return CheckpointResult(p.tinker_path, size_bytes=self.io.save_full(dest, run.params, self.trainer.config))
        return CheckpointResult(p.tinker_path, size_bytes=self.io.save_peft(dest, self.bank, run.slot, run.lora))

    def resolve(
        self, req: SampleRequest, path: PathCheck, protect: frozenset[str], queued: bool = False, tenant: str = ""
    ) -> int:
        """The adapter slot the sample reads (0: the base weights, or a full snapshot's own sampler),
        loading its snapshot from host memory or disk when it is not on the device. Raises `SlotsExhausted`
        when the sample must wait for a slot; `ReadSlotsBusy` at once while others wait for one (`queued`):
        they go first, or a client who kept a sample queued on a snapshot being read held its slot for good."""
        ref = req.weights
        if ref is None or ref.snapshot_id in self.full:
            return 0
        if queued:
            raise ReadSlotsBusy("samples of other snapshots wait for a sampling slot first")
        info = self.bank.slots.get(ref.snapshot_id)
        if info is not None:
            self.pager.check_sampling_room(ref.snapshot_id)
            self.bank.slots.touch(ref.snapshot_id)
            return info.slot
        restored = self.pager.restore_snapshot(ref.snapshot_id, protect)
        if restored is not None:
            return restored
        directory = path(ref.checkpoint_dir) if ref.checkpoint_dir else None
        if directory and ref.checkpoint_type == "sampler" and self.io.is_full(directory):
            self.full.check_room(ref.snapshot_id)  # before the load: a sample that must wait loads nothing
            self.full.add(ref.snapshot_id, self.loads.take(ref.snapshot_id, directory))
            return 0
        if directory and ref.checkpoint_type == "sampler":
            slot = self._load_peft(ref.snapshot_id, directory, protect)
            self.bank.tenants[ref.snapshot_id] = tenant
            return slot
        raise RequestError(f"sampler weights {ref.snapshot_id!r} are not available (not saved, or evicted)", "user")

    def _load_peft(self, snapshot_id: str, directory: Path, protect: frozenset[str]) -> int:
        self.pager.check_sampling_room(snapshot_id)  # before the read: a sample that waits reads nothing
        adapter = self.io.read_peft(directory)  # read once: its rank and targets come from its weights
        slot = self._slot_for(snapshot_id, self.io.lora_config_of(adapter[0]), protect)
        try:
            self.io.write_peft(adapter, self.bank, slot)
        except BaseException:  # a slot left claimed would serve the next sample of this snapshot empty
            self.bank.clear(self.bank.release(snapshot_id).slot)
            raise
        return slot

    def _save_full(self, run: Run, p: SaveSamplerRequest, path: PathCheck) -> CheckpointResult:
        """A full fine-tuning run's sampler copy: its own weight set and a sampler over it."""
        assert run.params is not None
        self.full.check_room(p.snapshot_id)  # before the copy: a save that must wait copies nothing
        snapshot = decode_layout(run.params, self.io.tuning, copy=True)
        self.full.add(p.snapshot_id, snapshot)
        size = None
        try:
            if p.dest_dir:
                size = self.io.save_full(path(p.dest_dir), snapshot, self.trainer.config)
        except BaseException:  # as for a LoRA snapshot: the name keeps its files, samples read those
            self.full.drop(p.snapshot_id)
            raise
        return CheckpointResult(path=p.tinker_path, sampling_session_id=p.answer_session, size_bytes=size)

    def _slot_for(self, snapshot_id: str, lora: LoraConfig, protect: frozenset[str]) -> int:
        slots = self.bank.slots
        existing = slots.get(snapshot_id)
        if existing is not None and existing.slot in self.sampler.slots_in_use():
            slots.retire(snapshot_id)  # the samples queued on it finish with the weights they asked for
        elif existing is not None:
            self.bank.clear(self.bank.release(snapshot_id).slot)
        self.bank.forget_snapshot(snapshot_id)  # a stashed copy is replaced by the new weights
        # Idle runs are paged out (LRU) before a snapshot is refused; this round's runs stay.
        slot = self.pager.claim(snapshot_id, "sampler", lora, protect)
        self.bank.clear(slot)
        return slot
