"""The gated delta rule of Gated DeltaNet layers, recurrent (reference, decode) and chunked (training, prefill).

Per head, a state matrix S [E, M] is decayed and corrected once per token t:
    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
with q, k already L2-normalised (q also scaled by 1/sqrt(E)), g_t <= 0 the log decay and beta_t in (0, 1).

The chunked form computes the same thing exactly (up to float rounding) with matrix products: inside a chunk
of C tokens the corrections d = beta (v - S^T k) satisfy a unit lower-triangular system (the WY form of
DeltaNet), solved once per chunk by a blocked inverse made of matrix products; the state then crosses
chunk boundaries in a scan. Cost is linear in the length, and each scan step holds only one chunk's
[C, C] and [C, E + M] blocks (the step is rematerialised in the backward pass, so the residuals are the
chunk inputs and one state per chunk).

Packed rows: `resets` [B, T] marks tokens that start a new sequence; the state is zeroed before them. Padding
is made neutral by the caller (beta = 0 and g = 0 leave the state unchanged). Letters: B batch, T length,
N chunks, C chunk length, H heads, E key dim, M value dim (S is [E, M]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Tokens per chunk. The work inside a chunk grows with C (its [C, C] products, the C^3 inverse), the work across
# chunks does not. Measured (CPU, 2 cores, float32, forward + backward, B x T x heads x dim): 8 x 256 x 8 x 64
# 50 ms at C = 64, 41-44 ms at 32, 43 ms at 16, 82 ms at 128; 2 x 512 x 32 x 128 194 -> 185 ms from 64 to
# 32; the forward alone 14.2 -> 11.7 ms and its compile 1.18 -> 0.91 s; a qwen3.5-small LoRA step ~4% faster.
CHUNK = 32


def recurrent_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, resets: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """q, k [B, T, H, E], v [B, T, H, M], g, beta [B, T, H], resets [B, T], state [B, H, E, M] float32
    -> (outputs [B, T, H, M] float32, final state), one token at a time."""

    def step(S_BHEM: jax.Array, x: tuple) -> tuple[jax.Array, jax.Array]:
        q_BHE, k_BHE, v_BHM, g_BH, beta_BH, reset_B = x
        S_BHEM = jnp.where(reset_B[:, None, None, None], 0.0, S_BHEM) * jnp.exp(g_BH)[..., None, None]
        d_BHM = beta_BH[..., None] * (v_BHM - jnp.einsum("bhem,bhe->bhm", S_BHEM, k_BHE))
        S_BHEM = S_BHEM + k_BHE[..., None] * d_BHM[..., None, :]
        return S_BHEM, jnp.einsum("bhem,bhe->bhm", S_BHEM, q_BHE)

    xs = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g, beta)) + (resets.T,)
    state, o_TBHM = jax.lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(o_TBHM, 0, 1), state


def chunked_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    resets: jax.Array,
    state: jax.Array,
    chunk: int = CHUNK,
) -> tuple[jax.Array, jax.Array]:
    """The same arguments and result as `recurrent_delta_rule`, computed chunk by chunk."""
    B, T, H, E = k.shape
    C = min(chunk, T)
    pad = -T % C
    run_BT = jnp.cumsum(resets.astype(jnp.int32), axis=1)  # tokens of one sequence share a run id
    run_BT = jnp.pad(run_BT, ((0, 0), (0, pad)), mode="edge")  # padding continues the last run, neutrally
    inputs = [jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta)]
    xs = [_chunks(x, C) for x in (*inputs, run_BT)]
    body = jax.checkpoint(_chunk_step, prevent_cse=False)
    (state, _), o_NBCHM = jax.lax.scan(body, (state.astype(jnp.float32), jnp.zeros((B,), jnp.int32)), xs)
    o_BTHM = jnp.moveaxis(o_NBCHM, 0, 1).reshape(B, T + pad, H, -1)
    return o_BTHM[:, :T], state


def _chunks(x: jax.Array, C: int) -> jax.Array:
    """[B, T, ...] -> [N, B, C, ...] (chunks leading, for the scan)."""
    return jnp.moveaxis(x.reshape(x.shape[0], -1, C, *x.shape[2:]), 1, 0)


def _chunk_step(carry: tuple[jax.Array, jax.Array], x: tuple) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """One chunk: S [B, H, E, M] and the run id of the previous chunk's last token -> the next, and outputs."""
    S_BHEM, run_prev_B = carry
    q, k, v, g, beta = (jnp.moveaxis(a, 2, 1) for a in x[:5])  # heads first: [B, H, C, ...]
    run_BC = x[5]
    cum_BHC = jnp.cumsum(g, axis=-1)  # log decay from the chunk start to each token, inclusive
    same_BCC = (run_BC[:, :, None] == run_BC[:, None, :]) & jnp.tril(jnp.ones(run_BC.shape[1:] * 2, bool))
    decay_BHCC = jnp.exp(jnp.where(same_BCC[:, None], cum_BHC[..., :, None] - cum_BHC[..., None, :], -jnp.inf))
    from_state_BHC = (run_BC == run_prev_B[:, None])[:, None] * jnp.exp(cum_BHC)  # 0 once a reset intervenes
    d_BHCM = _corrections(k, v, beta, decay_BHCC, from_state_BHC, S_BHEM)
    qk_BHCC = jnp.einsum("bhie,bhje->bhij", q, k) * decay_BHCC
    o_BHCM = jnp.einsum("bhc,bhce,bhem->bhcm", from_state_BHC, q, S_BHEM) + qk_BHCC @ d_BHCM
    last_BC = run_BC == run_BC[:, -1:]  # tokens whose corrections reach the chunk's final state
    to_end_BHC = last_BC[:, None] * jnp.exp(cum_BHC[..., -1:] - cum_BHC)
    S_BHEM = from_state_BHC[..., -1, None, None] * S_BHEM + jnp.einsum("bhc,bhce,bhcm->bhem", to_end_BHC, k, d_BHCM)
    return (S_BHEM, run_BC[:, -1]), jnp.moveaxis(o_BHCM, 1, 2)


