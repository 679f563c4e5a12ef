"""Several base models on one engine thread: `ModelPool` owns every loaded model and routes work to it.

A model is keyed by its directory (where the API located the client's model string: an upload, a local
directory, the HF cache), so two names for the same files share one loaded copy, and two owners' uploads
under one name never do. Each loaded model is one `JaxRunner` with its own weights, adapter slots and
compiled programs; loading or unloading another model never touches them (no recompiles).

Routing: `create_model`, `load_weights` and `sample` carry their model's directory (or, for a hub model
not in the local cache, its name); every other item names a run, whose model the pool learned when the
run was created. Work for a model that is not loaded waits while a loader thread builds it (the engine
thread keeps stepping the other models meanwhile), then runs in arrival order; a model known only by its
hub name is first downloaded by a fetcher thread, so a download blocks neither the engine nor the API.
Before a load the pool makes room within the memory budget by unloading idle models (no live runs, nothing
queued or running), least recently used first, those holding no sampler snapshot before those that do (their
sampling clients are likely live), and only once they make enough room; when models still working would make
it, the load waits for them to finish (`ROOM_PATIENCE_S` at most), and when nothing would, the waiting
requests fail with the sizes. One owner's upload (`upload:NAME`) never unloads a model named on the command
line: those serve every tenant. A model with live runs is never unloaded. An unloaded model's sampler
snapshots (the ephemeral ones of `save_weights_and_get_sampling_client` included) are kept in host memory and
handed to its next load, so a sampling client outlives an unload: its next sample reloads the model and finds
its weights (a base-model sampling client needs nothing kept). Scheduling is fair: each `step` gives every
model with work one runner step (one training round and one decode chunk), so work on one model delays
another's next step by at most that much.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import jax

from tx.engine.errors import EXITS, as_request_error
from tx.engine.loop import Completion, Runner
from tx.engine.run_memory import RunMemory, gb, host_memory_bytes
from tx.engine.snapshots import HeldSnapshots
from tx.models.catalog import has_weights, locate_config, locate_model
from tx.protocol import CreateModelRequest, LoadWeightsRequest, ModelInfo, RequestError, SampleRequest, WorkItem
from tx.upload_store import UPLOAD_PREFIX

log = logging.getLogger("tx.engine")
HEADROOM = 0.8  # of device memory for weights: the rest is for caches, activations and the compiler
ROOM_PATIENCE_S = 120.0  # a load waits this long for busy models to finish and make room, then fails


class ModelRunner(Runner, Protocol):
    def live_runs(self) -> int: ...

    def resident_bytes(self) -> int: ...

    def discard(self, future_ids: Sequence[str]) -> None: ...

    def snapshot_count(self) -> int: ...

    def snapshots_to_host(self) -> HeldSnapshots: ...

    def adopt_snapshots(self, held: HeldSnapshots) -> None: ...


Build = Callable[[str, Path], tuple[ModelRunner, ModelInfo]]  # (name, directory) -> a loaded model


@dataclass
class PoolModel:
    key: str
    runner: ModelRunner
    info: ModelInfo
    last_used: float


def default_budget_bytes() -> int:
    """What the accelerators can hold, less headroom; on CPU (no memory stats) half the host's memory."""
    limits = [(d.memory_stats() or {}).get("bytes_limit", 0) for d in jax.local_devices()]
    if all(limits):
        return int(sum(limits) * HEADROOM)
    return int(host_memory_bytes() * 0.5)


