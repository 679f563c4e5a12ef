"""A training program is checked against the memory free before it first runs at a shape.

One micro-batch of the default 8192 tokens through Qwen3-0.6B keeps about 20 GiB of activations for its
backward pass: on a 24 GB machine's CPU the kernel's out-of-memory killer would end the server for every
tenant (an accelerator raises an error instead, after the allocation fails). So the forward and gradient
programs are lowered and compiled ahead of their first call at each argument shape (the call then reuses
that compile), and the bytes XLA assigned them (temporaries and outputs, per device) are compared with the
memory free at each call until it has run once: a program that does not fit raises `ProgramTooLarge` before
anything runs, and the trainer runs its batch in smaller pieces (`Trainer`), or fails the request when one
row alone does not fit. An engine over several processes runs unchecked.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax

from tx.engine.cache_budget import free_bytes
from tx.engine.run_memory import gb

SHARE_OF_FREE = 0.9  # of the memory free at the call


class _LastRun:
    """What the last checked program to run took on a CPU: the process keeps that memory (it is not free to
    the OS) until another program runs, which reuses it (Qwen3-0.6B: RSS 3 -> 14 GB after a 4096-token row,
    back to 8 GB once a 1024-token row ran). It counts as free for the next program."""

    held = 0


class ProgramTooLarge(Exception):
    def __init__(self, need: int, free: int) -> None:
        super().__init__(f"the program needs {gb(need)} of temporaries and outputs, {gb(free)} is free")
        self.need, self.free = need, free


class MemoryCheck:
    """The bytes each argument signature's compiled program needs, and the check against free memory."""

    def __init__(self) -> None:
        self._need: dict[Hashable, int] = {}
        self._ran: set[Hashable] = set()
        self._held: dict[Hashable, int] = {}  # what each program's run leaves with the process (CPU only)

    def __call__(self, jitted: Any, args: tuple, kwargs: dict) -> Hashable:
        """Raise `ProgramTooLarge` when `jitted(*args, **kwargs)` would not fit the memory free now; else the
        call's key, for `ran`. A program that has run fits from then on: its buffers stay with the process
        for its next run (on CPU the memory the first run took is not given back as free). Not with several
        processes: each sees its own free memory, and they must decide alike (they step in lockstep)."""
        if jax.process_count() > 1:
            return None
        leaves, tree = jax.tree.flatten((args, kwargs))
        arrays = [x for x in leaves if isinstance(x, jax.Array)]
        key = (tree, tuple((x.shape, x.dtype) for x in arrays))
        if key in self._ran:
            return key
        need = self._need.get(key)
        if need is None:
            need = self._need[key] = _assigned_bytes(jitted.lower(*args, **kwargs).compile())
        devices: set[jax.Device] = arrays[0].sharding.device_set if arrays else set(jax.local_devices())
        total, free = _total_need(need, devices), free_bytes(devices) + _LastRun.held
        self._held[key] = total if all(str(device.platform) == "cpu" for device in devices) else 0
        if total > SHARE_OF_FREE * free:
            raise ProgramTooLarge(total, free)
        return key

    def ran(self, key: Hashable) -> None:
        self._ran.add(key)
        _LastRun.held = self._held.get(key, 0)


def _assigned_bytes(compiled: Any) -> int:
    """Per device: the temporaries and outputs XLA's buffer assignment gives the program (0: not reported)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return 0
    return int(analysis.temp_size_in_bytes) + int(analysis.output_size_in_bytes) - int(analysis.alias_size_in_bytes)


def _total_need(per_device: int, devices: set[jax.Device]) -> int:
    """What the devices' shares come to against `free_bytes(devices)`: host memory holds every CPU device's."""
    return per_device * len(devices)
