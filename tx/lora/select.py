"""Only the adapters a batch uses: a program compacts the stacked slots before it runs the model.

The model holds every slot (A `[..., S, in, R]`, B `[..., S, R, out]`), but a batch usually reads one or
two of them, often at a rank below the stacked maximum. Running the kernel over all S slots at rank R
costs memory traffic in S*R for every projection: at decode, where a step is bound by weight reads, the
server's default 9 slots of rank 32 doubled the step time of a rank-8 adapter. So the host lists the
slots its rows use (`select`: padded to a power of two with slot 0, whose scale is zero) and the rank
bucket covering them; the jitted program takes those slices first (`take_adapters`, before the layer
scan, so no layer reads a slot it does not need) and runs the model on a stack of G slots at rank R'
with each row pointing into it. Rows without an adapter point at -1 and get no adapter term; a batch
with no adapter rows gets no selection at all, and its program has no adapter work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tx.lora.params import AdapterRoles, LoRARows

MIN_RANK_BUCKET = 8  # ranks 1..8 share one compiled shape; the extra columns cost next to nothing


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
    """The slots a batch reads, `active` [G] (indices into the full stack), and its rows over them:
    `rows.slot` [B] indexes `active` (-1 = no adapter) and `rows.scale` is [G, R'] for the compact stack."""

    active: jax.Array
    rows: LoRARows

    @property
    def rank(self) -> int:
        return int(self.rows.scale.shape[-1])


def rank_bucket(rank: int, max_rank: int) -> int:
    """The compiled rank for a batch whose widest adapter has `rank`: a power of two >= 8, at most `max_rank`."""
    bucket = MIN_RANK_BUCKET
    while bucket < rank:
        bucket *= 2
    return min(bucket, max_rank)


def select(slots: Sequence[int] | np.ndarray, scale: np.ndarray) -> Selection | None:
    """The selection for rows on adapter `slots` [B] (0 = base) given the full scale table `scale` [S, R];
    None when no row uses an adapter. G is a power of two (padded with slot 0), so shapes stay few."""
    slots = np.asarray(slots, np.int32)
    used = sorted({int(s) for s in slots} - {0})
    if not used:
        return None
    S, R = scale.shape
    if used[-1] >= S or used[0] < 0:
        raise ValueError(f"adapter slot {used[-1] if used[-1] >= S else used[0]} is outside the {S} slots")
    G = 1
    while G < len(used):
        G *= 2
    G = min(G, S)
    active = np.zeros(G, np.int32)
    active[: len(used)] = used
    rank = rank_bucket(max(int(np.count_nonzero(scale[s])) for s in used), R)
    local = {s: i for i, s in enumerate(used)}
    rows = np.array([local.get(int(s), -1) for s in slots], np.int32)
    compact = np.array(scale[active, :rank], np.float32)
    compact[len(used) :] = 0.0
    return Selection(active, LoRARows(rows, compact))  # type: ignore[arg-type]


def slot_slice(x: jax.Array, slots: jax.Array | int, rank: int, a: bool) -> jax.Array:
    """The one cut of a stacked adapter: slots `slots` of A `[..., S, in, R]` (a=True) or B `[..., S, R, out]`,
    first `rank` rank columns. A scalar `slots` drops the slot axis, an array [G] keeps it (length G)."""
    picked = jnp.take(x, slots, axis=x.ndim - 3)
    return picked[..., :rank] if a else picked[..., :rank, :]


def slot_put(x: jax.Array, slot: jax.Array, value: jax.Array, a: bool) -> jax.Array:
    """The one write of a stacked adapter: `x` with slot `slot` set to `value` (A [..., in, r] or B
    [..., r, out], r <= the stack's rank: the columns past r are zero)."""
    pad = x.shape[-1] - value.shape[-1] if a else x.shape[-2] - value.shape[-2]
    widths = [(0, 0)] * value.ndim
    widths[-1 if a else -2] = (0, pad)
    full = jnp.pad(value.astype(x.dtype), widths)
    return jax.lax.dynamic_update_index_in_dim(x, full, slot, x.ndim - 3)


def take_adapters(
    weights: Mapping[tuple, jax.Array], selection: Selection, roles: AdapterRoles
) -> dict[tuple, jax.Array]:
    """{path: array} with every stacked adapter (a path in `roles`) cut to the selected slots and rank; other
    entries as they are."""
    return {
        path: slot_slice(x, selection.active, selection.rank, roles.is_a(path)) if path in roles else x
        for path, x in weights.items()
    }
