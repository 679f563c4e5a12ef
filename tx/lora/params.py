"""LoRA variable type and the per-row adapter selector that every LoRA-aware layer receives.

Adapter weights are a `LoRAParam`, a subclass of `nnx.Param`, so the trainer selects them by type
(`nnx.state(model, LoRAParam)`) and never by matching path strings; the two factors are the subclasses
`LoRAA` and `LoRAB`, and `AdapterRoles` records once, from those types, which flat path holds which, for
the programs that see plain {path: array} dicts. Adapters are stacked in slots: A `[..., S, in, R]` and
B `[..., S, R, out]`; slot 0 is "no adapter" and is kept at zero scale.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


class LoRAParam(nnx.Param):
    """A stacked low-rank adapter weight (fp32 master, one slice per adapter slot)."""


class LoRAA(LoRAParam):
    """The down projection A `[..., S, in, R]`: the rank axis last."""


class LoRAB(LoRAParam):
    """The up projection B `[..., S, R, out]`: the rank axis second to last."""


Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class AdapterRoles:
    """Which flat paths hold A factors and which B, read from the variables' types (hashable: a static
    argument of the programs that cut or pad stacked adapters)."""

    a: frozenset[Path]
    b: frozenset[Path]

    @classmethod
    def of(cls, state: nnx.State) -> AdapterRoles:
        flat = [(tuple(str(k) for k in path), var) for path, var in nnx.to_flat_state(state)]
        return cls(
            frozenset(p for p, v in flat if isinstance(v, LoRAA)), frozenset(p for p, v in flat if isinstance(v, LoRAB))
        )

    def __contains__(self, path: object) -> bool:
        return path in self.a or path in self.b

    def is_a(self, path: Path) -> bool:
        """True for an A factor, False for a B factor; a path that is neither is a KeyError."""
        if path in self.a:
            return True
        if path in self.b:
            return False
        raise KeyError(f"{'.'.join(path)} is not a LoRA factor")

    def rank_of(self, path: Path, x: jax.Array | jax.ShapeDtypeStruct) -> int:
        """The rank width of `x`, the array at `path` (stacked or one slot's)."""
        return int(x.shape[-1] if self.is_a(path) else x.shape[-2])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRARows:
    """Which adapter each batch row uses, and how each slot's rank columns are scaled.

    slot:  [B] int32, the adapter slot of every row in the stack the layers hold (0 = the zero slot of
           the full stack, -1 = no adapter term at all; see `tx.lora.select` for compacted stacks).
    scale: [S, R] float32, `alpha / rank` on the slot's first `rank` columns and 0 elsewhere, so a
           run whose rank is below the stacked maximum is masked rather than reshaped (and slot 0,
           all zeros, reproduces the base model exactly).
    """

    slot: jax.Array
    scale: jax.Array


def in_compute_dtype(w: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Adapter weights `w` (float32 masters) in the compute `dtype`, clipped to its finite range first: a
    float32 value past bfloat16's largest (an adapter an optimizer step left at ~3.4e38) would be inf there,
    and the one-hot and masked products that keep each row to its own slot give 0 * inf = NaN in every row.
    XLA fuses the clip into the cast."""
    limit = float(jnp.finfo(dtype).max)
    if limit < float(jnp.finfo(w.dtype).max):
        w = jnp.clip(w, -limit, limit)
    return w.astype(dtype)


def slot_scale(rank: int, alpha: float, max_rank: int, rslora: bool = False) -> jax.Array:
    """One row of `LoRARows.scale`: PEFT's `alpha / rank` (or `alpha / sqrt(rank)`) on the live columns."""
    factor = alpha / (rank**0.5 if rslora else rank)
    return jnp.where(jnp.arange(max_rank) < rank, factor, 0.0).astype(jnp.float32)
