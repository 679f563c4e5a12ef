"""The multi-adapter LoRA product `x @ A[slot] @ B[slot] * scale[slot]`, in three interchangeable forms.

`gather` selects each row's adapter (a one-hot matmul over the S slots) and runs two batched einsums:
its cost grows with the batch, barely with the number of slots, and it is the better form on CPU. For
one-token rows (decode) it lays the slots side by side instead (`_decode`: two plain matmuls, a mask per
row), which reads each adapter once per step: rank-8 decode on `small` went from +16-25% over the base
model to +6-8% at batch 8-32. `grouped` sorts
rows by slot and runs `jax.lax.ragged_dot`, so each adapter's weights are read once however many
rows use it, and slot-0 rows can be left out of the adapter work; on TPU, where the ragged dot is
native, it should win when many rows share few adapters. `benchmarks/bench_lora.py` measures both;
`DEFAULT_KERNEL` records the winner.

Measured (CPU, 2 shared cores, float32, D=1024 -> O=3072, 17 slots, ranks 1/8/32, 1/4/16 adapters
active; best of 5): training batch 8 x 256 tokens, gather 85-210 ms vs grouped 175-365 ms per call
(base matmul 71 ms); decode batch 32 x 1, gather 3.1-7.6 ms vs grouped 4.7-10.4 ms (base 3.6 ms).
Gather won every case but one noisy rank-32 pair, hence the default. The reason is structural off
TPU: XLA has a native ragged dot only on TPU, and elsewhere `ragged_dot` is rolled out into one
masked dense product per group, so the cost of `grouped` grows with the slot count S instead of the active
adapters. `indexed` is the plain form: each row's A and B taken by index (a scatter-add in the backward
pass); it is what an accelerator runs until measured there (`tx.tuning`). `gather` and `indexed` share
the one-token decode form, which reads each adapter once per step on any backend.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from tx.lora.params import LoRARows, in_compute_dtype

Kernel = Literal["gather", "indexed", "grouped"]
DEFAULT_KERNEL: Kernel = "gather"


def lora_delta(x: jax.Array, rows: LoRARows, a: jax.Array, b: jax.Array, kernel: Kernel = DEFAULT_KERNEL) -> jax.Array:
    """x [B, T, I], a [S, I, R], b [S, R, O] -> the adapter contribution [B, T, O] in x's dtype."""
    if kernel == "grouped":
        return _grouped(x, rows, a, b)
    if x.shape[1] == 1:
        return _decode(x, rows, a, b)
    return _indexed(x, rows, a, b) if kernel == "indexed" else _gather(x, rows, a, b)


def _decode(x: jax.Array, rows: LoRARows, a: jax.Array, b: jax.Array) -> jax.Array:
    """One token per row: the G slots side by side as one [I, G*R] and one [G*R, O] matrix, each row's
    own columns kept by a mask that carries its scale. Reads each adapter once per step whatever the batch
    (the one-hot gather builds a [B, I, R] copy per projection) in two plain matmuls."""
    G, I, R = a.shape
    B = x.shape[0]
    pick = jax.nn.one_hot(rows.slot, G, dtype=x.dtype)  # [B, G]; all zero for rows without an adapter
    mask = (pick[:, :, None] * rows.scale.astype(x.dtype)[None]).reshape(B, G * R)
    a_cat = in_compute_dtype(a, x.dtype).transpose(1, 0, 2).reshape(I, G * R)
    b_cat = in_compute_dtype(b, x.dtype).reshape(G * R, b.shape[-1])
    # `where`, not a product with the mask: another slot's columns may overflow for this row (a huge finite
    # adapter), and inf * 0 would be NaN in every row of the batch.
    xa = jnp.where(mask != 0, (x[:, 0] @ a_cat) * mask, 0)
    return (xa @ b_cat)[:, None]