def _corrections(
    k: jax.Array, v: jax.Array, beta: jax.Array, decay_BHCC: jax.Array, from_state_BHC: jax.Array, S_BHEM: jax.Array
) -> jax.Array:
    """The chunk's corrections d [B, H, C, M] from (I + A) d = beta (v - from_state * k S), where
    A[i, j] = beta_i (k_i . k_j) decay[i, j] for j < i carries the earlier corrections of the chunk."""
    C = k.shape[2]
    strict_CC = jnp.tril(jnp.ones((C, C), bool), -1)
    A_BHCC = jnp.where(strict_CC, beta[..., None] * jnp.einsum("bhie,bhje->bhij", k, k) * decay_BHCC, 0.0)
    rhs_BHCM = beta[..., None] * (v - from_state_BHC[..., None] * jnp.einsum("bhce,bhem->bhcm", k, S_BHEM))
    return unit_lower_inverse(A_BHCC) @ rhs_BHCM


BASE = 8  # diagonal blocks inverted by substitution; larger blocks are joined by matrix products


def unit_lower_inverse(A: jax.Array) -> jax.Array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], by blocks: the 8x8 diagonal blocks by
    forward substitution, then pairs of inverted blocks joined as [[X, 0], [-Y L21 X, Y]] until the whole.
    All matrix products: XLA:CPU's batched `solve_triangular` took 101 ms for a [4, 8, 64, 64] system with
    128 right-hand sides, this 1.3 ms (a training step's delta rule was 10x slower than the recurrence)."""
    C = A.shape[-1]
    n = max(BASE, 1 << (C - 1).bit_length())
    A = jnp.pad(A, [(0, 0)] * (A.ndim - 2) + [(0, n - C), (0, n - C)])  # zero rows and columns: identity there
    inv, size = _substitute(_diagonal_blocks(A, BASE)), BASE
    while size < n:
        lower = _diagonal_blocks(A, 2 * size)[..., size:, :size]
        first, second = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        top = jnp.concatenate([first, jnp.zeros_like(first)], -1)
        inv, size = jnp.concatenate([top, jnp.concatenate([-second @ lower @ first, second], -1)], -2), 2 * size
    return inv[..., 0, :C, :C]


def _diagonal_blocks(A: jax.Array, size: int) -> jax.Array:
    """[..., n, n] -> its diagonal blocks [..., n / size, size, size]."""
    m = A.shape[-1] // size
    blocks = A.reshape(*A.shape[:-2], m, size, m, size)
    return jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)


def _substitute(A: jax.Array) -> jax.Array:
    """(I + A)^-1 of small strictly lower blocks [..., b, b], one row at a time (unrolled)."""
    b = A.shape[-1]
    eye = jnp.eye(b, dtype=A.dtype)
    rows = [jnp.broadcast_to(eye[0], A.shape[:-1])]
    for i in range(1, b):
        rows.append(eye[i] - jnp.einsum("...j,...jk->...k", A[..., i, :i], jnp.stack(rows, -2)))
    return jnp.stack(rows, -2)
