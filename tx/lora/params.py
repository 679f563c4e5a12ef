"""LoRA variable type and the per-row adapter selector that every LoRA-aware layer receives.

Adapter weights are a `LoRAParam`, a subclass of `nnx.Param`, so the trainer selects them by type
(`nnx.state(model, LoRAParam)`) and never by matching path strings. Adapters are stacked in slots:
A `[..., S, in, R]` and B `[..., S, R, out]`; slot 0 is "no adapter" and is kept at zero scale.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


class LoRAParam(nnx.Param):
    """A stacked low-rank adapter weight (fp32 master, one slice per adapter slot)."""


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


def slot_scale(rank: int, alpha: float, max_rank: int, rslora: bool = False) -> jax.Array:
    """One row of `LoRARows.scale`: PEFT's `alpha / rank` (or `alpha / sqrt(rank)`) on the live columns."""
    factor = alpha / (rank**0.5 if rslora else rank)
    return jnp.where(jnp.arange(max_rank) < rank, factor, 0.0).astype(jnp.float32)
