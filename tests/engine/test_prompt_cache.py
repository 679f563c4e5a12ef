"""The prompt cache's LRU bookkeeping within its byte budget (no model: entries are plain host arrays)."""

import numpy as np

from tx.engine.prompt_cache import PromptCache
from tx.models.causal_lm import KVCache


def entry(positions: int) -> KVCache:
    """An [L=1, 1, P, K=1, E=4] float32 entry: 16 * P bytes for keys, as many for values."""
    return KVCache(np.zeros((1, 1, positions, 1, 4), np.float32), np.zeros((1, 1, positions, 1, 4), np.float32))


def key(n: int) -> tuple:
    return ("v1", 0, "", (n,))


def test_entries_leave_in_least_recently_used_order_within_the_byte_budget() -> None:
    cache = PromptCache(max_bytes=3 * 32)  # three one-position entries
    for n in range(3):
        cache.put(key(n), entry(1))
    assert len(cache) == 3 and cache.bytes == 96
    assert cache.get(key(0)) is not None  # now the most recently used
    cache.put(key(3), entry(1))  # over budget: the least recently used (1) goes
    assert cache.get(key(1)) is None
    assert [cache.get(key(n)) is not None for n in (0, 2, 3)] == [True, True, True]
    assert cache.hits == 4 and cache.bytes == 96
    cache.put(key(4), entry(2))  # 64 bytes: two entries make room
    assert len(cache) == 2 and cache.bytes == 96
    assert cache.get(key(3)) is not None and cache.get(key(4)) is not None


def test_an_entry_over_the_budget_or_already_held_changes_nothing() -> None:
    cache = PromptCache(max_bytes=64)
    cache.put(key(0), entry(2))  # exactly the budget: kept
    assert len(cache) == 1 and cache.bytes == 64
    cache.put(key(1), entry(3))  # larger than the whole budget: not stored, nothing evicted for it
    assert cache.get(key(1)) is None and cache.get(key(0)) is not None and cache.bytes == 64
    first = cache.get(key(0))
    cache.put(key(0), entry(2))  # the same key again: the first entry stays, counted once
    assert cache.get(key(0)) is first and cache.bytes == 64
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0 and cache.get(key(0)) is None
    assert PromptCache(0).get(key(0)) is None
