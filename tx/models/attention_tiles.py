"""Causal self-attention of long rows in [C x C] tiles, computing only the tiles a query can see.

In a packed training row a query never sees a key to its right (a later segment, or later in its own), so
query block i needs key blocks 0..i only: about half of the [T, T] scores of a long row. `tiled_attention`
runs a scan over the query blocks and, inside it, a loop over key blocks lo..i (`lo` skips the blocks a
sliding window has left behind), with the running maximum and normaliser of each query (online softmax).
Its custom backward recomputes each tile's probabilities from the saved log-normaliser, as
`tx.models.attention` does, looping over the same tiles. Memory: one tile of scores at a time; between
the passes the queries, keys, values, output and lse.

Dimension letters as in `tx.models.attention`; N query (and key) blocks of C rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tx.models.attention import (
    NEG_INF,
    AttentionMask,
    Keys,
    blocked_attention,
    blocks_of,
    heads_of,
    mask_bias,
    query_block,
    rows_of,
    sink_grad,
    sink_rows,
    stack_heads,
    unblocks,
)

TILE = 256  # queries and keys per tile


def self_attention(
    qg: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    mask: AttentionMask,
    window: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of packed rows over themselves (training, and a forward without a cache): a call whose
    scores fit in one block as `blocked_attention` runs it (keeping its probabilities), a longer one in tiles.
    Positions rise along each segment, so no real token sees a key to its right; a padding token (segment
    0, position 0) may see padding on either side, and its output (never used) may differ between the two."""
    B, T, K, G, E = qg.shape
    if query_block(B, K * G, T, T) >= T:
        return blocked_attention(qg, keys, values, mask, window, sinks)
    return tiled_attention(qg, keys, values, mask, window, sinks)


def tiled_attention(
    qg: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    mask: AttentionMask,
    window: jax.Array | None,
    sinks: jax.Array | None,
) -> jax.Array:
    """Scaled queries qg [B, T, K, G, E] of a row over its own keys and values [B, K, T, E] (the mask's query
    and key sides the same tokens) -> [B, T, K*G*E]. T is padded to a multiple of `TILE`."""
    B, T, K, G, E = qg.shape
    pad = -T % TILE
    seg, pos = mask.q_segments, mask.q_positions
    if pad:
        qg = jnp.pad(qg, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        keys, values = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (keys, values))
        seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)  # padding sees, and is seen by, nothing real
        pos = jnp.pad(pos, ((0, 0), (0, pad)))
    kv = Keys(keys, values, seg, pos, window, None if sinks is None else sinks.astype(jnp.float32), False)
    return _tiled(qg, kv)[:, :T]


def _first_tile(i: jax.Array, window: jax.Array | None) -> jax.Array:
    """The first key block query block i can see: 0, or the block of the window's oldest key."""
    if window is None:
        return jnp.int32(0)
    return jnp.maximum(0, (i * TILE - window + 1) // TILE).astype(jnp.int32)


def _tile(kv: Keys, j: jax.Array) -> tuple[jax.Array, ...]:
    """Key block j: keys, values [B, K, C, E], segments and positions [B, C]."""
    at = j * TILE
    take = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=at, slice_size=TILE)
    return take(kv.keys, axis=2), take(kv.values, axis=2), take(kv.segments, axis=1), take(kv.positions, axis=1)


