"""How many decode rows the sampler's cache may hold, so that no request takes the machine's memory.

The decode cache holds every row's keys and values for every position it may reach: 64 rows (the default
`--decode-rows`) of 2048 positions of Qwen3-0.6B in float32 are 30 GB, more than a 24 GB workstation has,
and an RL step that queues 64 samples of 2000 tokens asks for exactly that. The kernel would end the
server for everyone. So rows are admitted only while the cache they need at the longest final length of
the rows (prompt + max_tokens, bucketed) fits a limit: `--decode-cache-gb`, or by default 45% of the memory
free at that moment plus what the cache already holds (a resize holds the old and the new cache at once).
Rows that do not fit wait for others to finish; one row always runs, unless it could not fit even on an idle
machine (`check_alone`: the flag, or 45% of all the memory; a model with a huge head dimension has a 17 GB
cache row at 1024 positions): that request fails, naming the sizes. An engine over several processes admits
by the flag alone: its processes must decide alike, and each sees its own free memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import psutil

from tx.models.cache import decode_cache
from tx.models.config import ModelConfig
from tx.protocol import RequestError

SHARE_OF_FREE = 0.45


def cache_bytes_of(cfg: ModelConfig, per_layer: bool) -> Callable[[int, int], int]:
    """(rows, length) -> the bytes of the model's decode cache of that shape (traced, never allocated)."""

    def nbytes(rows: int, length: int) -> int:
        shapes = jax.eval_shape(lambda: decode_cache(cfg, rows, length, per_layer))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    return nbytes


def free_bytes(devices: set[jax.Device]) -> int:
    """Free memory over `devices`: their allocators' limits minus use, or the host's when one reports none
    (CPU)."""
    stats = [device.memory_stats() for device in devices]
    if not stats or any(not s or "bytes_limit" not in s for s in stats):
        return int(psutil.virtual_memory().available)
    return sum(int(s["bytes_limit"]) - int(s.get("bytes_in_use", 0)) for s in stats if s)


def total_bytes(devices: set[jax.Device]) -> int:
    """All the memory of `devices`: their allocators' limits, or the host's when one reports none (CPU)."""
    stats = [device.memory_stats() for device in devices]
    if not stats or any(not s or "bytes_limit" not in s for s in stats):
        return int(psutil.virtual_memory().total)
    return sum(int(s["bytes_limit"]) for s in stats if s)


class CacheBudget:
    """`cache_bytes(rows, length)`: the bytes of a decode cache of that shape; `row_buckets`: the row counts
    the sampler compiles for; `limit_bytes`: a fixed limit, or None to follow the free memory."""

    def __init__(
        self, cache_bytes: Callable[[int, int], int], row_buckets: Sequence[int], limit_bytes: int | None
    ) -> None:
        self.cache_bytes = functools.cache(cache_bytes)
        self.row_buckets = tuple(row_buckets)
        self.limit_bytes = limit_bytes

    def row_cap(self, length: int, held_bytes: int) -> int:
        """The most rows (a row bucket, at least the smallest) whose cache of `length` positions fits the
        limit; `held_bytes`, what the sampler's cache holds now, counts as free for it."""
        limit = self.limit()
        if limit is None:
            return self.row_buckets[-1]
        limit += 0 if self.limit_bytes is not None else int(SHARE_OF_FREE * held_bytes)
        fitting = [rows for rows in self.row_buckets if self.cache_bytes(rows, length) <= limit]
        return max(fitting, default=self.row_buckets[0])

    def check_alone(self, length: int) -> None:
        """Refuse (a user error) a request whose smallest cache of `length` positions passes the limit even
        on an idle machine (the flag, or 45% of all the memory: free memory shrinks while other models load,
        and the SDK does not retry a user error): it could never run without taking the machine."""
        if self.limit_bytes is not None:
            limit = self.limit_bytes
        elif jax.process_count() > 1:
            return
        else:
            limit = int(SHARE_OF_FREE * total_bytes(set(jax.local_devices())))
        needed = self.cache_bytes(self.row_buckets[0], length)
        if needed > limit:
            raise RequestError(
                f"a sample of {length} positions needs {needed / 2**30:.2f} GiB of decode cache for this model, "
                f"more than the {limit / 2**30:.2f} GiB it may take (--decode-cache-gb, or 45% of the free "
                "memory); ask for fewer max_tokens or a shorter prompt",
                "user",
            )

    def limit(self) -> int | None:
        """The bytes a cache may take now; None: no limit (several processes and no flag)."""
        if self.limit_bytes is not None:
            return self.limit_bytes
        if jax.process_count() > 1:
            return None
        return int(SHARE_OF_FREE * free_bytes(set(jax.local_devices())))
