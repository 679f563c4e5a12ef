"""Decode state, one form per kind of layer, with the row operations a continuous-batching sampler needs.

A decode cache holds B rows. Attention layers keep keys and values per position (`KVCache` stacked over
layers [L, B, S, K, E], or `LayerCache`, one buffer per layer); recurrent layers (Qwen3.5's Gated
DeltaNet) keep a fixed-size state per row (`LinearState`). `HybridCache` holds both. Every form answers
the same operations, so the sampler never asks which model it runs:

- `take(index, length)`: rows `index` [B'], cut or zero-padded to `length` positions (a resize);
- `insert(fresh, source)`: decode row b receives row `source[b]` of a prefilled cache at its head
  (`source[b] < 0`: the row keeps what it has);
- `head(row, length)`: one row's first `length` positions as a prefill-form cache (a prompt-cache entry);
- `clear(new)`: rows given to a new occupant start from nothing. Attention rows need no clearing: a row
  gives the positions it did not write weight 0, and every write stores finite values (`storable`), so
  0 times what a previous occupant left is 0 (a stored inf or NaN made it NaN); recurrent state does
  need clearing (`stateful`).

Dimension letters: L layers, B decode rows, N prefill rows, S/P positions, K kv heads, E head dim,
W conv kernel, C conv channels, H value heads, M value head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tx.models.config import ModelConfig


def storable(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`x` as the cache stores it: in `dtype`, its non-finite values (a row whose adapter overflowed, a
    float32 value past bfloat16's range) as 0. A later occupant of the row reads every position with
    weight 0 past its own, and 0 * inf or 0 * NaN is NaN: the row's own output is not finite either way."""
    stored = x.astype(dtype)
    return jnp.where(jnp.isfinite(stored), stored, jnp.zeros((), dtype))


def copy_rows(dst: jax.Array, src: jax.Array, source_B: jax.Array, axis: int | None) -> jax.Array:
    """dst [B, ...] rows get src [N, ...] row `source[b]`: at the head of their position `axis` (the first
    P of S), or whole when `axis` is None; rows with source < 0 keep theirs."""
    rows = jnp.take(src, jnp.maximum(source_B, 0), axis=0).astype(dst.dtype)
    keep = (source_B < 0).reshape(-1, *(1,) * (dst.ndim - 1))
    if axis is None:
        return jnp.where(keep, dst, rows)
    P = src.shape[axis]
    head = jnp.where(keep, jax.lax.slice_in_dim(dst, 0, P, axis=axis), rows)
    return jax.lax.dynamic_update_slice_in_dim(dst, head, 0, axis=axis)


def take_rows(x: jax.Array, index: jax.Array, length: int | None, axis: int | None) -> jax.Array:
    """Rows `index` of x [B, ...], cut or zero-padded to `length` along the position `axis` (if any)."""
    x = jnp.take(x, index, axis=0)
    if axis is None or length is None:
        return x
    S = x.shape[axis]
    if length <= S:
        return jax.lax.slice_in_dim(x, 0, length, axis=axis)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - S)
    return jnp.pad(x, widths)


