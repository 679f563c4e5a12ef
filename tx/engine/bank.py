"""The adapter bank: the one owner of a base model's adapter state.

It holds the stacked device slots (A `[..., S, in, W]`, B `[..., S, W, out]`, fp32 `LoRAA` / `LoRAB`), the
slot table (which run or sampler snapshot holds which slot), each slot's scale row (`alpha / rank` on its
live columns), a version bumped on every write (what prompt caches key on) and the host store of training
runs that are paged out of the device (`HostRun`: adapter weights, gradient accumulators, Adam moments,
step) and of sampler snapshots moved off it (`HostSnapshot`). Nothing else writes adapter arrays: the
trainer, the runner and PEFT loading all go through these methods. Writes donate the arrays they
replace; readers take `arrays` afresh at every call.

The stacks' rank width W follows the adapters on the device, not `--max-lora-rank`: it is the smallest rank
bucket (`tx.lora.select.rank_bucket`: 8, 16, 32, ...) covering every owner in the slot table, so a server
that allows rank 128 holding only rank-8 runs has stacks (and compiled shapes) of a rank-8 server. A slot
claimed at a higher rank widens the stacks first (zero columns appended); a slot given back narrows them
to the owners left (the cut columns are zero: every slot is zero past its own rank). Both are exact, keep
the weights version (the weights are the same), and cost one compile per bucket and program.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tx.engine import train_step as ts
from tx.engine.run_memory import RunMemory
from tx.gather import packed_to_host
from tx.lora import adapters
from tx.lora.params import AdapterRoles, LoRAParam
from tx.lora.peft import AdapterConfig, AdapterWeights
from tx.lora.select import rank_bucket
from tx.lora.slots import DEFAULT_ALPHA, OwnerKind, SlotInfo, SlotTable
from tx.lora.targets import ALL_TARGETS

Flat = ts.Flat


@dataclasses.dataclass
class HostRun:
    """A paged-out training run in host memory: exactly what its device state was (numpy copies)."""

    params: dict[tuple[str, ...], np.ndarray]  # the run's adapter [..., in, rank] / [..., rank, out]
    grads: dict[tuple[str, ...], np.ndarray]  # accumulated since the last optim_step
    opt_state: Any  # the AdamW state, its leaves as numpy arrays

    @property
    def nbytes(self) -> int:
        return sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves((self.params, self.grads, self.opt_state)))


@dataclasses.dataclass
class HostSnapshot:
    """A sampler snapshot moved off the device: its slot's arrays at its own rank, scale row and entry."""

    info: SlotInfo
    arrays: dict[tuple[str, ...], np.ndarray]  # [..., in, rank] / [..., rank, out]
    scale: np.ndarray  # [max rank]
    tenant: str = ""  # the owner id of the key that made it (`AdapterBank.tenants`)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())