class ModelPool:
    """`build(name, directory)` loads a model; `estimate(directory)` is its size in bytes before loading;
    `locate(key)` finds or downloads the directory of a model keyed by a hub name."""

    def __init__(
        self,
        build: Build,
        estimate: Callable[[Path], int],
        budget_bytes: int,
        locate: Callable[[str], Path] = locate_model,
        no_loads: str = "",
        locate_config: Callable[[str], Path] = locate_config,
        memory: RunMemory | None = None,
    ) -> None:
        """`no_loads`: why models may not load on demand (an engine over several processes), or "".
        `locate`: a model's weights (downloading them); `locate_config`: its config alone. `memory`: the
        server's run-state limit, which unloaded models' snapshots keep to (None: they are kept)."""
        self._build, self._estimate, self.budget_bytes, self._locate = build, estimate, budget_bytes, locate
        self._locate_config = locate_config
        self.no_loads = no_loads
        self.models: dict[str, PoolModel] = {}
        self._loaded: dict[str, ModelInfo] = {}  # replaced, never mutated: other threads read it (capabilities)
        self.names: dict[str, str] = {}  # model key -> the name it was first asked for by
        self.waiting: dict[str, list[WorkItem]] = {}  # model key -> items waiting for its load, in order
        self.loading: dict[str, tuple[concurrent.futures.Future, int]] = {}  # key -> (load, bytes reserved)
        self.run_model: dict[str, str] = {}  # run id -> model key
        self.sizes: dict[str, int] = {}  # measured size of every model loaded once: the next estimate
        self.located: dict[str, Path] = {}  # hub-name key -> the directory its weights were downloaded to
        self.fetching: dict[str, concurrent.futures.Future] = {}  # key -> download of its weights
        self.held: dict[str, HeldSnapshots] = {}  # unloaded model key -> its sampler snapshots, in host memory
        self.preloaded: set[str] = set()  # keys of the models named on the command line: no upload unloads them
        self.memory = memory
        self._fetcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tx-fetch")
        self.outbox: list[Completion] = []
        self.routed: dict[str, str] = {}  # future id -> the key of the model whose runner holds it
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tx-load")
        self._room_since: dict[str, float] = {}  # key -> when its load began waiting for busy models' room

    # ---- loading -----------------------------------------------------------------------------------

    def preload(self, name: str, model_dir: Path) -> ModelInfo:
        """Load a model now (server start-up), within the budget."""
        key = str(model_dir)
        self.names.setdefault(key, name)
        if not self._make_room(key, self._size_of(key)):  # nothing is busy at start-up
            raise self._no_room(key, self._size_of(key), self.budget_bytes - self._in_use())
        runner, info = self._build(name, model_dir)
        self.preloaded.add(key)
        return self._add(key, runner, info).info

    def fetch_within_budget(self, name: str, config_dir: Path) -> Path:
        """The directory with the weights of a model named at start-up, downloaded only once its config says it
        fits the memory budget: a hub model was downloaded whole (tens of GB) and then refused."""
        self._check_budget(name, self._estimate(config_dir))
        if not has_weights(config_dir):
            log.info("fetching %s (about %s once loaded)", name, gb(self._estimate(config_dir)))
        return self._locate(name)

    def _size_of(self, key: str) -> int:
        return self.sizes.get(key) or self._estimate(self.located.get(key, Path(key)))

    def _directory(self, key: str) -> Path | None:
        """Where a model's weights are, or None while they still have to be downloaded."""
        return Path(key) if Path(key).is_dir() else self.located.get(key)

    def _add(self, key: str, runner: ModelRunner, info: ModelInfo) -> PoolModel:
        model = PoolModel(key, runner, info, time.monotonic())
        self.sizes[key] = runner.resident_bytes()
        if key in self.held:
            runner.adopt_snapshots(self.held.pop(key))
        self.models[key] = model
        self._loaded = {k: m.info for k, m in self.models.items()}
        log.info("loaded %s (%s; budget %s)", info.base_model, gb(self.sizes[key]), gb(self.budget_bytes))
        return model

    def unload(self, key: str) -> None:
        """Unload an idle model; its sampler snapshots wait in host memory for its next load, those of a model
        whose directory is gone are dropped."""
        self.held[key] = self.models.pop(key).runner.snapshots_to_host()
        for gone in [k for k in self.held if not ((d := self._directory(k)) and d.is_dir())]:
            del self.held[gone]  # its model cannot load again (a deleted upload): nothing will sample them
        self._trim_held()
        self._loaded = {k: m.info for k, m in self.models.items()}
        gc.collect()  # the runner's closures hold its arrays in cycles: free the device memory now
        log.info("unloaded %s to make room", self.names.get(key, key))

    def _trim_held(self) -> None:
        """Unloaded models' snapshots keep to what the runs leave of the run-state limit: those of the model
        unloaded longest ago go first (their sampling clients then fail as an evicted snapshot's do)."""
        room = self.memory.limit_bytes - self.memory.used() if self.memory is not None else None
        while room is not None and self.held and sum(h.nbytes for h in self.held.values()) > room:
            dropped = next(iter(self.held))
            log.info("dropped the sampler snapshots of unloaded %s (host memory)", self.names.get(dropped, dropped))
            del self.held[dropped]

    def _in_use(self) -> int:
        loaded = sum(m.runner.resident_bytes() for m in self.models.values())
        return loaded + sum(reserved for _, reserved in self.loading.values())

    def _evictable(self, keep: str, busy: bool = False) -> list[PoolModel]:
        """The models a load of `keep` may unload: no live runs, no load of their own waiting, not shared with
        every tenant when `keep` is an upload; idle ones (or, with `busy`, those still working)."""
        shared = self.preloaded if self.names.get(keep, "").startswith(UPLOAD_PREFIX) else set()
        found = [
            m
            for m in self.models.values()
            if m.key != keep
            and m.key not in self.waiting
            and m.runner.idle() != busy
            and not m.runner.live_runs()
            and m.key not in shared
        ]
        # Models no sampling client reads go first; a model holding sampler snapshots only if that is not enough.
        return sorted(found, key=lambda m: (m.runner.snapshot_count() > 0, m.last_used))

    def _check_budget(self, key: str, needed: int) -> None:
        """A user error when a model needs more than the whole memory budget."""
        if needed > self.budget_bytes:
            raise RequestError(
                f"model {self.names.get(key, key)!r} needs about {gb(needed)}, more than the memory budget "
                f"{gb(self.budget_bytes)} (--memory-budget-gb)",
                "user",
            )

    def _make_room(self, key: str, needed: int) -> bool:
        """Unload idle models, least recently used first, until `needed` more bytes fit, and say True. False
        (unloading nothing): it fits once models that are busy but could go have finished, so the load waits
        for them (`ROOM_PATIENCE_S` at most). Else a user error naming what holds the budget, nothing unloaded
        (a model was unloaded for a load that then did not fit, and one busy a moment failed the load)."""
        self._check_budget(key, needed)
        free = self.budget_bytes - self._in_use()
        victims: list[PoolModel] = []
        for victim in self._evictable(key):
            if free >= needed:
                break
            victims.append(victim)
            free += victim.runner.resident_bytes()  # what it holds now: its snapshots too, not its load size
        if free < needed:
            draining = sum(m.runner.resident_bytes() for m in self._evictable(key, busy=True))
            draining += sum(reserved for k, (_, reserved) in self.loading.items() if self._may_go_after_load(k))
            waited = time.monotonic() - self._room_since.setdefault(key, time.monotonic())
            if free + draining >= needed and waited < ROOM_PATIENCE_S:
                return False
            self._room_since.pop(key, None)
            busy = free + draining >= needed  # models that could go stayed busy: their traffic never paused
            raise self._no_room(key, needed, self.budget_bytes - self._in_use(), busy)
        self._room_since.pop(key, None)
        for victim in victims:
            self.unload(victim.key)
        return True

    def _may_go_after_load(self, key: str) -> bool:
        """Whether a model being loaded could be unloaded once its parked requests ran: none of them makes a
        run (a live run is never unloaded), and it is not one every tenant shares."""
        makes_runs = any(item.kind in ("create_model", "load_weights") for item in self.waiting.get(key, []))
        return not makes_runs and key not in self.preloaded

    def _no_room(self, key: str, needed: int, free: int, busy: bool = False) -> RequestError:
        held = ", ".join(
            f"{m.info.base_model} {gb(self.sizes[m.key])} ({m.runner.live_runs()} live runs"
            f"{', named on the command line: no upload unloads it' if m.key in self.preloaded else ''})"
            for m in self.models.values()
        )
        return RequestError(
            f"model {self.names.get(key, key)!r} needs about {gb(needed)} but only {gb(free)} of the memory budget "
            f"{gb(self.budget_bytes)} (--memory-budget-gb) is free, and the loaded models that could go "
            f"{f'stayed busy for {ROOM_PATIENCE_S:.0f} s' if busy else 'are not enough'}: {held}",
            "user",
        )

    def _start_loads(self) -> None:
        for key in [k for k in self.waiting if k not in self.loading and k not in self.fetching]:
            if self.no_loads:
                self._fail_waiting(
                    key, RequestError(f"model {self.names[key]!r} is not loaded: {self.no_loads}", "user")
                )
                continue
            directory = self._directory(key)
            if directory is None:
                log.info("fetching %s for %d waiting requests", self.names[key], len(self.waiting[key]))
                self.fetching[key] = self._fetcher.submit(self._fetch, key)
                continue
            try:
                needed = self._size_of(key)
                if not self._make_room(key, needed):
                    continue  # busy models will make room: asked again next step
            except Exception as err:
                self._fail_waiting(key, err)
                continue
            log.info("loading %s for %d waiting requests", self.names[key], len(self.waiting[key]))
            self.loading[key] = (self._loader.submit(self._build, self.names[key], directory), needed)

    def _fetch(self, key: str) -> Path:
        """On the fetcher thread (the hub is network; the engine thread steps every model): the model sized from
        its config alone first (a 470 GB download, then refused, would fill the disk), then its weights."""
        self._check_budget(key, self._estimate(self._locate_config(key)))
        return self._locate(key)

    def _finish_fetches(self) -> None:
        for key, fetch in list(self.fetching.items()):
            if fetch.done():
                del self.fetching[key]
                try:
                    self.located[key] = fetch.result()
                except EXITS:
                    raise
                except BaseException as err:  # a native panic of the fetch too: that model's requests fail
                    self._fail_waiting(key, err)

    def _finish_loads(self) -> None:
        for key, (load, _) in list(self.loading.items()):
            if not load.done():
                continue
            del self.loading[key]
            try:
                runner, info = load.result()
            except EXITS:
                raise
            except BaseException as err:  # a native panic in the build too: that model's requests fail alone
                log.warning("loading %s failed: %s", self.names[key], err, exc_info=True)
                self._fail_waiting(key, err)
                continue
            self._hand_over(self._add(key, runner, info), self.waiting.pop(key))

    def _fail_waiting(self, key: str, err: BaseException) -> None:
        self._room_since.pop(key, None)
        error = as_request_error(err)
        self.outbox += [Completion(item.future_id, error) for item in self.waiting.pop(key, [])]

    # ---- Runner protocol ---------------------------------------------------------------------------

    def submit(self, items: Sequence[WorkItem]) -> None:
        for item in items:
            key = self._route(item)
            model = self.models.get(key) if key is not None else None
            if key is None:
                unknown = RequestError(f"unknown model_id {item.model_id!r}", "user")
                self.outbox.append(Completion(item.future_id, unknown))
            elif model is not None and key not in self.waiting:
                model.last_used = time.monotonic()
                self._hand_over(model, [item])
            else:
                self.waiting.setdefault(key, []).append(item)

    def _route(self, item: WorkItem) -> str | None:
        """The model key of an item; a run's model is learned from the item that creates it."""
        p = item.payload
        if isinstance(p, CreateModelRequest | LoadWeightsRequest | SampleRequest):
            key = p.model_dir or p.base_model
            self.names.setdefault(key, p.base_model)
            if item.kind != "sample" and item.model_id is not None:
                self.run_model[item.model_id] = key
            return key
        run_key = self.run_model.get(str(item.model_id))
        if item.kind == "unload_model":
            self.run_model.pop(str(item.model_id), None)
        return run_key

    def step(self) -> list[Completion]:
        self._finish_fetches()
        self._finish_loads()
        self._start_loads()
        done, self.outbox = self.outbox, []
        worked = False
        for model in list(self.models.values()):  # one bounded step per model with work: fair turns
            if not model.runner.idle():
                model.last_used = time.monotonic()
                done += self._step(model)
                worked = True
        for completion in done:
            self.routed.pop(completion.future_id, None)
        pending = [f for f, _ in self.loading.values()] + list(self.fetching.values())
        if not worked and not done and pending:  # nothing else to do: wait a little for a load
            concurrent.futures.wait(pending, 0.05)
        return done

    def _hand_over(self, model: PoolModel, items: list[WorkItem]) -> None:
        self.routed.update((item.future_id, model.key) for item in items)
        model.runner.submit(items)

    def _step(self, model: PoolModel) -> list[Completion]:
        """One model's step. An error it did not contain fails that model's requests alone: the other
        models' completions of this turn stand (an optim_step already applied must not read as failed)."""
        try:
            return model.runner.step()
        except EXITS:
            raise
        except BaseException as err:
            held = [f for f, key in self.routed.items() if key == model.key]
            log.exception(
                "a step of %s failed; failing its %d requests", self.names.get(model.key, model.key), len(held)
            )
            error = RequestError(f"internal error while executing the request: {type(err).__name__}: {err}", "server")
            model.runner.discard(held)
            return [Completion(future_id, error) for future_id in held]

    def parked(self) -> int:
        """How many submitted requests wait for their model's load or download (held by no runner yet)."""
        return sum(len(items) for items in self.waiting.values())

    def idle(self) -> bool:
        return not self.outbox and not self.waiting and all(m.runner.idle() for m in self.models.values())

    def discard(self, future_ids: Sequence[str]) -> None:
        gone = set(future_ids)
        self.outbox = [c for c in self.outbox if c.future_id not in gone]
        for key, items in list(self.waiting.items()):
            self.waiting[key] = [i for i in items if i.future_id not in gone]
            if not self.waiting[key] and key not in self.loading and key not in self.fetching:
                del self.waiting[key]
                self._room_since.pop(key, None)  # a later load of it waits its own patience
        for model in self.models.values():
            model.runner.discard(future_ids)
        for future_id in gone:
            self.routed.pop(future_id, None)

    def loaded(self) -> dict[str, ModelInfo]:
        """Model directory -> info of every loaded model; safe to call from any thread."""
        return self._loaded

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._fetcher.shutdown(wait=False, cancel_futures=True)