def _tile_scores(qh: jax.Array, qs: jax.Array, qp: jax.Array, tile: tuple, window: jax.Array | None) -> jax.Array:
    """qh [B, K, G*C, E] against one key block -> masked float32 scores [B, K, G*C, C]."""
    k, _, ks, kp = tile
    s = jnp.einsum("bkqe,bkse->bkqs", qh, k, preferred_element_type=jnp.float32)
    return s + mask_bias(AttentionMask(qs, ks, qp, kp), window, qh.shape[2] // qs.shape[1])


@jax.custom_vjp
def _tiled(qg: jax.Array, kv: Keys) -> jax.Array:
    return _forward(qg, kv)[0]


def _forward(qg: jax.Array, kv: Keys) -> tuple[jax.Array, jax.Array]:
    """-> (output [B, T, K*G*E], lse [N, B, K, G*C])."""
    B, T, K, G, E = qg.shape

    def block(_: None, xs: tuple) -> tuple[None, tuple]:
        i, qb, qs, qp = xs
        qh = stack_heads(qb)

        def step(j: jax.Array, carry: tuple) -> tuple:
            top, total, acc = carry
            tile = _tile(kv, j)
            s = _tile_scores(qh, qs, qp, tile, kv.window)
            new_top = jnp.maximum(top, s.max(-1))
            p = jnp.exp(s - new_top[..., None])
            shrink = jnp.exp(top - new_top)
            acc = acc * shrink[..., None] + jnp.einsum("bkqs,bkse->bkqe", p.astype(kv.values.dtype), tile[1])
            return new_top, total * shrink + p.sum(-1), acc

        start = (jnp.full((B, K, G * TILE), NEG_INF), jnp.zeros((B, K, G * TILE)), jnp.zeros((B, K, G * TILE, E)))
        top, total, acc = jax.lax.fori_loop(_first_tile(i, kv.window), i + 1, step, start)
        if kv.sinks is not None:  # the sink joins the normaliser (its value is zero)
            sink = sink_rows(kv.sinks, TILE)[..., 0]  # [1, K, G*C]
            new_top = jnp.maximum(top, sink)
            shrink = jnp.exp(top - new_top)
            top, total, acc = new_top, total * shrink + jnp.exp(sink - new_top), acc * shrink[..., None]
        out = (acc / total[..., None]).astype(qg.dtype)
        return None, (rows_of(out, G).reshape(B, TILE, K * G * E), top + jnp.log(total))

    n = T // TILE
    _, (out, lse) = jax.lax.scan(
        block, None, (jnp.arange(n), blocks_of(qg, TILE), blocks_of(kv.segments, TILE), blocks_of(kv.positions, TILE))
    )
    return unblocks(out), lse


def _fwd(qg: jax.Array, kv: Keys) -> tuple[jax.Array, tuple]:
    out, lse = _forward(qg, kv)
    return out, (qg, kv, out, lse)


def _bwd(res: tuple, d_out: jax.Array) -> tuple:
    qg, kv, out, lse = res
    B, T, K, G, E = qg.shape

    def block(carry: tuple, xs: tuple) -> tuple[tuple, jax.Array]:
        i, qb, qs, qp, ob, dob, lse_i = xs
        qh = stack_heads(qb)
        do = heads_of(dob, K, E)
        delta = jnp.sum(do.astype(jnp.float32) * heads_of(ob, K, E).astype(jnp.float32), axis=-1)  # [B, K, G*C]

        def step(j: jax.Array, inner: tuple) -> tuple:
            dq, dk_all, dv_all = inner
            tile = _tile(kv, j)
            p = jnp.exp(_tile_scores(qh, qs, qp, tile, kv.window) - lse_i[..., None])
            dv = jnp.einsum("bkqs,bkqe->bkse", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkqe,bkse->bkqs", do, tile[1], preferred_element_type=jnp.float32)
            ds = (p * (dp - delta[..., None])).astype(qh.dtype)
            dq = dq + jnp.einsum("bkqs,bkse->bkqe", ds, tile[0], preferred_element_type=jnp.float32)
            dk = jnp.einsum("bkqs,bkqe->bkse", ds, qh, preferred_element_type=jnp.float32)
            return dq, _add_at(dk_all, dk, j), _add_at(dv_all, dv, j)

        dk_all, dv_all, d_sink = carry
        start = (jnp.zeros((B, K, G * TILE, E)), dk_all, dv_all)
        dq, dk_all, dv_all = jax.lax.fori_loop(_first_tile(i, kv.window), i + 1, step, start)
        if kv.sinks is not None:
            d_sink = d_sink + sink_grad(kv.sinks, lse_i, delta)
        return (dk_all, dv_all, d_sink), rows_of(dq, G).astype(qg.dtype)

    start = (
        jnp.zeros(kv.keys.shape, jnp.float32),
        jnp.zeros(kv.values.shape, jnp.float32),
        None if kv.sinks is None else jnp.zeros_like(kv.sinks),
    )
    xs = (jnp.arange(T // TILE), *(blocks_of(x, TILE) for x in (qg, kv.segments, kv.positions, out, d_out)), lse)
    (dk, dv, d_sink), dq = jax.lax.scan(block, start, xs)
    d_kv = Keys(dk.astype(kv.keys.dtype), dv.astype(kv.values.dtype), None, None, None, d_sink, False)  # type: ignore[arg-type]
    return unblocks(dq), d_kv


def _add_at(total: jax.Array, part: jax.Array, j: jax.Array) -> jax.Array:
    """total [B, K, S, E] with part [B, K, C, E] added to key block j."""
    at = j * TILE
    block = jax.lax.dynamic_slice_in_dim(total, at, TILE, axis=2)
    return jax.lax.dynamic_update_slice_in_dim(total, block + part, at, axis=2)


_tiled.defvjp(_fwd, _bwd)
