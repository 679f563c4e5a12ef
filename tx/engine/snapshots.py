"""Sampler snapshots of full fine-tuning runs, and every snapshot of a model while the model is unloaded.

A full fine-tuning snapshot is a whole weight set with a `Sampler` of its own (sharing the base sampler's
compiled programs). At most `max_kept` stay on the device, least recently used first to go, never one being
sampled (a save or sample that needs another copy while all of them are waits); a named one evicted this
way reloads from its checkpoint on its next use, an ephemeral one is gone.

When the pool unloads an idle model to make room, its snapshots would go with it and the sampling clients
made from them would fail. So the runner hands them over as `HeldSnapshots` (host copies, bit for bit: the
adapter bank's `HostSnapshot`s and each full snapshot's weights with their shardings) and the model's next
load takes them back; each returns to the device when it is next sampled, as a paged-out snapshot does.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Callable

import jax
import numpy as np

from tx.engine.bank import HostSnapshot
from tx.engine.sampler import Sampler
from tx.engine.trainer import Flat
from tx.gather import tree_to_host
from tx.lora.slots import SlotsExhausted
from tx.protocol import RequestError

SamplerFactory = Callable[[Callable[[], Flat]], Sampler]


@dataclasses.dataclass
class HostWeights:
    """A full weight set in host memory, and where each array lived on the device."""

    arrays: dict[tuple[str, ...], np.ndarray]
    shardings: dict[tuple[str, ...], jax.sharding.Sharding]

    @classmethod
    def of(cls, weights: Flat) -> HostWeights:
        return cls(tree_to_host(weights), {p: w.sharding for p, w in weights.items()})

    def on_device(self) -> Flat:
        return {p: jax.device_put(a, self.shardings[p]) for p, a in self.arrays.items()}


@dataclasses.dataclass
class HeldSnapshots:
    """Every sampler snapshot of an unloaded model, in host memory until its next load."""

    lora: OrderedDict[str, HostSnapshot]  # least recently used first
    full: dict[str, HostWeights]

    @property
    def nbytes(self) -> int:
        full = sum(int(a.nbytes) for weights in self.full.values() for a in weights.arrays.values())
        return sum(h.nbytes for h in self.lora.values()) + full


class FullCopiesBusy(SlotsExhausted):
    """Every full fine-tuning copy kept is being sampled: the save or sample that needs another waits."""


class FullSnapshots:
    """Full fine-tuning snapshots by snapshot id; `make_sampler(get_weights)` builds a sampler over one (None:
    this model cannot sample full snapshots)."""

    def __init__(self, make_sampler: SamplerFactory | None, max_kept: int = 2) -> None:
        self.make_sampler, self.max_kept = make_sampler, max_kept
        self._device: dict[str, tuple[Sampler, Flat]] = {}  # least recently used first
        self._host: dict[str, HostWeights] = {}  # held over an unload of the model, back on their next use
        self._retired = itertools.count()  # names for copies replaced while being sampled

    def __contains__(self, snapshot_id: object) -> bool:
        return snapshot_id in self._device or snapshot_id in self._host

    def samplers(self) -> list[Sampler]:
        return [sampler for sampler, _ in self._device.values()]

    def use(self, snapshot_id: str) -> Sampler | None:
        """The sampler of `snapshot_id` (back on the device if it was held), now the most recently used."""
        held = self._host.get(snapshot_id)
        if held is not None:  # `add` drops the host copy once it is back (a device out of memory keeps it)
            self.check_room(snapshot_id)  # before the copy: a sample that must wait retries every step
            self.add(snapshot_id, held.on_device())
        entry = self._device.pop(snapshot_id, None)
        if entry is None:
            return None
        self._device[snapshot_id] = entry
        return entry[0]

    def check_room(self, snapshot_id: str) -> None:
        """Raise `SlotsExhausted` (the request waits for a later round) when `snapshot_id` would be a device
        copy beyond `max_kept` because every kept one is being sampled: each is a whole weight set, and each
        busy one adds a decode chunk to every engine step."""
        busy = sum(not sampler.idle() for sid, (sampler, _) in self._device.items() if sid != snapshot_id)
        if snapshot_id not in self._device and busy >= self.max_kept:
            raise FullCopiesBusy(f"all {self.max_kept} full fine-tuning snapshots kept are being sampled")

    def add(self, snapshot_id: str, weights: Flat) -> None:
        """Sample `weights` as `snapshot_id` (replacing an idle snapshot of that id), evicting beyond `max_kept`."""
        if self.make_sampler is None:
            raise RequestError("this server cannot sample full fine-tuning snapshots", "user")
        self.check_room(snapshot_id)
        old = self._device.pop(snapshot_id, None)
        if old is not None and not old[0].idle():  # its queued samples finish on it; it goes once idle
            self._device[f"{snapshot_id}#retired-{next(self._retired)}"] = old
        self._host.pop(snapshot_id, None)
        self._device[snapshot_id] = (self.make_sampler(lambda: weights), weights)
        # Each holds a whole copy of the weights: keep the most recently used few, never one being sampled.
        idle = [sid for sid, (sampler, _) in self._device.items() if sid != snapshot_id and sampler.idle()]
        for sid in idle[: max(len(self._device) - self.max_kept, 0)]:
            del self._device[sid]

    def drop(self, snapshot_id: str) -> None:
        """Forget `snapshot_id`'s weights (a save whose files failed): its next sample reads its checkpoint."""
        self._device.pop(snapshot_id, None)
        self._host.pop(snapshot_id, None)

    def __len__(self) -> int:
        return len(self._device) + len(self._host)

    def to_host(self) -> dict[str, HostWeights]:
        """Host copies of the `max_kept` most recently used snapshots, for the model's next load (the pool is
        unloading this one). Older ones go as an evicted one does (a named one reloads from its checkpoint):
        every one was kept before, so each unload and reload of a model that saved new snapshots in between
        held another whole weight set in host memory, without bound."""
        on_device = [sid for sid in self._device if "#retired-" not in sid]
        newest = [*self._host, *on_device][-self.max_kept :] if self.max_kept else []
        return {sid: self._host[sid] if sid in self._host else HostWeights.of(self._device[sid][1]) for sid in newest}

    def adopt(self, held: dict[str, HostWeights]) -> None:
        self._host.update(held)