class AdapterBank:
    """Adapter slots of one model; `max_runs` bounds the training runs on the device and in host memory,
    `max_rank` the rank of any adapter (`--max-lora-rank`; default: the stacks' width as built)."""

    def __init__(
        self, lora: nnx.State, max_runs: int = 256, max_rank: int | None = None, memory: RunMemory | None = None
    ) -> None:
        if max_runs < 1:
            raise ValueError(f"--max-runs must be >= 1, got {max_runs}")
        # Committed copies: the bank updates them in place (donated buffers), and an uncommitted input would
        # be another compile key for every program that reads them.
        self._arrays = {p: jax.device_put(jnp.array(v, copy=True), v.sharding) for p, v in ts.flat(lora).items()}
        # Each stack's placement, spelled as built: every array the bank holds carries exactly this sharding.
        self._placement = {p: x.sharding for p, x in self._arrays.items()}
        self._vars = [(tuple(str(k) for k in path), var) for path, var in nnx.to_flat_state(lora)]
        self.roles = AdapterRoles.of(lora)
        if not self.roles.a:
            raise RuntimeError("the model was built without LoRA slots")
        some_a = self._arrays[min(self.roles.a)]
        S, R = some_a.shape[some_a.ndim - 3], max_rank or some_a.shape[-1]
        self.slots = SlotTable(S - 1, R)
        self.scale = np.zeros((S, R), np.float32)  # [S, R] per-slot alpha/rank on live columns
        self.version = 0  # bumped on every adapter write
        self.max_runs = max_runs
        self.host: dict[str, HostRun] = {}  # paged-out runs by run id
        # Snapshots moved off the device, least recently used first; at most `max_runs` are kept, and no more
        # bytes than the runs' state leaves of `memory`'s limit (older ones are gone, as evicted snapshots were
        # before: a named one reloads from its checkpoint).
        self.host_snapshots: OrderedDict[str, HostSnapshot] = OrderedDict()
        self.tenants: dict[str, str] = {}  # snapshot id -> the owner id of the key that made it ("" unknown)
        self.memory = memory or RunMemory()  # the server's, shared by its models' banks; alone: its own
        self._fit()

    @classmethod
    def of(
        cls, model: nnx.Module, max_runs: int = 256, max_rank: int | None = None, memory: RunMemory | None = None
    ) -> AdapterBank:
        return cls(nnx.state(model, LoRAParam), max_runs, max_rank, memory)

    @property
    def arrays(self) -> Flat:
        """The stacked adapter weights {path: [..., S, in, W] / [..., S, W, out]}; read afresh at each use."""
        return self._arrays

    @property
    def max_rank(self) -> int:
        """The largest adapter rank this bank takes (`--max-lora-rank`); the stacks are often narrower."""
        return int(self.scale.shape[1])

    @property
    def stack_rank(self) -> int:
        """W, the rank width of the stacked device arrays: the bucket covering the adapters on the device."""
        return self.roles.rank_of(min(self.roles.a), self._arrays[min(self.roles.a)])

    def device_bytes(self) -> int:
        return sum(int(x.nbytes) for x in self._arrays.values())

    # ---- slot table -------------------------------------------------------------------------------

    def allocate(
        self,
        owner: str,
        kind: OwnerKind,
        rank: int,
        alpha: float = DEFAULT_ALPHA,
        targets: frozenset[str] = ALL_TARGETS,
    ) -> SlotInfo:
        """A slot for `owner` (`SlotTable.allocate`), the stacks widened first if `rank` needs it; a widening
        that raises (a device out of memory) leaves no slot held: the owner had kept one it could not use,
        and every later request of it failed ("already holds LoRA slot")."""
        info = self.slots.allocate(owner, kind, rank, alpha, targets)
        try:
            self._fit()
        except BaseException:
            self.slots.free(owner)
            raise
        return info

    def release(self, owner: str) -> SlotInfo:
        """Give `owner`'s slot back (clear it before reuse); the stacks narrow to the owners left."""
        info = self.slots.free(owner)
        self._fit()
        return info

    def _fit(self, at_least: int = 1) -> None:
        """Stacks exactly as wide as the bucket of the widest owner (and of `at_least`, a rank being written)."""
        widest = max((info.rank for info in self.slots), default=1)
        width = rank_bucket(max(widest, at_least), self.max_rank)
        if width != self.stack_rank:
            resized = ts.resize_stacks(self._arrays, width, self.roles)
            # Placed as before (the rank axis is never sharded): a new placement would be a new compile key.
            self._arrays = {p: jax.device_put(x, self._placement[p]) for p, x in resized.items()}

    def _cover(self, rank: int) -> None:
        """Widen (never narrow) the stacks to hold `rank` columns: a write to a slot the table may not list."""
        if rank > self.stack_rank:
            self._fit(rank)

    def weights_version(self) -> tuple[int, bytes]:
        """Adapter weights and scales: all a prefilled prompt depends on besides the base weights."""
        return self.version, self.scale.tobytes()

    # ---- slot writes ------------------------------------------------------------------------------

    def _replace(self, arrays: Flat) -> None:
        """Take a program's output stacks. A program may spell a stack's placement anew (`P(None, None)` for
        `P()`: the same layout, but another compile key for each program that reads it), so each is
        re-labelled with the bank's own spelling."""
        self._arrays = {p: self._placed(p, x) for p, x in arrays.items()}
        self.version += 1

    def _placed(self, path: tuple[str, ...], x: jax.Array) -> jax.Array:
        return x if x.sharding == self._placement[path] else jax.device_put(x, self._placement[path])

    def view(self) -> nnx.State:
        """The adapter weights as a typed nnx State (logical-axis metadata) for `tx.lora.adapters`."""
        return nnx.from_flat_state([(path, var.replace(self._arrays[path])) for path, var in self._vars])

    def _adopt(self, state: nnx.State) -> None:
        """Take the arrays of a State returned by `tx.lora.adapters` (which consumed the previous ones)."""
        arrays = dict(self._arrays)
        for path, var in nnx.to_flat_state(state):
            arrays[tuple(str(k) for k in path)] = var.get_value()
        self._replace(arrays)

    def set_scale(self, slot: int, rank: int, scaling: float) -> None:
        self.scale[slot] = np.where(np.arange(self.max_rank) < rank, scaling, 0.0)

    def init(self, slot: int, rank: int, alpha: float, targets: frozenset[str], seed: int) -> None:
        """A fresh adapter in `slot`, initialised as PEFT does (so training starts at the base model)."""
        self._cover(rank)
        self._adopt(adapters.init_slot(self.view(), slot, rank, targets, seed))
        self.set_scale(slot, rank, alpha / rank)

    def clear(self, slot: int) -> None:
        """Zero `slot` (weights and scale), so a reused slot starts as the base model."""
        S = next(iter(self._arrays.values())).shape[-3]
        if not 0 < slot < S:
            raise ValueError(f"LoRA slot {slot} is out of range: slots 1..{S - 1} hold adapters (0 is the base model)")
        self._replace(ts.clear_slot_params(self._arrays, jnp.int32(slot)))
        self.scale[slot] = 0.0

    def read(self, slot: int, like: Flat) -> Flat:
        """Slot `slot` cut to the shapes of `like` (a run's own adapter: its targets, its rank)."""
        return ts.read_slot_params(self._arrays, jnp.int32(slot), like, self.roles)

    def write(self, slot: int, params: Flat) -> None:
        """Put a run's adapter `params` into `slot`, zero-padded to the stacked rank; the slot's other modules
        are zeroed, so it holds that adapter alone (no separate clear needed)."""
        self._cover(max((self.roles.rank_of(p, x) for p, x in params.items()), default=1))
        self._replace(ts.write_slot_params(self._arrays, jnp.int32(slot), params, self.roles))

    def copy(self, src: int, dst: int, params: Flat) -> None:
        """Slot `dst` becomes a copy of `params` (the adapter in `src`) with `src`'s scale (a sampler snapshot)."""
        self.write(dst, params)
        self.scale[dst] = self.scale[src]

    def read_peft(self, slot: int, rank: int, targets: frozenset[str], layer_of: adapters.LayerOf) -> AdapterWeights:
        return adapters.read_slot(self.view(), slot, rank, targets, layer_of)

    def write_peft(self, slot: int, config: AdapterConfig, weights: AdapterWeights, layer_of: adapters.LayerOf) -> None:
        self._cover(config.rank)
        self._adopt(adapters.write_slot(self.view(), slot, config, weights, layer_of))
        self.set_scale(slot, config.rank, config.scaling)

    def stash_snapshot(self, owner: str) -> HostSnapshot:
        """Move sampler snapshot `owner` from its device slot into host memory, exactly; frees the slot."""
        info = self.slots.lookup(owner)
        host = self.host_snapshots[owner] = self._host_copy(info)
        self.clear(info.slot)
        self.release(owner)
        self.trim_snapshots()
        return host

    def keep_run(self, run_id: str, host: HostRun) -> HostRun:
        """Hold a paged-out run's copies (the trainer made them and releases its slot)."""
        self.host[run_id] = host
        return host

    def take_run(self, run_id: str) -> HostRun:
        """A paged-out run's copies, removed from the store (the trainer is paging it back in)."""
        return self.host.pop(run_id)

    def forget_run(self, run_id: str) -> None:
        """Drop a paged-out run's copies (the run is unloaded)."""
        self.host.pop(run_id, None)

    def forget_snapshot(self, owner: str) -> None:
        """Drop a stashed snapshot (new weights replace it)."""
        self.host_snapshots.pop(owner, None)

    def _host_copy(self, info: SlotInfo) -> HostSnapshot:
        """The slot's arrays at the owner's own rank (restorable at any stack width), scale row and entry."""
        cut = ts.slot_at_rank(self._arrays, jnp.int32(info.slot), info.rank, self.roles)
        return HostSnapshot(info, packed_to_host(cut), self.scale[info.slot].copy(), self.tenants.get(info.owner, ""))

    def trim_snapshots(self) -> None:
        """Drop host snapshots past `max_runs` of them, or past the bytes the runs' state leaves of the memory
        limit (an RL loop's ephemeral saves of a large adapter, 256 of them kept, would otherwise take tens of
        GB of host memory): each time the least recently used of the tenant whose snapshots hold the most
        bytes. Dropped in plain LRU order, one tenant's stream of saves evicted every other tenant's sampling
        client that had been idle a while, for good when it was an ephemeral one (no files to reload)."""
        held = sum(h.nbytes for h in self.host_snapshots.values())
        room = self.memory.limit_bytes - self.memory.used()
        while self.host_snapshots and (len(self.host_snapshots) > self.max_runs or held > room):
            held -= self.host_snapshots.pop(self._trim_victim()).nbytes
        self.tenants = {s: t for s, t in self.tenants.items() if s in self.host_snapshots or s in self.slots}

    def _trim_victim(self) -> str:
        by_tenant: dict[str, int] = {}
        for host in self.host_snapshots.values():
            by_tenant[host.tenant] = by_tenant.get(host.tenant, 0) + host.nbytes
        biggest = max(by_tenant, key=lambda tenant: by_tenant[tenant])
        return next(s for s, host in self.host_snapshots.items() if host.tenant == biggest)

    def snapshots_on_host(self) -> OrderedDict[str, HostSnapshot]:
        """Every sampler snapshot as a host copy (those on the device copied, not moved; the stashed ones first):
        what the model's next load takes back (`adopt_snapshots`) when the pool unloads this one."""
        on_device = [info for info in self.slots if info.kind == "sampler"]
        return OrderedDict([*self.host_snapshots.items(), *((i.owner, self._host_copy(i)) for i in on_device)])

    def adopt_snapshots(self, held: OrderedDict[str, HostSnapshot]) -> None:
        """Take the snapshots of a previous load of this model into the host store (sampled: back on the device)."""
        self.host_snapshots.update(held)
        self.trim_snapshots()

    def restore_snapshot(self, owner: str, slot: int) -> None:
        """Write a stashed snapshot back into `slot` (allocated to it) and forget the host copy."""
        host = self.host_snapshots[owner]  # dropped only once written: a failed write leaves it on the host
        self.write(slot, {p: jnp.asarray(a) for p, a in host.arrays.items()})
        del self.host_snapshots[owner]
        self.scale[slot] = host.scale
        self.tenants[owner] = host.tenant

    def targets(self) -> frozenset[str]:
        """The short module names this model carries adapters for."""
        return adapters.adapter_targets(self.view())
