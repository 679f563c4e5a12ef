"""Device arrays to host memory, and the one writer of shared files, on one process or several.

With JAX's multi-controller runtime (`jax.distributed`, several processes over one mesh) a process holds
only its own shards of an array that is split over the mesh, and `np.asarray` of it fails. `to_host`
reads any array whole: directly when this process holds all of it (one process, or a replicated array),
otherwise through a collective all-gather, which every process must then call at the same point, as
every process runs the same engine calls in the same order (`tx.engine.multihost`). Files that every
process would write alike (a PEFT export, a checkpoint's metadata) are written by process 0 alone
(`is_writer`), after a `barrier` where another process must not race ahead. Leaf: imports JAX only.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def to_host(x: Any) -> np.ndarray:
    """`x` (a jax.Array, or anything numpy reads) as one host numpy array."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def tree_to_host(tree: Any) -> Any:
    """Every array leaf of `tree` through `to_host`."""
    return jax.tree.map(to_host, tree)


def packed_to_host(tree: Any) -> Any:
    """`tree`'s array leaves copied to host memory through one buffer: a compiled program packs them into
    one byte array (replicated leaves only), one transfer brings it over, and each leaf comes back as a numpy
    view into it. A page move of a run's hundred-odd leaves costs one transfer instead of one per leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    buffer = to_host(_pack(tuple(leaves)))
    views, start = [], 0
    for leaf in leaves:
        size = leaf.size * leaf.dtype.itemsize
        views.append(buffer[start : start + size].view(leaf.dtype).reshape(leaf.shape))
        start += size
    return jax.tree.unflatten(treedef, views)


def packed_to_device(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """The inverse of `packed_to_host`: `tree`'s numpy leaves as device arrays placed by `sharding` (every
    leaf alike), through one buffer and one transfer, unpacked by one compiled program."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    hosts = [np.asarray(leaf, order="C") for leaf in leaves]
    buffer = np.concatenate([h.reshape(-1).view(np.uint8) for h in hosts])
    layout = tuple((h.shape, h.dtype) for h in hosts)
    return jax.tree.unflatten(treedef, _unpacker(layout, sharding)(jax.device_put(buffer, sharding)))


@jax.jit
def _pack(leaves: tuple[jax.Array, ...]) -> jax.Array:
    return jnp.concatenate([_bytes(x).reshape(-1) for x in leaves])


def _bytes(x: jax.Array) -> jax.Array:
    return x.astype(jnp.uint8) if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(x, jnp.uint8)


@functools.cache
def _unpacker(layout: tuple[tuple[tuple[int, ...], np.dtype], ...], sharding: jax.sharding.Sharding) -> Any:
    """A compiled program cutting a byte buffer into arrays of `layout` (shape, dtype) placed by `sharding`."""

    def unpack(buffer: jax.Array) -> list[jax.Array]:
        out, start = [], 0
        for shape, kind in layout:
            itemsize = kind.itemsize
            size = int(np.prod(shape)) * itemsize
            raw = jax.lax.slice_in_dim(buffer, start, start + size)
            value = raw.reshape(-1, itemsize) if itemsize > 1 else raw
            out.append((value != 0 if kind == np.bool_ else jax.lax.bitcast_convert_type(value, kind)).reshape(shape))
            start += size
        return out

    return jax.jit(unpack, out_shardings=sharding)


def is_writer() -> bool:
    """True on the process that writes shared files: the only one, or process 0 of several."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process gets here (nothing to wait for on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
