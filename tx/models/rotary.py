"""Rotary position embeddings: the inverse frequencies (plain, Llama 3's piecewise scaling, linear, YaRN) and
the rotate-half rotation with a hand-written backward. Dimension letters as in `tx.models.layers`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tx.models.config_rope import RopeScaling


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """Inverse frequencies [E/2], with Llama 3's piecewise long-context scaling when configured."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_frequencies(inv, head_dim, theta, scaling)
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def _yarn_frequencies(inv: jax.Array, head_dim: int, theta: float, scaling: RopeScaling) -> jax.Array:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are interpolated
    (divided by `factor`), those turning more than `beta_fast` times kept, a linear ramp between."""

    def dim_of(turns: float) -> float:  # the frequency index turning `turns` times over the original context
        wavelengths = scaling.original_max_position_embeddings / (turns * 2 * math.pi)
        return head_dim * math.log(wavelengths) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inv / scaling.factor * ramp + inv * (1 - ramp)


@jax.custom_vjp
def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x [B, T, N, E], positions [B, T]: rotate-half RoPE as in the HF reference. A rotation, so its
    backward is the inverse rotation of the incoming gradient, recomputed from the positions (autodiff
    kept the cos/sin tables of every layer)."""
    cos, sin = _rope_tables(positions, inv_freq)
    return (x.astype(jnp.float32) * cos + _rotate_half(x).astype(jnp.float32) * sin).astype(x.dtype)


def _rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, E/2]
    angles = jnp.concatenate([angles, angles], -1)[:, :, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], -1)


def _apply_rope_fwd(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, tuple]:
    return apply_rope(x, positions, inv_freq), (positions, inv_freq)


def _apply_rope_bwd(res: tuple, dy: jax.Array) -> tuple[jax.Array, None, None]:
    positions, inv_freq = res
    cos, sin = _rope_tables(positions, inv_freq)
    d32, ds = dy.astype(jnp.float32), dy.astype(jnp.float32) * sin
    half = dy.shape[-1] // 2
    dx = d32 * cos + jnp.concatenate([ds[..., half:], -ds[..., :half]], -1)  # the transpose of rotate_half
    return dx.astype(dy.dtype), None, None  # the output's dtype, which is x's


apply_rope.defvjp(_apply_rope_fwd, _apply_rope_bwd)