def _gather(x: jax.Array, rows: LoRARows, a: jax.Array, b: jax.Array) -> jax.Array:
    # Rows pick their adapter with a one-hot matmul rather than an index: the backward pass is then a
    # dense [B, S] x [B, I, R] product instead of a scatter-add, which XLA CPU runs element by element
    # (measured: the indexed form cost +20-30% over the base matmul per projection, this one ~0%).
    # A row on slot -1 (no adapter) has an all-zero one-hot row, so its term is exactly zero. (A plain
    # x @ A[0] path for a one-slot stack measured slower here: 1.8 vs 1.0 s per small training step.)
    pick = jax.nn.one_hot(rows.slot, a.shape[0], dtype=x.dtype)  # [B, S]
    coef = (pick @ rows.scale.astype(x.dtype))[:, None, :]  # [B, 1, R]: scale, 0 on rows without adapter
    # A is taken as [B, R, I] so that its gradient comes out as [B, R, I] too: per row an [R, T] x [T, I]
    # product, which XLA:CPU runs faster than the [I, T] x [T, R] one of a [B, I, R] gradient. One
    # projection's forward and backward, 8 x 256 tokens, rank 8: 512 -> 512 1.33 -> 0.57 ms, 1536 -> 512
    # 3.91 -> 1.53 ms, 1024 -> 3072 9.07 -> 5.89 ms; a `small` LoRA step ~5% faster.
    a_rows = jnp.einsum("bs,sri->bri", pick, in_compute_dtype(a, x.dtype).transpose(0, 2, 1))
    b_rows = jnp.einsum("bs,sro->bro", pick, in_compute_dtype(b, x.dtype))
    xa = jnp.einsum("bti,bri->btr", x, a_rows) * coef
    return jnp.einsum("btr,bro->bto", xa, b_rows)


def _indexed(x: jax.Array, rows: LoRARows, a: jax.Array, b: jax.Array) -> jax.Array:
    """Each row's adapter taken by index; a row on slot -1 (no adapter) reads slot 0 at zero scale."""
    live = rows.slot >= 0
    slot = jnp.where(live, rows.slot, 0)
    coef = (rows.scale[slot] * live[:, None]).astype(x.dtype)[:, None, :]  # [B, 1, R]
    xa = jnp.einsum("bti,bir->btr", x, in_compute_dtype(a[slot], x.dtype)) * coef
    return jnp.einsum("btr,bro->bto", xa, in_compute_dtype(b[slot], x.dtype))


def _grouped(x: jax.Array, rows: LoRARows, a: jax.Array, b: jax.Array) -> jax.Array:
    B, T, I = x.shape
    S = a.shape[0]
    # Rows without an adapter (slot -1) sort first and are left out of the ragged products; their rows
    # are zeroed afterwards. (Slot 0 of a full, uncompacted stack is a real group with zero scale.)
    none = rows.slot < 0
    slot = jnp.where(none, 0, rows.slot)
    key = jnp.where(none, -1, slot)
    order = jnp.argsort(key, stable=True)
    sorted_slot = slot[order]
    tokens = x[order].reshape(B * T, I)
    skip = jnp.sum(none) * T
    counts = jnp.bincount(jnp.where(none, S, slot), length=S + 1)[:S] * T
    sizes = counts.astype(jnp.int32)
    tokens = jnp.roll(tokens, -skip, axis=0)
    xa = jax.lax.ragged_dot(tokens, in_compute_dtype(a, x.dtype), sizes)
    token_slot = jnp.roll(jnp.repeat(sorted_slot, T), -skip)
    xa = xa * rows.scale[token_slot].astype(x.dtype)
    out = jax.lax.ragged_dot(xa, in_compute_dtype(b, x.dtype), sizes)
    live = jnp.arange(B * T) < (B * T - skip)
    out = jnp.where(live[:, None], out, 0)
    out = jnp.roll(out, skip, axis=0).reshape(B, T, -1)
    return jnp.zeros_like(out).at[order].set(out)
