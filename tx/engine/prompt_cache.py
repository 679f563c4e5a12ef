"""Prefilled prompts kept for reuse: the KV cache of a prompt, keyed by the weights that computed it.

A sampling request whose prompt (all tokens but the last, which the first decode step feeds) was prefilled
recently with the same weights copies that prompt's cache into its decode rows instead of running the model
over it again: repeated evaluation prompts, a GRPO group sent as separate `sample` calls, a client that
retries. The key is (weights version, adapter slot, sampling session for the shared base weights,
prompt tokens); the owner of the weights bumps the version whenever any adapter weight or scale changes, so
an entry never outlives the weights it was computed with, and no tenant hits another's base-model prompt.
An entry is the prompt's decode state as prefill wrote it, one row (`tx.models.cache`: keys and values
[L, 1, P, K, E] cut to the prompt's own length bucket, and for recurrent layers their state at the prompt's
end), held in LRU order within a byte budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from tx.models.cache import HybridCache, KVCache

Entry = KVCache | HybridCache

Key = tuple[Hashable, int, str, tuple[int, ...]]


class PromptCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self._entries: OrderedDict[Key, Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return entry

    def put(self, key: Key, entry: Entry) -> None:
        size = entry.nbytes
        if size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = entry
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
