"""Host-side table of adapter slots: which owner holds which device slot, at what rank, alpha and targets.

An owner is a training run id or a sampler snapshot id (plain strings, unique across both kinds). The
table hands out slots `1..max_adapters` of the stacked LoRA arrays; slot 0 is the base model and is
never allocated, which is why `LoRASpec.slots == max_adapters + 1`. It holds no device memory: the
engine writes the slot's arrays (`tx.lora.adapters`) and feeds `scale_table()` to `LoRARows.scale`,
so a row's rank and scaling come from here. The table tracks every owner's last use and names the least
recently used one as an eviction victim: a sampler snapshot (a cached copy, rebuilt from disk if it was
saved) or, where the engine pages runs to host memory (`tx.engine.bank`), an idle training run. Limits are
server flags, and every error names the flag to raise.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from typing import Literal

import numpy as np

from tx.lora.targets import ALL_TARGETS, ATTN_TARGETS, MLP_TARGETS, UNEMBED_TARGETS
from tx.protocol import DEFAULT_LORA_ALPHA

# "retired": a sampler snapshot replaced under its name while samples were still reading it; its slot serves
# those samples and goes (without a host copy) once a slot is needed.
OwnerKind = Literal["run", "sampler", "retired"]

DEFAULT_ALPHA = DEFAULT_LORA_ALPHA  # the one default, `tx.protocol`'s


class SlotsExhausted(RuntimeError):
    """Every adapter slot is held; the message tells the operator which flag raises the limit."""


class ReadSlotsBusy(SlotsExhausted):
    """Sampling already reads every adapter slot it may (all but one): the sample waits its turn."""


def targets_from_flags(train_attn: bool, train_mlp: bool, train_unembed: bool) -> frozenset[str]:
    """The SDK's `train_attn/train_mlp/train_unembed` flags as the set of short module names to adapt."""
    targets = (
        (ATTN_TARGETS if train_attn else frozenset())
        | (MLP_TARGETS if train_mlp else frozenset())
        | (UNEMBED_TARGETS if train_unembed else frozenset())
    )
    if not targets:
        raise ValueError("at least one of train_attn, train_mlp, train_unembed must be true")
    return targets


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """One allocated slot and the adapter hyper-parameters its rows are computed with."""

    slot: int
    owner: str
    kind: OwnerKind
    rank: int
    alpha: float = DEFAULT_ALPHA
    targets: frozenset[str] = ALL_TARGETS
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        """PEFT's scaling: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


class SlotTable:
    """Owner id <-> slot, with allocation, release, lookup, LRU order for sampler slots and the scale table."""

    def __init__(self, max_adapters: int, max_rank: int) -> None:
        if max_adapters < 1:
            raise ValueError(f"--max-lora-adapters must be >= 1, got {max_adapters}")
        if max_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {max_rank}")
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self._by_owner: dict[str, SlotInfo] = {}
        self._by_slot: dict[int, SlotInfo] = {}
        # Monotonic use stamps rather than wall time: ordering is all the LRU needs, and it is deterministic.
        self._clock = itertools.count()
        self._last_used: dict[str, int] = {}

    @property
    def slots(self) -> int:
        """S, the length of the stacked slot axis (adapters plus the base-model slot 0)."""
        return self.max_adapters + 1

    def allocate(
        self,
        owner: str,
        kind: OwnerKind,
        rank: int,
        alpha: float = DEFAULT_ALPHA,
        targets: frozenset[str] = ALL_TARGETS,
        use_rslora: bool = False,
    ) -> SlotInfo:
        """Give `owner` the lowest free slot; the caller then writes or initialises that slot's weights."""
        if owner in self._by_owner:
            raise ValueError(f"{owner!r} already holds LoRA slot {self._by_owner[owner].slot}")
        self._check_adapter(rank, targets)
        free = next((s for s in range(1, self.slots) if s not in self._by_slot), None)
        if free is None:
            raise SlotsExhausted(self._exhausted_message())
        info = SlotInfo(free, owner, kind, rank, float(alpha), frozenset(targets), use_rslora)
        self._by_owner[owner] = self._by_slot[free] = info
        self.touch(owner)
        return info

    def free(self, owner: str) -> SlotInfo:
        """Release `owner`'s slot (the engine should clear its weights before the slot is reused)."""
        info = self.lookup(owner)
        del self._by_owner[owner], self._by_slot[info.slot], self._last_used[owner]
        return info

    def retire(self, owner: str) -> str:
        """Move sampler snapshot `owner` off its name, keeping its slot (queued samples read it): the name is
        free for new weights. Returns the slot's new owner name, which no request uses."""
        info = self.lookup(owner)
        retired = dataclasses.replace(info, owner=f"{owner}#retired-{info.slot}", kind="retired")
        del self._by_owner[owner]
        self._by_owner[retired.owner] = self._by_slot[info.slot] = retired
        self._last_used[retired.owner] = self._last_used.pop(owner)
        return retired.owner

    def lookup(self, owner: str) -> SlotInfo:
        info = self._by_owner.get(owner)
        if info is None:
            raise KeyError(f"{owner!r} holds no LoRA slot")
        return info

    def get(self, owner: str) -> SlotInfo | None:
        return self._by_owner.get(owner)

    def owner_of(self, slot: int) -> SlotInfo | None:
        return self._by_slot.get(slot)

    def __contains__(self, owner: object) -> bool:
        return owner in self._by_owner

    def __len__(self) -> int:
        return len(self._by_owner)

    def __iter__(self) -> Iterator[SlotInfo]:
        return iter(sorted(self._by_slot.values(), key=lambda info: info.slot))

    def touch(self, owner: str) -> None:
        """Mark `owner` as just used (sampling from a snapshot keeps it cached)."""
        self.lookup(owner)
        self._last_used[owner] = next(self._clock)

    def eviction_victim(
        self, protect: frozenset[str] = frozenset(), kinds: frozenset[OwnerKind] = frozenset({"sampler"})
    ) -> str | None:
        """The least recently used owner of one of `kinds` not in `protect` (e.g. those in the running batch),
        if any: sampler snapshots by default (cached copies); training runs too where the engine can page them
        out to host memory."""
        candidates = [o for o, info in self._by_owner.items() if info.kind in kinds and o not in protect]
        return min(candidates, key=self._last_used.__getitem__, default=None)

    def scale_table(self, max_rank: int | None = None) -> np.ndarray:
        """[S, R] float32 for `LoRARows.scale`: each slot's scaling on its first `rank` columns, zero elsewhere."""
        R = self.max_rank if max_rank is None else max_rank
        table = np.zeros((self.slots, R), np.float32)
        for info in self._by_slot.values():
            table[info.slot, : info.rank] = info.scaling
        return table

    def _check_adapter(self, rank: int, targets: frozenset[str]) -> None:
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        if rank > self.max_rank:
            raise ValueError(
                f"LoRA rank {rank} is above this server's limit of {self.max_rank}; "
                f"restart with --max-lora-rank {rank} (or more) to allow it"
            )
        unknown = sorted(set(targets) - ALL_TARGETS)
        if unknown or not targets:
            raise ValueError(f"LoRA targets must be a non-empty subset of {sorted(ALL_TARGETS)}, got {sorted(targets)}")

    def _exhausted_message(self) -> str:
        runs = sum(info.kind == "run" for info in self._by_owner.values())
        samplers = len(self._by_owner) - runs
        return (
            f"all {self.max_adapters} LoRA slots are in use ({runs} runs, {samplers} sampler snapshots); "
            f"restart with --max-lora-adapters {2 * self.max_adapters} to raise the limit"
        )
