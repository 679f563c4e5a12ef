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

from typing import Any

import jax
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


def is_writer() -> bool:
    """True on the process that writes shared files: the only one, or process 0 of several."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process gets here (nothing to wait for on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
