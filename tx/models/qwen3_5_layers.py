"""Qwen3.5's two token mixers: the Gated DeltaNet (`linear_attn`) and gated full attention (`self_attn`).

Attribute names are the checkpoint's (`linear_attn.in_proj_qkv`, `conv1d`, `A_log`, `dt_bias`, `norm`,
`out_proj`; `self_attn.q_proj` holding each head's query and output gate side by side), so loading needs
no renaming; every projection is a `LoRALinear`. Both accept a `stack` shape for the scanned decoder.
Letters as in `tx.models.layers` (B, T, D, H, K, E), and for the DeltaNet: C conv channels (q, k, v
concatenated), W conv kernel, N key heads, P value heads, M value head dim.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from tx.lora.layers import LoRALinear, LoRASpec
from tx.lora.params import LoRARows
from tx.models.attention import AttentionMask
from tx.models.attention_tiles import self_attention
from tx.models.cache import LinearState
from tx.models.config import ModelConfig
from tx.models.delta_rule import chunked_delta_rule, recurrent_delta_rule
from tx.models.layers import RMSNorm, cached_attention, rms_norm
from tx.models.rotary import apply_rope


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenFlags:
    """Per token of a packed row: `live` (not padding, segment != 0) and `resets` (the first token of a
    sequence that follows another in the row: recurrent and conv state start from zero there)."""

    live: jax.Array  # [B, T] bool
    resets: jax.Array  # [B, T] bool

    @staticmethod
    def of(segments: jax.Array) -> TokenFlags:
        previous = jnp.concatenate([segments[:, :1], segments[:, :-1]], axis=1)
        live = segments != 0
        return TokenFlags(live, live & (segments != previous))

    @property
    def runs(self) -> jax.Array:
        """[B, T] int32: tokens of one sequence share a run id; a call's first run continues its input state."""
        return jnp.cumsum(self.resets.astype(jnp.int32), axis=1)