def _per_layer(fn: Any) -> Any:
    """A row operation on [B, ...] lifted to the stacked [L, B, ...]."""
    return jax.vmap(fn)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Preallocated keys and values, [L, B, S, K, E] each."""

    k: jax.Array
    v: jax.Array
    stateful = False

    @staticmethod
    def zeros(cfg: ModelConfig, batch: int, length: int, layers: int | None = None) -> KVCache:
        shape = (cfg.num_layers if layers is None else layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
        return KVCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))

    @property
    def rows(self) -> int:
        return int(self.k.shape[1])

    @property
    def length(self) -> int:
        return int(self.k.shape[2])

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def per_layer(self) -> LayerCache:
        return LayerCache(tuple(self.k.transpose(0, 1, 3, 4, 2)), tuple(self.v.transpose(0, 1, 3, 2, 4)))

    def take(self, index: jax.Array, length: int) -> KVCache:
        take = _per_layer(lambda x: take_rows(x, index, length, 1))
        return KVCache(take(self.k), take(self.v))

    def insert(self, fresh: KVCache, source: jax.Array) -> KVCache:
        copy = _per_layer(lambda dst, src: copy_rows(dst, src, source, 1))
        return KVCache(copy(self.k, fresh.k), copy(self.v, fresh.v))

    def head(self, row: int | jax.Array, length: int) -> KVCache:
        """Row `row` (a traced index too) of the first `length` positions, [L, 1, length, K, E] each."""
        return KVCache(*(jax.lax.dynamic_slice_in_dim(x, row, 1, axis=1)[:, :, :length] for x in (self.k, self.v)))

    def clear(self, new: jax.Array) -> KVCache:
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    """The decode cache as one buffer per layer (what layers run unrolled over per-layer weights read and
    update in place), laid out for decode attention: keys [B, K, E, S] (a query's scores stream along
    S), values [B, K, S, E]; 1.7x faster decode attention than [B, S, K, E] here. The sampler keeps its
    decode cache in this form between chunks (converting it per chunk cost 12% of a batch-32 step).
    Prefill writes the stacked form, so `insert` takes a `KVCache`."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    stateful = False

    @staticmethod
    def zeros(cfg: ModelConfig, batch: int, length: int) -> LayerCache:
        K, E = cfg.num_kv_heads, cfg.head_dim
        keys = tuple(jnp.zeros((batch, K, E, length), cfg.dtype) for _ in range(cfg.num_layers))
        values = tuple(jnp.zeros((batch, K, length, E), cfg.dtype) for _ in range(cfg.num_layers))
        return LayerCache(keys, values)

    @property
    def rows(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def length(self) -> int:
        return int(self.k[0].shape[-1])

    def stacked(self) -> KVCache:
        return KVCache(jnp.stack(self.k).transpose(0, 1, 4, 2, 3), jnp.stack(self.v).transpose(0, 1, 3, 2, 4))

    def take(self, index: jax.Array, length: int) -> LayerCache:
        keys = tuple(take_rows(k, index, length, 3) for k in self.k)
        return LayerCache(keys, tuple(take_rows(v, index, length, 2) for v in self.v))

    def insert(self, fresh: KVCache, source: jax.Array) -> LayerCache:
        keys = tuple(copy_rows(dst, fresh.k[i].transpose(0, 2, 3, 1), source, 3) for i, dst in enumerate(self.k))
        values = tuple(copy_rows(dst, fresh.v[i].transpose(0, 2, 1, 3), source, 2) for i, dst in enumerate(self.v))
        return LayerCache(keys, values)

    def clear(self, new: jax.Array) -> LayerCache:
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearState:
    """Gated DeltaNet layers' decode state, [*layers] leading: the last W-1 conv inputs [B, W-1, C] and
    the per-head state matrix [B, H, E, M] (float32). No position axis: a row's state is what it has read."""

    conv: jax.Array
    delta: jax.Array

    @staticmethod
    def zeros(cfg: ModelConfig, batch: int, layers: int) -> LinearState:
        lin = cfg.linear
        if lin is None:
            return LinearState(jnp.zeros((0, batch, 0, 0), cfg.dtype), jnp.zeros((0, batch, 0, 0, 0), jnp.float32))
        conv = jnp.zeros((layers, batch, lin.conv_kernel - 1, lin.conv_dim), cfg.dtype)
        shape = (layers, batch, lin.value_heads, lin.key_head_dim, lin.value_head_dim)
        return LinearState(conv, jnp.zeros(shape, jnp.float32))

    @property
    def nbytes(self) -> int:
        return int(self.conv.nbytes + self.delta.nbytes)

    def take(self, index: jax.Array) -> LinearState:
        return jax.tree.map(_per_layer(lambda x: take_rows(x, index, None, None)), self)

    def insert(self, fresh: LinearState, source: jax.Array) -> LinearState:
        return jax.tree.map(_per_layer(lambda dst, src: copy_rows(dst, src, source, None)), self, fresh)

    def head(self, row: int | jax.Array) -> LinearState:
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1, axis=1), self)

    def clear(self, new: jax.Array) -> LinearState:
        """Zero the rows where `new` [B] is true."""
        return jax.tree.map(lambda x: jnp.where(new.reshape(1, -1, *(1,) * (x.ndim - 2)), 0, x).astype(x.dtype), self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    """Decode state keyed by layer type, each stacked over the layers of its type, rows on axis 1: `full`,
    the full-attention layers' keys and values [L_full, B, S, K, E]; `linear`, the Gated DeltaNet layers'
    `LinearState`. Only `full` has a length axis."""

    full: KVCache
    linear: LinearState
    stateful = True

    @staticmethod
    def zeros(cfg: ModelConfig, batch: int, length: int) -> HybridCache:
        full = KVCache.zeros(cfg, batch, length, layers=len(cfg.layers_holding("self_attn")))
        return HybridCache(full, LinearState.zeros(cfg, batch, len(cfg.layers_holding("linear_attn"))))

    @property
    def rows(self) -> int:
        return int(self.full.k.shape[1])

    @property
    def length(self) -> int:
        return int(self.full.k.shape[2])

    @property
    def nbytes(self) -> int:
        return self.full.nbytes + self.linear.nbytes

    def take(self, index: jax.Array, length: int) -> HybridCache:
        return HybridCache(self.full.take(index, length), self.linear.take(index))

    def insert(self, fresh: HybridCache, source: jax.Array) -> HybridCache:
        return HybridCache(self.full.insert(fresh.full, source), self.linear.insert(fresh.linear, source))

    def head(self, row: int | jax.Array, length: int) -> HybridCache:
        return HybridCache(self.full.head(row, length), self.linear.head(row))

    def clear(self, new: jax.Array) -> HybridCache:
        return HybridCache(self.full, self.linear.clear(new))


def prefill_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache | HybridCache:
    """The stacked form a prefill writes (and the prompt cache keeps) for this model's layers."""
    if cfg.linear is not None:
        return HybridCache.zeros(cfg, batch, length)
    return KVCache.zeros(cfg, batch, length)


def decode_cache(cfg: ModelConfig, batch: int, length: int, per_layer: bool) -> KVCache | LayerCache | HybridCache:
    """The form the sampler keeps between chunks: per layer when its weights are split per layer
    (attention-only models), else the prefill form."""
    if per_layer and cfg.linear is None:
        return LayerCache.zeros(cfg, batch, length)
    return prefill_cache(cfg, batch, length)
