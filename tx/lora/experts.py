"""Adapters on a mixture-of-experts block's stacked experts: one LoRA per (expert, slot).

An expert projection's weight is `[*stack, X, out, in]`; its adapters are A `[*stack, X, S, in, R]` and
B `[*stack, X, S, R, out]`, the slot axis third from the end as on every LoRA layer (so `tx.lora.select`
and the training programs cut slots the same way) and the `expert` axis before it, sharded with the
experts. Expert e of slot s changes its weight by `scale[s] * (A[e, s] @ B[e, s]).T`, which is what a
PEFT adapter on `mlp.experts.{e}.gate_proj` spells.

A token reaches an expert only through the routing, so its adapter term rides along the expert product:
the slots of each expert are laid side by side (A as `[X, in, Q]`, B as `[X, Q, out]`, Q = G*R) and each
token keeps its own slot's columns by a mask that carries the scale, as the one-token decode form of
`tx.lora.kernels` does for dense layers. The masked product costs G*R columns per expert; the selection
cuts G to the slots a batch uses before the layer scan.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tx.lora.layers import LoRASpec
from tx.lora.params import LoRAA, LoRAB, LoRARows, in_compute_dtype


def expert_lora_pair(
    experts: int, d_in: int, d_out: int, axes: tuple[str, str], spec: LoRASpec, stack: tuple[int, ...]
) -> tuple[LoRAA, LoRAB]:
    """Zero A `[*stack, X, S, in, R]` and B `[*stack, X, S, R, out]` for one expert projection."""
    lead = (*("layers",) * len(stack), "expert")
    a = LoRAA(
        jnp.zeros((*stack, experts, spec.slots, d_in, spec.max_rank), jnp.float32),
        logical_axes=(*lead, "adapter", axes[0], "lora_rank"),
    )
    b = LoRAB(
        jnp.zeros((*stack, experts, spec.slots, spec.max_rank, d_out), jnp.float32),
        logical_axes=(*lead, "adapter", "lora_rank", axes[1]),
    )
    return a, b


def token_columns(rows: LoRARows, tokens_per_row: int, dtype: jnp.dtype) -> jax.Array:
    """Each token's mask over the side-by-side slot columns, [B*T, G*R]: its row's scale on its slot's
    columns, 0 elsewhere (all 0 for rows without an adapter, slot -1)."""
    G, R = rows.scale.shape
    pick = jax.nn.one_hot(rows.slot, G, dtype=dtype)  # [B, G]
    per_row = (pick[:, :, None] * rows.scale.astype(dtype)[None]).reshape(-1, G * R)
    return jnp.repeat(per_row, tokens_per_row, axis=0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertAdapter:
    """One expert projection's adapters with the slots side by side: a [X, in, Q], b [X, Q, out], and the
    tokens' column mask [N, Q] (Q = G*R)."""

    a: jax.Array
    b: jax.Array
    mask: jax.Array

    @classmethod
    def of(cls, a: jax.Array, b: jax.Array, mask: jax.Array) -> ExpertAdapter:
        """From the stacked pair a [X, G, in, R], b [X, G, R, out] (one layer's) in the mask's dtype."""
        X, G, I, R = a.shape
        a_cat = in_compute_dtype(a, mask.dtype).transpose(0, 2, 1, 3).reshape(X, I, G * R)
        return cls(a_cat, in_compute_dtype(b, mask.dtype).reshape(X, G * R, b.shape[-1]), mask)

    def dense(self, x: jax.Array) -> jax.Array:
        """Every expert on every token: x [N, in] -> [X, N, out]."""
        return jnp.einsum("xnq,xqo->xno", _own(jnp.einsum("ni,xiq->xnq", x, self.a), self.mask[None]), self.b)

    def dense_summed(self, h: jax.Array) -> jax.Array:
        """Each expert on its own inputs, summed: h [X, N, in] -> [N, out]."""
        return jnp.einsum("xnq,xqo->no", _own(jnp.einsum("xni,xiq->xnq", h, self.a), self.mask[None]), self.b)

    def ragged(self, rows: jax.Array, token: jax.Array, sizes: jax.Array) -> jax.Array:
        """(token, expert) pairs sorted by expert: rows [M, in], each pair's token [M], group sizes [X] -> [M, out]."""
        xa = _own(jax.lax.ragged_dot(rows, self.a, sizes), jnp.take(self.mask, token, axis=0))
        return jax.lax.ragged_dot(xa, self.b, sizes)

    def pair(self, row: jax.Array, e: jax.Array, n: int) -> jax.Array:
        """One (token, expert) pair: row [1, in] (token n's), expert e -> [1, out]."""
        xa = _own(row @ jax.lax.dynamic_index_in_dim(self.a, e, keepdims=False), self.mask[n])
        return xa @ jax.lax.dynamic_index_in_dim(self.b, e, keepdims=False)

    def blocked(self, blocks: jax.Array, expert: jax.Array, mask: jax.Array) -> jax.Array:
        """Padded blocks of pairs (`tx.models.moe.Blocks`): blocks [nb, n, in], each block's expert [nb], the
        padded rows' column mask [nb * n, Q] -> [nb, n, out]."""
        nb, n, _ = blocks.shape
        a_t = jnp.take(self.a.transpose(0, 2, 1), expert, axis=0)  # [nb, Q, in]: its gradient [nb, Q, in] too,
        # which XLA:CPU computes 4x faster than the [nb, in, Q] one (small: a matrix-vector-like product each)
        xa = _own(jnp.einsum("bni,bqi->bnq", blocks, a_t), mask.reshape(nb, n, -1))
        return jnp.einsum("bnq,bqo->bno", xa, jnp.take(self.b, expert, axis=0))


def _own(xa: jax.Array, mask: jax.Array) -> jax.Array:
    """Each token's own slot columns of `xa`, scaled; 0 elsewhere by `where`, not by the mask's product:
    another slot's columns may overflow for this token (an adapter trained to huge finite values), and
    0 * inf would be NaN in this token's output, and in its gradient."""
    return jnp.where(mask != 0, xa * mask, 0)