def causal_conv(
    x_BTC: jax.Array, w_CW: jax.Array, flags: TokenFlags, window_BWC: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal convolution: y[t] = sum_j w[:, j] x[t - (W-1) + j], over inputs of the same sequence
    only (earlier positions come from `window` [B, W-1, C] for the call's first sequence). Returns y and the
    new window: the W-1 inputs up to the row's last live token, zero where they belong to another sequence."""
    B, T, _ = x_BTC.shape
    W = w_CW.shape[-1]
    runs = flags.runs
    xp = jnp.concatenate([window_BWC.astype(x_BTC.dtype), x_BTC], axis=1)  # [B, W-1+T, C]
    runp = jnp.concatenate([jnp.zeros((B, W - 1), runs.dtype), runs], axis=1)
    y = sum(jnp.where((runp[:, j : j + T] == runs)[..., None], xp[:, j : j + T], 0) * w_CW[:, j] for j in range(W))
    last_B = jnp.max(jnp.where(flags.live, jnp.arange(T), -1), axis=1)  # -1: no live token, keep the window
    index_BW = last_B[:, None] + 1 + jnp.arange(W - 1)  # positions in xp
    window = jnp.take_along_axis(xp, index_BW[..., None], axis=1)
    same = jnp.take_along_axis(runp, index_BW, axis=1) == jnp.take_along_axis(runp, index_BW[:, -1:], axis=1)
    return jnp.asarray(y), jnp.where(same[..., None], window, 0).astype(window_BWC.dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class Conv1d(nnx.Module):
    """The depthwise convolution's weight in the checkpoint's [C, 1, W] layout."""

    def __init__(self, channels: int, kernel: int, dtype: jnp.dtype, stack: tuple[int, ...]) -> None:
        axes = (*("layers",) * len(stack), "conv_channels", None, "conv_kernel")
        self.weight = nnx.Param(jnp.zeros((*stack, channels, 1, kernel), dtype), logical_axes=axes)


class GatedDeltaNet(nnx.Module):
    """HF's `linear_attn`: projections, causal conv + silu, the gated delta rule, gated RMSNorm, out_proj."""

    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None, stack: tuple[int, ...]) -> None:
        lin = cfg.linear
        assert lin is not None
        dt, D, P = jnp.dtype(cfg.dtype), cfg.hidden_size, lin.value_heads
        lead = ("layers",) * len(stack)
        self.in_proj_qkv = LoRALinear(
            D, lin.conv_dim, axes=("embed", "conv_channels"), dtype=dt, lora=lora, stack=stack
        )
        self.in_proj_z = LoRALinear(
            D, P * lin.value_head_dim, axes=("embed", "v_heads"), dtype=dt, lora=lora, stack=stack
        )
        self.in_proj_b = LoRALinear(D, P, axes=("embed", "v_heads"), dtype=dt, lora=lora, stack=stack)
        self.in_proj_a = LoRALinear(D, P, axes=("embed", "v_heads"), dtype=dt, lora=lora, stack=stack)
        self.conv1d = Conv1d(lin.conv_dim, lin.conv_kernel, dt, stack)
        self.A_log = nnx.Param(jnp.zeros((*stack, P), dt), logical_axes=(*lead, "v_heads"))
        self.dt_bias = nnx.Param(jnp.ones((*stack, P), dt), logical_axes=(*lead, "v_heads"))
        self.norm = RMSNorm(lin.value_head_dim, cfg.rms_norm_eps, dt, stack)
        self.out_proj = LoRALinear(
            P * lin.value_head_dim, D, axes=("v_heads", "embed"), dtype=dt, lora=lora, stack=stack
        )
        self.shape = lin

    def __call__(
        self, x: jax.Array, flags: TokenFlags, rows: LoRARows | None, state: LinearState
    ) -> tuple[jax.Array, LinearState]:
        """x [B, T, D] from `state` (one layer's) -> ([B, T, D], the state after the row's last live token)."""
        B, T, _ = x.shape
        lin = self.shape
        mixed, window = causal_conv(self.in_proj_qkv(x, rows), self.conv1d.weight[...][:, 0], flags, state.conv)
        q, k, v = jnp.split(
            jax.nn.silu(mixed), [lin.key_heads * lin.key_head_dim, 2 * lin.key_heads * lin.key_head_dim], -1
        )
        group = lin.value_heads // lin.key_heads  # each key head serves `group` consecutive value heads

        def heads(a: jax.Array) -> jax.Array:  # [B, T, N*E] -> [B, T, P, E] float32, unit length
            return jnp.repeat(l2_normalize(a.reshape(B, T, lin.key_heads, -1).astype(jnp.float32)), group, axis=2)

        live = flags.live[..., None]
        beta = jax.nn.sigmoid(self.in_proj_b(x, rows).astype(jnp.float32)) * live  # padding: no update, no decay
        a = self.in_proj_a(x, rows).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a) * live
        rule = recurrent_delta_rule if T == 1 else chunked_delta_rule
        v_BTPM = v.reshape(B, T, lin.value_heads, lin.value_head_dim)
        o, delta = rule(heads(q) / math.sqrt(lin.key_head_dim), heads(k), v_BTPM, g, beta, flags.resets, state.delta)
        z = self.in_proj_z(x, rows).reshape(v_BTPM.shape)
        gated = rms_norm(o.astype(x.dtype), self.norm.weight[...], self.norm.eps) * jax.nn.silu(z.astype(jnp.float32))
        return self.out_proj(gated.astype(x.dtype).reshape(B, T, -1), rows), LinearState(window, delta)


class GatedAttention(nnx.Module):
    """HF's `self_attn` of a Qwen3.5 full-attention layer: GQA whose output is gated per channel by
    sigmoid(gate), the gate read from the second half of each head's slice of q_proj; q/k RMSNorm
    (zero-centred) and rotary on the leading `rotary_dim` dims of each head."""

    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None, stack: tuple[int, ...]) -> None:
        dt = jnp.dtype(cfg.dtype)
        D, H, K, E = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = LoRALinear(D, 2 * H * E, axes=("embed", "q_heads"), dtype=dt, lora=lora, stack=stack)
        self.k_proj = LoRALinear(D, K * E, axes=("embed", "kv_heads"), dtype=dt, lora=lora, stack=stack)
        self.v_proj = LoRALinear(D, K * E, axes=("embed", "kv_heads"), dtype=dt, lora=lora, stack=stack)
        self.o_proj = LoRALinear(H * E, D, axes=("q_heads", "embed"), dtype=dt, lora=lora, stack=stack)
        self.q_norm = RMSNorm(E, cfg.rms_norm_eps, dt, stack, offset=1.0)
        self.k_norm = RMSNorm(E, cfg.rms_norm_eps, dt, stack, offset=1.0)
        self.heads, self.kv_heads, self.head_dim, self.rotary_dim = H, K, E, cfg.rotary_dim

    def project(
        self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array, rows: LoRARows | None
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """x [B, T, D] -> q [B, T, H, E], k, v [B, T, K, E] (normed, rotated), gate [B, T, H*E]."""
        B, T, _ = x.shape
        E = self.head_dim
        qg = self.q_proj(x, rows).reshape(B, T, self.heads, 2 * E)
        q, k = self.q_norm(qg[..., :E]), self.k_norm(self.k_proj(x, rows).reshape(B, T, self.kv_heads, E))
        v = self.v_proj(x, rows).reshape(B, T, self.kv_heads, E)
        return (
            self._rotate(q, positions, inv_freq),
            self._rotate(k, positions, inv_freq),
            v,
            qg[..., E:].reshape(B, T, -1),
        )

    def _rotate(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
        r = self.rotary_dim
        return jnp.concatenate([apply_rope(x[..., :r], positions, inv_freq), x[..., r:]], axis=-1)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segments: jax.Array, inv_freq: jax.Array, rows: LoRARows | None
    ) -> jax.Array:
        """Packed rows without a cache: each token sees its own segment's earlier tokens."""
        q, k, v, gate = self.project(x, positions, inv_freq, rows)
        B, T, H, E = q.shape
        qg = q.reshape(B, T, self.kv_heads, H // self.kv_heads, E) / math.sqrt(E)
        mask = AttentionMask(segments, segments, positions, positions)
        out = self_attention(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)
        return self.gated_output(out, gate, rows)

    def cached(
        self,
        x: jax.Array,
        positions: jax.Array,
        inv_freq: jax.Array,
        rows: LoRARows | None,
        k_cache: jax.Array,
        v_cache: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Tokens at consecutive positions from positions[:, 0] over the cache [B, S, K, E] of the earlier
        ones -> (output [B, T, D], this call's k and v [B, T, K, E] for the caller to write)."""
        q, k, v, gate = self.project(x, positions, inv_freq, rows)
        heads = cached_attention(q, k, v, k_cache, v_cache, positions[:, 0])
        return self.gated_output(heads, gate, rows), k, v

    def gated_output(self, out: jax.Array, gate: jax.Array, rows: LoRARows | None) -> jax.Array:
        """The heads' output [B, T, H*E] times sigmoid(gate), through o_proj."""
        gated = out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))
        return self.o_proj(gated.astype(out.dtype), rows)
