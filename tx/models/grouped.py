"""The grouped expert product over padded blocks: the (token, expert) pairs sorted by expert, each expert's
rows padded to whole blocks, each block multiplied by its own expert's weight.

`blocks_of` lays the pairs out; `block_product` multiplies the blocks. It runs one matmul per block in a loop
that reads the block's expert weight in place, and has its own backward: one loop that gives each block's
input gradient and adds the block's weight gradient into its expert's. Left to autodiff, a batched product
against per-block weight copies ([blocks, out, in], what `jnp.take` gives) kept those copies as residuals of
the layer scan, zero-filled, gathered and stacked each step: on XLA:CPU they cost more than the products
(`benchmarks/bench_moe.py`). Letters as in `tx.models.moe`: M pairs, X experts, P padded rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Blocks:
    """The (token, expert) pairs sorted by expert with each expert's rows padded to whole blocks of `rows`:
    pair [P] (the pair in each padded row, M for padding), at [M] (each pair's padded row, in pair order),
    expert [P / rows] (each block's expert) and used [] (how many blocks hold pairs: the first `used`; the
    rest are padding). P = the fewest whole blocks that hold M rows plus X - 1 partial blocks' padding, a
    bound fixed by the shapes."""

    pair: jax.Array
    at: jax.Array
    expert: jax.Array
    used: jax.Array


def block_rows(M: int, X: int, rows: int) -> int:
    """P: room for M pairs in X groups, each padded to a multiple of `rows`."""
    return -(-(M + X * (rows - 1)) // rows) * rows


def blocks_of(flat: jax.Array, X: int, rows: int) -> Blocks:
    """flat [M]: each pair's expert -> the padded block layout."""
    M = flat.shape[0]
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=X)
    padded = -(-sizes // rows) * rows
    start, padded_start = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded
    sorted_expert = jnp.take(flat, order)
    at_sorted = jnp.take(padded_start, sorted_expert) + jnp.arange(M) - jnp.take(start, sorted_expert)
    P = block_rows(M, X, rows)
    pair = jnp.full((P,), M, jnp.int32).at[at_sorted].set(order.astype(jnp.int32))
    at = jnp.zeros((M,), jnp.int32).at[order].set(at_sorted.astype(jnp.int32))
    ends = jnp.cumsum(padded)
    expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(P // rows) * rows, side="right"), X - 1)
    return Blocks(pair, at, expert.astype(jnp.int32), (ends[-1] // rows).astype(jnp.int32))


_ROWS_BY_OUT_IN = (((1,), (1,)), ((), ()))  # block [n, in] . weight [out, in] -> [n, out]


def entry(stack: jax.Array, i: jax.Array) -> jax.Array:
    """stack[i] for a traced index i (an expert's weight, a block)."""
    return lax.dynamic_index_in_dim(stack, i, keepdims=False)


def _put(stack: jax.Array, item: jax.Array, i: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(stack, item, i, 0)


@jax.custom_vjp
def block_product(blocks: jax.Array, weight: jax.Array, expert: jax.Array, used: jax.Array) -> jax.Array:
    """blocks [nb, n, in], weight [X, out, in] (the checkpoint's layout), each block's expert [nb], the
    number of blocks that hold pairs -> [nb, n, out]: block b times weight[expert[b]] transposed for the
    first `used` blocks, zeros for the padding blocks after them (not computed)."""

    def one(b: jax.Array, out: jax.Array) -> jax.Array:
        y = lax.dot_general(entry(blocks, b), entry(weight, entry(expert, b)), _ROWS_BY_OUT_IN)
        return _put(out, y.astype(out.dtype), b)

    dtype = jnp.result_type(blocks, weight)
    return lax.fori_loop(0, used, one, jnp.zeros((*blocks.shape[:2], weight.shape[1]), dtype))


def _forward(blocks: jax.Array, weight: jax.Array, expert: jax.Array, used: jax.Array) -> tuple[jax.Array, tuple]:
    return block_product(blocks, weight, expert, used), (blocks, weight, expert, used)


def _backward(saved: tuple, d_out: jax.Array) -> tuple[jax.Array, jax.Array, None, None]:
    """Each block's input gradient, and its weight gradient added into its expert's in place (unused, as for
    a frozen base weight under LoRA, XLA drops that half of the loop)."""
    blocks, weight, expert, used = saved

    def one(b: jax.Array, grads: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        d_blocks, d_weight = grads
        e, d_y = entry(expert, b), entry(d_out, b)
        d_block = (d_y @ entry(weight, e)).astype(d_blocks.dtype)
        d_expert = entry(d_weight, e) + (d_y.T @ entry(blocks, b)).astype(d_weight.dtype)
        return _put(d_blocks, d_block, b), _put(d_weight, d_expert, e)

    zeros = (jnp.zeros_like(blocks), jnp.zeros_like(weight))
    d_blocks, d_weight = lax.fori_loop(0, used, one, zeros)
    return d_blocks, d_weight, None, None


block_product.defvjp(_forward, _backward)


@jax.custom_vjp
def permute_rows(src: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """src [S, D] -> [len(index), D]: row i is src[index[i]], zeros where index[i] == S. Each source row is
    read at most once, by row inverse[s] (len(index) where none reads it), so the backward is the same move
    the other way (XLA:CPU runs a gather's usual backward, a scatter-add, one row at a time)."""
    with_zero = jnp.concatenate([src, jnp.zeros_like(src[:1])])
    return jnp.take(with_zero, index, axis=0, mode="clip")


def _permute_forward(src: jax.Array, index: jax.Array, inverse: jax.Array) -> tuple[jax.Array, tuple]:
    return permute_rows(src, index, inverse), (index, inverse)


def _permute_backward(saved: tuple, d_out: jax.Array) -> tuple[jax.Array, None, None]:
    index, inverse = saved
    return permute_rows(d_out, inverse, index), None, None


permute_rows.defvjp(_permute_forward, _permute_backward)
