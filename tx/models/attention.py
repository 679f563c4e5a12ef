"""Softmax attention of many queries at once (training, prefill), in query blocks, with a backward pass
that recomputes the probabilities instead of keeping them.

`blocked_attention` splits the queries into blocks of C whose float32 scores [B, K, G*C, S] fit in
`SCORE_BLOCK_BYTES`, and runs each block's exact softmax (every key at once, no running maximum) in a
scan over the blocks. Its custom backward keeps the queries, keys, values, the output and each query's
log-normaliser (`lse`, [B, K, G*C]), and recomputes a block's probabilities from them as exp(s - lse). So
a training step holds O(T) per layer between its passes where autodiff kept the [T, S] probabilities of
every layer (a Qwen3-0.6B step on one 4096-token row: 41 GiB of temporaries, the probabilities of 28
layers), and one block of scores at a time. A call whose scores fit in one block runs without the scan
and keeps its probabilities (at most `SCORE_BLOCK_BYTES` per layer): recomputing them made a `small`
training step (8 x 256 tokens) 5-8% slower on a 2-core EPYC.

Dimension letters as in `tx.models.layers`: B rows, T queries, S keys, K kv heads, G query heads per kv
head, E head dim, C queries per block. A kv head's G query heads are stacked along the query axis (row
g*C + c), so each (row, kv head) is one plain [G*C, E] x [E, S] product.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # additive mask: exp(NEG_INF - max) is exactly 0 in float32, and a finite value keeps gradients finite
SCORE_BLOCK_BYTES = 64 << 20  # float32 scores of one query block: bounds a call's attention memory


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """What each query may see. Without a cache: same segment and not in the future (packed rows).
    With a cache: every cache position up to the query's own position (one segment, keys at 0..S-1)."""

    q_segments: jax.Array  # [B, T] int32 (0 = padding)
    k_segments: jax.Array  # [B, S] int32
    q_positions: jax.Array  # [B, T] int32: position within its sequence
    k_positions: jax.Array  # [B, S] int32

    @classmethod
    def of_cache(cls, positions: jax.Array, length: int) -> AttentionMask:
        """Queries at `positions` [B, T] over a cache of `length` positions, all one segment."""
        B, T = positions.shape
        at = jnp.broadcast_to(jnp.arange(length, dtype=positions.dtype), (B, length))
        return cls(jnp.zeros((B, T), jnp.int32), jnp.zeros((B, length), jnp.int32), positions, at)

    def allowed(self, window: jax.Array | None = None) -> jax.Array:
        """[B, T, S]: same segment, not in the future, within `window` (a sliding layer's width) if given."""
        same = self.q_segments[:, :, None] == self.k_segments[:, None, :]
        causal = self.k_positions[:, None, :] <= self.q_positions[:, :, None]
        return same & causal & in_window(self.q_positions[:, :, None], self.k_positions[:, None, :], window)


def in_window(q_positions: jax.Array, k_positions: jax.Array, window: jax.Array | None) -> jax.Array | bool:
    """A key within a sliding window of the query: fewer than `window` positions behind it (True without)."""
    if window is None:
        return True
    return k_positions > q_positions - window


def logit_top(s: jax.Array, axis: int, sink: jax.Array | None) -> jax.Array:
    """The largest logit along `axis` (kept), the sink's included."""
    top = s.max(axis, keepdims=True)
    return top if sink is None else jnp.maximum(top, sink)


def normaliser(p: jax.Array, axis: int, sink: jax.Array | None, top: jax.Array) -> jax.Array:
    """The softmax's normaliser along `axis` (kept): the keys' exponentials and the sink's."""
    total = p.sum(axis, keepdims=True)
    return total if sink is None else total + jnp.exp(sink - top)


