"""The JAX runner: turns queued work items into trainer, sampler and checkpoint calls.

It implements `tx.engine.loop.Runner`. Training-side items of one run execute strictly in arrival
order; each `step()` first plans a round (`tx.engine.planner.plan_round`, a pure function: runs take
turns within one micro-batch of tokens): the planned forward / forward_backward items are fused into
one training batch, a request larger than the budget advances by one micro-batch
(`tx.engine.long_work`), then each run whose next item is a control item (optim_step, save, load, ...)
executes it. Then the sampler runs one decode chunk, so training waits at most one chunk behind
sampling. Sample requests bypass the round: they join the sampler's continuous batch as soon as they
are submitted. A round holds no more LoRA runs (plus the snapshots they save) than there are device
slots the sampler is not reading; its runs that live in host memory are paged in before it runs
(`tx.engine.paging`), and an item that still finds no slot stays pending for a later round. An item that
waits for room that sampling holds (a LoRA save needs two slots, and sampling may read all but one; a full
fine-tuning save a copy past the busy ones kept) makes new samples of snapshots of that kind wait until what
they read drains (`draining`): samples kept coming held it back for good. The weights a sample reads, and the
snapshots saves make, are `tx.engine.sampler_weights`'s.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from tx.engine import checkpoints
from tx.engine.errors import as_request_error
from tx.engine.long_work import LongItem
from tx.engine.loop import Completion
from tx.engine.paging import Pager
from tx.engine.planner import Plan, RoundLimits, plan_round
from tx.engine.round_notes import RoundNotes
from tx.engine.run_memory import lora_run_bytes
from tx.engine.sampler import Sampler
from tx.engine.sampler_weights import SamplerWeights
from tx.engine.snapshots import FullCopiesBusy, FullSnapshots, HeldSnapshots, SamplerFactory
from tx.engine.trainer import Trainer
from tx.engine.weights_io import WeightsIO
from tx.lora.slots import ReadSlotsBusy, SlotsExhausted, SlotTable
from tx.names import contained
from tx.protocol import (
    CheckpointResult,
    CreateModelRequest,
    CreateModelResult,
    ForwardBackwardRequest,
    LoadResult,
    LoadStateRequest,
    LoadWeightsRequest,
    OptimStepRequest,
    OptimStepResult,
    RequestError,
    SampleRequest,
    SaveSamplerRequest,
    SaveStateRequest,
    UnloadResult,
    WeightsRef,
    WorkItem,
    weights_shape,
)

log = logging.getLogger("tx.engine")


class JaxRunner:
    """`sampler` samples the shared base weights with any adapter slot; `make_sampler(get_base)` builds a
    sampler over another full weight set (a full fine-tuning run's snapshot), sharing its compiled programs;
    at most `max_full_snapshots` of those stay in memory (least recently used go first, busy ones never)."""

    def __init__(
        self,
        trainer: Trainer,
        sampler: Sampler,
        io: WeightsIO,
        base_model: str,
        make_sampler: SamplerFactory | None = None,
        max_full_snapshots: int = 2,
        checkpoint_root: Path | None = None,
    ) -> None:
        """`checkpoint_root`: every checkpoint directory a request names must lie inside it (the API
        checked the name too); None only in tests that write to temporary directories."""
        self.trainer, self.sampler, self.io = trainer, sampler, io
        self.bank = trainer.bank
        # Neither holds the runner (no reference cycle): an unloaded model's arrays go with its last reference.
        self.pager = Pager(trainer, sampler.slots_in_use)
        self._protect: frozenset[str] = frozenset()  # the runs of the round being executed
        self.checkpoint_root = checkpoint_root
        self.run_memory = self.bank.memory  # the bytes of the server's LoRA runs, shared by every model's bank
        self.base_model = base_model
        full = FullSnapshots(make_sampler, max_full_snapshots)  # full fine-tuning runs' snapshots
        self.weights = SamplerWeights(trainer, sampler, io, self.pager, full)
        self.pending: list[WorkItem] = []
        self.outbox: list[Completion] = []  # requests refused at submit, reported by the next step
        self.slot_waiting: list[WorkItem] = []  # samples whose snapshot waits in host memory for a free slot
        self.read_queue: set[str] = set()  # those of them that wait for a slot sampling may read: first in turn
        # the kinds of room ("lora" slots, "full" copies) a training item waits for: new samples of that kind wait
        self.draining: frozenset[str] = frozenset()
        self._waited: set[str] = set()  # the kinds control items of this round found no room of
        data_dirs = [checkpoint_root.parent] if checkpoint_root is not None else []
        # a request over one round's tokens, a micro-batch per round
        self.long = LongItem(trainer, functools.partial(as_request_error, roots=data_dirs))
        self.notes = RoundNotes()  # queue waits, page-ins and the runs' turns

    # ---- Runner protocol ----------------------------------------------------------------------------

    def submit(self, items: Sequence[WorkItem]) -> None:
        for item in items:
            if item.kind == "sample":
                self._submit_sample(item)
            else:
                self.pending.append(item)

    def discard(self, future_ids: Sequence[str]) -> None:
        """Forget items the engine has failed on its own (after an unexpected error in `step`)."""
        gone = set(future_ids)
        self.pending = [i for i in self.pending if i.future_id not in gone]
        self.outbox = [c for c in self.outbox if c.future_id not in gone]
        self.slot_waiting = [i for i in self.slot_waiting if i.future_id not in gone]
        self.read_queue -= gone
        for sampler in self._samplers():
            sampler.discard(gone)
        self.long.discard(gone)
        self.notes.forget(gone)

    def idle(self) -> bool:
        samplers_idle = all(s.idle() for s in self._samplers())
        return not self.pending and not self.outbox and not self.slot_waiting and samplers_idle

    def live_runs(self) -> int:
        """Training runs created and not unloaded: while there are any, the model stays loaded."""
        return len(self.trainer.runs)

    def resident_bytes(self) -> int:
        """Device bytes this model holds: base weights (and the sampler's copy, if it has its own), adapter
        slots, runs' optimizer state and full fine-tuning weights, full snapshots' sampler weights."""
        trees: list[Any] = [self.trainer.base, self.bank.arrays, *(s.get_state() for s in self._samplers())]
        trees += [(run.grads, run.opt_state, run.params) for run in self.trainer.runs.values()]
        unique = {id(leaf): leaf for leaf in jax.tree.leaves(trees) if isinstance(leaf, jax.Array)}
        return sum(int(leaf.nbytes) for leaf in unique.values())

    def _samplers(self) -> list[Sampler]:
        return [self.sampler, *self.full.samplers()]

    def snapshot_count(self) -> int:
        """Sampler snapshots this model holds (on the device or in host memory): live sampling clients, likely."""
        on_device = sum(info.kind == "sampler" for info in self.slots)
        return on_device + len(self.bank.host_snapshots) + len(self.full)

    def snapshots_to_host(self) -> HeldSnapshots:
        """Host copies of every sampler snapshot: the pool is unloading this model, and its next load takes
        them back (`adopt_snapshots`), so a sampling client made from one keeps working."""
        return HeldSnapshots(self.bank.snapshots_on_host(), self.full.to_host())

    def adopt_snapshots(self, held: HeldSnapshots) -> None:
        self.bank.adopt_snapshots(held.lora)
        self.full.adopt(held.full)

    @property
    def full(self) -> FullSnapshots:
        return self.weights.full

    @property
    def slots(self) -> SlotTable:
        return self.bank.slots

    def step(self) -> list[Completion]:
        waiting, self.slot_waiting, self.read_queue = self.slot_waiting, [], set()
        self.submit(waiting)  # in their order: the first that finds no slot makes the rest wait behind it
        self.weights.loads.keep_only({ref.snapshot_id for i in self.slot_waiting if (ref := _weights_of(i))})
        done, self.outbox = self.outbox, []
        plan, unplaced = self._resident(plan_round(self.pending, self._full_runs(), self._limits()))
        done += unplaced
        self.notes.planned(plan, self.trainer.runs)
        if plan.fused:
            done += self._forward_backward(plan.fused)
        if plan.long is not None:
            self.long.start(plan.long)
        done += self.long.advance()
        controls = [self._control(item) for item in plan.control]
        done += [c for c in controls if c is not None]
        starved = {"lora"} if 0 < plan.starved <= self.slots.max_adapters else set()
        self.draining, self._waited = frozenset(starved | self._waited), set()
        self._protect = self.long.runs()
        finished = {c.future_id for c in done}
        # Every planned item has a completion (each one's failure is caught), so none is re-run; a long item's
        # comes in the round that finishes it, and a control item that waits for a slot has none yet.
        self.pending = [i for i in self.pending if i.future_id not in finished]
        done = [self.notes.report(c) for c in done]
        for sampler in self._samplers():
            if not sampler.idle():
                done += [Completion(rid, out) for rid, out in sampler.step()]
        if not done and not self.pending and all(s.idle() for s in self._samplers()):
            concurrent.futures.wait(self.weights.loads.pending(), 0.01)  # only reads from disk to wait for: no spin
        return done

    def _full_runs(self) -> set[str]:
        return {r for r, run in self.trainer.runs.items() if run.lora is None}

    def _limits(self) -> RoundLimits:
        """A round's bounds: the slots the sampler is not reading, one micro-batch of tokens, the long item."""
        free = self.slots.max_adapters - len(self.sampler.slots_in_use() - {0})
        paged_out = {r for r, run in self.trainer.runs.items() if not run.resident}
        return RoundLimits(free, self.trainer.micro_batch_tokens, self.long.runs(), self.notes.turns(paged_out))

    def _resident(self, plan: Plan) -> tuple[Plan, list[Completion]]:
        """Page in the planned runs that are in host memory; a run that finds no slot (every one held by
        this round or by snapshots being sampled) waits for a later round, and one whose page-in raises (a
        device out of memory) fails this round's items, alone: its host copy stays for a later try."""
        self._protect = frozenset(str(i.model_id) for i in plan.items) | self.long.runs()
        waiting: set[str] = set()
        failed: list[Completion] = []
        for run_id in dict.fromkeys(str(i.model_id) for i in plan.items):
            try:
                nbytes = self.pager.ensure_resident(run_id, self._protect)
            except SlotsExhausted:
                waiting.add(run_id)
                continue
            except Exception as err:
                log.exception("paging run %s in failed", run_id)
                waiting.add(run_id)
                failed += [Completion(i.future_id, self._error(err)) for i in plan.items if i.model_id == run_id]
                continue
            if nbytes:
                self.notes.paged([i for i in plan.items if i.model_id == run_id], nbytes)
        fused = [i for i in plan.fused if i.model_id not in waiting]
        control = [i for i in plan.control if i.model_id not in waiting]
        long = plan.long if plan.long is not None and plan.long.model_id not in waiting else None
        return Plan(fused, control, long, plan.starved), failed

    def _error(self, err: BaseException) -> RequestError:
        data_dir = [self.checkpoint_root.parent] if self.checkpoint_root is not None else []
        return as_request_error(err, data_dir)

    def _path(self, directory: str) -> Path:
        """A checkpoint directory named by a request, checked to lie inside the checkpoint root."""
        return Path(directory) if self.checkpoint_root is None else contained(directory, self.checkpoint_root)

    # ---- training ----------------------------------------------------------------------------------

    def _forward_backward(self, items: list[WorkItem]) -> list[Completion]:
        ok: list[WorkItem] = []
        done = []
        for item in items:
            if item.model_id not in self.trainer.runs:
                done.append(Completion(item.future_id, RequestError(f"unknown model_id {item.model_id!r}", "user")))
            else:
                ok.append(item)
        return done + self._fused(ok)

    def _fused(self, items: list[WorkItem]) -> list[Completion]:
        """Run the items as one batch. If the batch fails, the trainer has undone its gradients, and each
        item runs again alone, so only the item that fails by itself reports an error."""
        work = [(str(i.model_id), i.payload) for i in items]
        assert all(isinstance(p, ForwardBackwardRequest) for _, p in work)
        try:
            results = self.trainer.forward_backward(work)  # type: ignore[arg-type]
        except Exception as err:
            # A full fine-tuning run is alone in its batch, and its gradients are gone: each request reads so.
            run = self.trainer.runs.get(work[0][0])
            if len(items) == 1 or (run is not None and run.lora is None):
                log.warning("forward_backward %s failed: %s", items[0].future_id, err, exc_info=True)
                return [Completion(item.future_id, self._error(err)) for item in items]
            log.warning("a fused batch of %d requests failed (%s); running them one by one", len(items), err)
            return [c for item in items for c in self._fused([item])]
        return [Completion(i.future_id, r) for i, r in zip(items, results, strict=True)]

    def _control(self, item: WorkItem) -> Completion | None:
        """The item's completion; None when it must wait for a slot (it stays pending for a later round)."""
        try:
            return Completion(item.future_id, self._dispatch(item))
        except SlotsExhausted as err:  # every slot is read by the sampler or held by this round: try again next round
            self._waited.add("full" if isinstance(err, FullCopiesBusy) else "lora")
            return None
        except Exception as err:  # contained: this item fails, nothing else does
            if not isinstance(err, RequestError):
                log.warning("%s %s failed", item.kind, item.future_id, exc_info=True)
            return Completion(item.future_id, self._error(err))

    def _dispatch(self, item: WorkItem):  # noqa: ANN202 - one of the protocol results
        result = self._run_item(item)
        dest = getattr(item.payload, "dest_dir", None)
        if isinstance(result, CheckpointResult) and dest:  # its files are in place: a restart must know
            try:
                checkpoints.mark_saved(self._path(dest), item.future_id)
            except OSError as err:  # only a crash's recovery reads it: the save stands
                log.warning("could not mark save %s done on disk: %s", item.future_id, err)
        return result

    def _run_item(self, item: WorkItem):  # noqa: ANN202 - one of the protocol results
        run_id, p = str(item.model_id), item.payload
        if isinstance(p, CreateModelRequest):
            self._create(run_id, p.lora)
            return CreateModelResult(run_id)
        if isinstance(p, OptimStepRequest):
            return OptimStepResult(self.trainer.optim_step(run_id, p.adam))
        if isinstance(p, SaveStateRequest):
            run = self._run(run_id)
            size = checkpoints.save(
                self._path(p.dest_dir), self.trainer.run_params(run), run.opt_state, run.step, run.lora, self.base_model
            )
            return CheckpointResult(path=p.tinker_path, size_bytes=size)
        if isinstance(p, LoadStateRequest):
            self._load(run_id, self._path(p.source_dir), p.with_optimizer)
            return LoadResult(run_id, p.tinker_path)
        if isinstance(p, LoadWeightsRequest):
            lora, _ = checkpoints.read_meta(self._path(p.source_dir))
            self._create(run_id, lora)
            try:
                self._load(run_id, self._path(p.source_dir), p.with_optimizer)
            except BaseException:
                self._forget(run_id)  # a run that could not be restored does not keep its slot
                raise
            return LoadResult(run_id, p.tinker_path)
        if isinstance(p, SaveSamplerRequest) and item.kind == "save_weights_external":
            return self.weights.export(self._run(run_id), p, self._path)
        if isinstance(p, SaveSamplerRequest):
            return self.weights.save(self._run(run_id), p, self._path, self._protect, item.owner)
        if item.kind == "unload_model":
            self._run(run_id)
            self._forget(run_id)
            return UnloadResult(run_id)
        raise RequestError(f"unsupported request kind {item.kind!r}", "server")

    def _create(self, run_id: str, lora) -> None:  # noqa: ANN001
        if run_id in self.trainer.runs:
            raise RequestError(f"model {run_id!r} already exists", "user")
        if lora is None:
            self._check_run_limit()
            self.io.check_full_finetune_fits(self.trainer)
            self.trainer.create_full_run(run_id)
            return
        self._check_run_limit()
        slot = self.pager.claim(run_id, "run", lora, self._protect)
        try:
            run = self.trainer.create_lora_run(run_id, lora, slot)
            self.run_memory.admit(run_id, lora_run_bytes(run.grads, run.opt_state))
            self.bank.trim_snapshots()  # host snapshots give way to runs
        except BaseException:  # a slot held for a run the trainer does not know would fail its eviction later
            self.trainer.runs.pop(run_id, None)
            self.bank.clear(self.bank.release(run_id).slot)
            raise

    def _forget(self, run_id: str) -> None:
        self.trainer.drop_run(run_id)  # a paged-out run leaves the host store
        self.run_memory.release(run_id)
        self.bank.release(run_id) if run_id in self.slots else None

    def _check_run_limit(self) -> None:
        limit = self.bank.max_runs
        if len(self.trainer.runs) >= limit:
            raise RequestError(
                f"this server already holds {limit} training runs, its limit (--max-runs {limit}); unload a run, "
                f"let an idle session expire, or restart with --max-runs {2 * limit}",
                "user",
            )

    def _load(self, run_id: str, source: Path, with_optimizer: bool) -> None:
        run = self._run(run_id)
        lora, step = checkpoints.read_meta(source)
        if weights_shape(lora) != weights_shape(run.lora):
            raise RequestError(
                f"checkpoint {source.name} does not match model {run_id!r} (kind, rank or trained modules)", "user"
            )
        params, opt_state = checkpoints.restore(source, self.trainer.run_params(run), run.opt_state)
        self.trainer.set_run_params(run, params)
        run.grads = {p: jnp.zeros_like(g) for p, g in run.grads.items()}
        if with_optimizer:
            run.opt_state, run.step = opt_state, step
        else:  # "weights only, optimizer resets": the moments of the steps trained since were kept
            self.trainer.reset_optimizer(run)

    def _run(self, run_id: str):  # noqa: ANN202
        if run_id not in self.trainer.runs:
            raise RequestError(f"unknown model_id {run_id!r}", "user")
        return self.trainer.runs[run_id]

    # ---- sampling ----------------------------------------------------------------------------------

    def _submit_sample(self, item: WorkItem) -> None:
        """Hand a sample to the sampler of its weights. Whatever fails here fails this request alone, reported
        by the next step (a full snapshot moved back to the device may not fit, say): `submit` never raises."""
        req = item.payload
        assert isinstance(req, SampleRequest)
        try:
            if (
                req.weights is not None
                and ("full" if req.weights.snapshot_id in self.full else "lora") in self.draining
            ):
                raise ReadSlotsBusy("a training item waits for room that samples of such snapshots hold")
            slot = self.weights.resolve(req, self._path, self._protect, bool(self.read_queue), item.owner)
            snapshot = req.weights.snapshot_id if req.weights else None
            full = self.full.use(snapshot) if snapshot else None
            (full or self.sampler).submit(item.future_id, req, 0 if full else slot, item.model_id or "")
        except ReadSlotsBusy:  # its snapshot would read one slot too many (`check_sampling_room`): wait in turn
            self.slot_waiting.append(item)
            self.read_queue.add(item.future_id)
        except SlotsExhausted:  # every full fine-tuning snapshot kept is being sampled: wait
            self.slot_waiting.append(item)
        except Exception as err:  # contained: this request fails, nothing else does
            self.outbox.append(Completion(item.future_id, self._error(err)))


def _weights_of(item: WorkItem) -> WeightsRef | None:
    return item.payload.weights if isinstance(item.payload, SampleRequest) else None
