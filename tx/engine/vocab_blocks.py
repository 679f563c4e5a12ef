"""Work over the full vocabulary a block of positions at a time, so [R, T, V] logits never exist whole.

A training micro-batch of 16384 tokens over Qwen3.5's 248k vocabulary has 16 GB of float32 logits, and the
gradient as much again; prompt scores of a long prefill likewise. `block_size` picks how many positions of
every row fit a budget of logit elements, and `over_blocks` maps a function of [R, C, ...] inputs over the
T axis in such blocks (T padded up to whole blocks, the padding cut from the results). Under `jax.grad`
the caller wraps the function in `jax.checkpoint`, so the backward recomputes each block's logits instead
of keeping them.
Dimension letters: R rows, T positions, C positions in a block, B blocks, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def block_size(rows: int, length: int, vocab: int, elements: int) -> int:
    """Positions per block: the largest power of two whose [rows, block, vocab] logits fit in `elements`
    (at least 1), and no more than `length` needs."""
    fit = max(1, elements // (rows * vocab))
    block = 1 << (fit.bit_length() - 1)
    return min(block, length)


def over_blocks(fn: Callable[..., Any], block: int, *inputs_RT: jax.Array) -> Any:
    """`fn` applied to C = `block` positions of every input at a time ([R, T, ...] -> [R, C, ...]), its
    outputs (a pytree of [R, C, ...] arrays) put back together as [R, T, ...]."""
    R, T = inputs_RT[0].shape[:2]
    blocks = -(-T // block)

    def split(x_RT: jax.Array) -> jax.Array:
        pad = [(0, 0), (0, blocks * block - T)] + [(0, 0)] * (x_RT.ndim - 2)
        return jnp.pad(x_RT, pad).reshape(R, blocks, block, *x_RT.shape[2:]).swapaxes(0, 1)

    def join(y_BRC: jax.Array) -> jax.Array:
        return y_BRC.swapaxes(0, 1).reshape(R, blocks * block, *y_BRC.shape[3:])[:, :T]

    out = jax.lax.map(lambda args: fn(*args), tuple(split(x) for x in inputs_RT))
    return jax.tree.map(join, out)
