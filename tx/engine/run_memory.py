"""The server's bound on the memory its LoRA training runs hold.

A LoRA run's state (adapter, gradient accumulators, AdamW moments: four arrays per adapted weight) lives on
the device while the run has a slot and in host memory while it is paged out (`tx.engine.paging`), so the
host must hold every run's state at once in the worst case. `--max-runs` bounds their count, not their
bytes: 256 rank-32 runs of a 0.6B model are about 80 GB, far past a workstation's memory, and the kernel's
out-of-memory killer would end the server for everyone. `RunMemory` counts each run's bytes from its
creation to its unload, across every model of the server (one instance, shared by the pool's runners), and
refuses a new run that would go past the limit with a user error naming it.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from tx.protocol import RequestError

GB = 1e9


def gb(n: int) -> str:
    """A size for people: GB with two decimals, MB below 1 GB (a tiny test model would show as 0.00 GB)."""
    return f"{n / GB:.2f} GB" if n >= GB else f"{n / 1e6:.2f} MB"


def host_memory_bytes() -> int:
    """The machine's physical memory."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def default_limit_bytes() -> int:
    """A quarter of the machine's physical memory (the pool's models may take half of it on a CPU)."""
    return int(host_memory_bytes() * 0.25)


def lora_run_bytes(grads: Any, opt_state: Any) -> int:
    """A LoRA run's state: its adapter and gradient accumulators (alike in shape) and its AdamW state."""
    grad_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(grads))
    return 2 * grad_bytes + sum(int(x.nbytes) for x in jax.tree.leaves(opt_state))


class RunMemory:
    """Bytes of every LoRA run's state by run id, against `limit_bytes` (`--max-run-state-gb`)."""

    def __init__(self, limit_bytes: int | None = None) -> None:
        self.limit_bytes = default_limit_bytes() if limit_bytes is None else limit_bytes
        if self.limit_bytes < 1:
            raise ValueError(f"--max-run-state-gb must be > 0, got {gb(self.limit_bytes)}")
        self.held: dict[str, int] = {}

    def used(self) -> int:
        return sum(self.held.values())

    def admit(self, run_id: str, nbytes: int) -> None:
        """Count `run_id`'s `nbytes`, or raise a user error (nothing counted) if they do not fit."""
        used = self.used() - self.held.get(run_id, 0)
        if used + nbytes > self.limit_bytes:
            raise RequestError(
                f"a new run needs {gb(nbytes)} for its adapter, gradients and AdamW moments, but this "
                f"server's {len(self.held)} LoRA runs already hold {gb(used)} of the "
                f"{gb(self.limit_bytes)} they may use (--max-run-state-gb); unload a run, let an idle "
                "session expire, ask for a lower rank, or restart with a higher limit",
                "user",
            )
        self.held[run_id] = nbytes

    def release(self, run_id: str) -> None:
        self.held.pop(run_id, None)