def query_block(rows: int, heads: int, queries: int, keys: int) -> int:
    """Queries per block: all of them when their scores fit in `SCORE_BLOCK_BYTES`, else the largest power of
    two that does (at least 16)."""
    fit = max(SCORE_BLOCK_BYTES // (rows * heads * keys * 4), 16)
    return queries if queries <= fit else 1 << (fit.bit_length() - 1)


def blocked_attention(
    qg: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    mask: AttentionMask,
    window: jax.Array | None = None,
    sinks: jax.Array | None = None,
    keys_es: bool = False,
    block: int | None = None,
) -> jax.Array:
    """Scaled queries qg [B, T, K, G, E] over keys [B, K, S, E] ([B, K, E, S] with `keys_es`, the decode
    cache's layout) and values [B, K, S, E], where `mask` (and `window`) allow -> [B, T, K*G*E].
    `sinks` [K, G]: one more logit per head in each softmax, whose value is 0 (gpt-oss). `block`: queries
    per block (default `query_block`); T is padded to a multiple of it with queries that see nothing."""
    B, T, K, G, E = qg.shape
    C = block or query_block(B, K * G, T, keys.shape[-1] if keys_es else keys.shape[-2])
    pad = -T % C
    q_seg, q_pos = mask.q_segments, mask.q_positions
    if pad:
        qg = jnp.pad(qg, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        q_seg = jnp.pad(q_seg, ((0, 0), (0, pad)), constant_values=-1)
        q_pos = jnp.pad(q_pos, ((0, 0), (0, pad)))
    kv = Keys(
        keys,
        values,
        mask.k_segments,
        mask.k_positions,
        window,
        None if sinks is None else sinks.astype(jnp.float32),
        keys_es,
    )
    return _attention(qg, q_seg, q_pos, kv, C)[:, :T]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Keys:
    """What every query block reads: keys, values, their segments and positions [B, S], the window and
    sinks (or None), and the keys' layout."""

    keys: jax.Array
    values: jax.Array
    segments: jax.Array
    positions: jax.Array
    window: jax.Array | None
    sinks: jax.Array | None
    keys_es: bool = dataclasses.field(metadata=dict(static=True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(qg: jax.Array, q_seg: jax.Array, q_pos: jax.Array, kv: Keys, C: int) -> jax.Array:
    return _forward(qg, q_seg, q_pos, kv, C)[0]


def blocks_of(x: jax.Array, C: int) -> jax.Array:
    """[B, n*C, ...] -> [n, B, C, ...]: the scan's per-block slices."""
    return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // C, C, *x.shape[2:]), 1, 0)


def unblocks(x: jax.Array) -> jax.Array:
    """[n, B, C, ...] -> [B, n*C, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _forward(qg: jax.Array, q_seg: jax.Array, q_pos: jax.Array, kv: Keys, C: int) -> tuple:
    """-> (output [B, T, K*G*E], lse [n, B, K, G*C], the probabilities [B, K, G*T, S] of a one-block call)."""
    if qg.shape[1] == C:
        out, lse, p = _block_forward(qg, q_seg, q_pos, kv)
        return out, lse[None], p

    def step(_: None, xs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[None, tuple]:
        return None, _block_forward(*xs, kv)[:2]

    _, (out, lse) = jax.lax.scan(step, None, (blocks_of(qg, C), blocks_of(q_seg, C), blocks_of(q_pos, C)))
    return unblocks(out), lse, None


def _fwd(qg: jax.Array, q_seg: jax.Array, q_pos: jax.Array, kv: Keys, C: int) -> tuple[jax.Array, tuple]:
    out, lse, p = _forward(qg, q_seg, q_pos, kv, C)
    return out, (qg, q_seg, q_pos, kv, out, lse, p)


def _bwd(C: int, res: tuple, d_out: jax.Array) -> tuple:
    qg, q_seg, q_pos, kv, out, lse, p = res
    if p is not None:
        dq, dk, dv, d_sink = _block_backward(qg, q_seg, q_pos, kv, out, d_out, lse[0], p)
    else:

        def step(carry: tuple, xs: tuple) -> tuple[tuple, jax.Array]:
            qb, qs, qp, ob, dob, lse_b = xs
            dq, dk, dv, d_sink = _block_backward(qb, qs, qp, kv, ob, dob, lse_b)
            return jax.tree.map(jnp.add, carry, (dk, dv, d_sink)), dq

        zeros = (jnp.zeros(kv.keys.shape, jnp.float32), jnp.zeros(kv.values.shape, jnp.float32))
        start = (*zeros, None if kv.sinks is None else jnp.zeros_like(kv.sinks))
        xs = (*(blocks_of(x, C) for x in (qg, q_seg, q_pos, out, d_out)), lse)
        (dk, dv, d_sink), dq = jax.lax.scan(step, start, xs)
        dq = unblocks(dq)
    d_kv = Keys(dk.astype(kv.keys.dtype), dv.astype(kv.values.dtype), None, None, None, d_sink, kv.keys_es)  # type: ignore[arg-type]
    return dq, None, None, d_kv


_attention.defvjp(_fwd, _bwd)


def _scores(qb: jax.Array, q_seg: jax.Array, q_pos: jax.Array, kv: Keys) -> tuple[jax.Array, jax.Array]:
    """qb [B, C, K, G, E] -> (qh [B, K, G*C, E], masked float32 scores [B, K, G*C, S])."""
    qh = stack_heads(qb)
    spec = "bkqe,bkes->bkqs" if kv.keys_es else "bkqe,bkse->bkqs"
    s = jnp.einsum(spec, qh, kv.keys, preferred_element_type=jnp.float32)
    return qh, s + mask_bias(AttentionMask(q_seg, kv.segments, q_pos, kv.positions), kv.window, qb.shape[3])


def stack_heads(qb: jax.Array) -> jax.Array:
    """Queries [B, C, K, G, E] -> [B, K, G*C, E]: a kv head's G query heads stacked along the query axis."""
    B, C, K, G, E = qb.shape
    return qb.transpose(0, 2, 3, 1, 4).reshape(B, K, G * C, E)


def mask_bias(mask: AttentionMask, window: jax.Array | None, G: int) -> jax.Array:
    """The additive mask of C queries over S keys, one row per stacked query head: [B, 1, G*C, S]."""
    return jnp.tile(jnp.where(mask.allowed(window), 0.0, NEG_INF), (1, G, 1))[:, None]


def heads_of(x: jax.Array, K: int, E: int) -> jax.Array:
    """[B, C, K*G*E] -> [B, K, G*C, E]."""
    B, C = x.shape[:2]
    return x.reshape(B, C, K, -1, E).transpose(0, 2, 3, 1, 4).reshape(B, K, -1, E)


def rows_of(x: jax.Array, G: int) -> jax.Array:
    """[B, K, G*C, E] -> [B, C, K, G, E]."""
    B, K, GC, E = x.shape
    return x.reshape(B, K, G, GC // G, E).transpose(0, 3, 1, 2, 4)


def sink_rows(sinks: jax.Array, C: int) -> jax.Array:
    """sinks [K, G] -> [1, K, G*C, 1], one per stacked query row."""
    return jnp.repeat(sinks, C, axis=-1)[None, :, :, None]


def sink_grad(sinks: jax.Array, lse: jax.Array, delta: jax.Array) -> jax.Array:
    """The sinks' gradient [K, G] from C queries' lse and delta [B, K, G*C]: each query's sink probability
    times (its value's zero product - delta)."""
    B, K, GC = lse.shape
    C = GC // sinks.shape[-1]
    p_sink = jnp.exp(sink_rows(sinks, C)[..., 0] - lse)
    return -(p_sink * delta).reshape(B, K, -1, C).sum((0, 3))


def _block_forward(qb: jax.Array, q_seg: jax.Array, q_pos: jax.Array, kv: Keys) -> tuple[jax.Array, ...]:
    """One block: -> (output [B, C, K*G*E], lse [B, K, G*C], probabilities [B, K, G*C, S])."""
    B, C, K, G, E = qb.shape
    _, s = _scores(qb, q_seg, q_pos, kv)
    sink = None if kv.sinks is None else sink_rows(kv.sinks, C)
    top = logit_top(s, -1, sink)
    p = jnp.exp(s - top)
    total = normaliser(p, -1, sink, top)
    p = p / total
    o = jnp.einsum("bkqs,bkse->bkqe", p.astype(kv.values.dtype), kv.values)
    return rows_of(o, G).reshape(B, C, K * G * E), (top + jnp.log(total))[..., 0], p


def _block_backward(
    qb: jax.Array,
    q_seg: jax.Array,
    q_pos: jax.Array,
    kv: Keys,
    ob: jax.Array,
    dob: jax.Array,
    lse: jax.Array,
    p: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """One block's gradients: -> (dq [B, C, K, G, E], dk, dv as keys and values (float32), d_sinks [K, G]).
    `p`: the block's probabilities when the forward kept them, else recomputed as exp(s - lse)."""
    B, C, K, G, E = qb.shape
    qh = stack_heads(qb)
    if p is None:
        qh, s = _scores(qb, q_seg, q_pos, kv)
        p = jnp.exp(s - lse[..., None])  # [B, K, G*C, S]
    do, o = heads_of(dob, K, E), heads_of(ob, K, E)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, K, G*C]
    dv = jnp.einsum("bkqs,bkqe->bkse", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkqe,bkse->bkqs", do, kv.values, preferred_element_type=jnp.float32)
    ds = (p * (dp - delta[..., None])).astype(qh.dtype)
    dq = jnp.einsum("bkqs,bkes->bkqe" if kv.keys_es else "bkqs,bkse->bkqe", ds, kv.keys)
    dk_spec = "bkqs,bkqe->bkes" if kv.keys_es else "bkqs,bkqe->bkse"
    dk = jnp.einsum(dk_spec, ds, qh, preferred_element_type=jnp.float32)
    d_sink = None if kv.sinks is None else sink_grad(kv.sinks, lse, delta)
    return rows_of(dq, G), dk, dv, d_sink
