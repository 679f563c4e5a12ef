"""The blocks every model family shares: RMSNorm, GQA attention, SwiGLU MLP (rotary: `tx.models.rotary`).

Attribute names match the HF checkpoint (`self_attn.q_proj`, `mlp.gate_proj`, `q_norm`, ...), so weight
loading and PEFT export need no renaming table beyond transposes. Dimension letters: B batch, T query
length, S key length, D embed, H query heads, K kv heads, G = H / K, E head dim, F mlp, V vocab.
Layers accept a `stack` shape so the decoder can hold all layers in one scanned module.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from tx.lora.layers import LoRALinear, LoRASpec
from tx.lora.params import LoRARows
from tx.models.attention import AttentionMask, blocked_attention, in_window, logit_top, normaliser, query_block
from tx.models.attention_tiles import self_attention
from tx.models.config import ModelConfig
from tx.models.rotary import apply_rope
from tx.tuning import Tuning


class RMSNorm(nnx.Module):
    """`(offset + weight) * x / rms(x)`; Qwen3.5 stores its norms zero-centred (offset 1). Where the model's
    reference multiplies by the weight in float32 and rounds once (Qwen3.5's offset norms, gpt-oss:
    `f32_product`), so does this; Llama and Qwen3 round the normalised input to the dtype first."""

    def __init__(
        self,
        dim: int,
        eps: float,
        dtype: jnp.dtype,
        stack: tuple[int, ...] = (),
        offset: float = 0.0,
        f32_product: bool = False,
    ) -> None:
        self.weight = nnx.Param(jnp.ones((*stack, dim), dtype), logical_axes=(*("layers",) * len(stack), "norm"))
        self.eps, self.offset, self.f32_product = eps, offset, f32_product or bool(offset)

    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.weight[...]
        if self.f32_product:  # 1 + w rounded to bfloat16 lost the small weights' bits
            weight = weight.astype(jnp.float32) + self.offset
        return rms_norm(x, weight, self.eps, self.f32_product)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, f32_product: bool = False) -> jax.Array:
    """weight * x / sqrt(mean(x^2) + eps), normalised in float32, in x's dtype. Differentiated by hand from x
    and the per-token scale alone (autodiff kept the float32 copy and the normalised activations as well)."""
    return _rms_norm_fwd(x, weight, eps, f32_product)[0]


def _rms_norm_fwd(x: jax.Array, weight: jax.Array, eps: float, f32_product: bool) -> tuple[jax.Array, tuple]:
    x32 = x.astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if f32_product:
        return (weight.astype(jnp.float32) * (x32 * scale)).astype(x.dtype), (x, weight, scale)
    return weight * (x32 * scale).astype(x.dtype), (x, weight, scale)


def _rms_norm_bwd(eps: float, f32_product: bool, res: tuple, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, weight, scale = res
    normed = x.astype(jnp.float32) * scale
    d_normed = dy.astype(jnp.float32) * weight.astype(jnp.float32)
    dx = scale * (d_normed - normed * jnp.mean(d_normed * normed, axis=-1, keepdims=True))
    lead = tuple(range(dy.ndim - weight.ndim))
    d_weight = jnp.sum(dy.astype(jnp.float32) * normed, axis=lead)
    return dx.astype(x.dtype), d_weight.astype(weight.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class Attention(nnx.Module):
    """GQA attention; with `cfg.attention_bias` its projections have biases, with `cfg.attention_sinks` a
    learned logit per head (`sinks` [H]) joins each softmax, and YaRN's attention factor scales the scores.
    The attend methods take an optional `window`: a sliding-window layer's width (a traced scalar, so one
    scanned layer body serves sliding and full layers)."""

    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None, stack: tuple[int, ...], tuning: Tuning) -> None:
        dt = jnp.dtype(cfg.dtype)
        D, H, K, E = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rows = tuning.weight_major_rows
        make = functools.partial(
            LoRALinear, dtype=dt, lora=lora, stack=stack, weight_major_rows=rows, bias=cfg.attention_bias
        )
        self.q_proj = make(D, H * E, axes=("embed", "q_heads"))
        self.k_proj = make(D, K * E, axes=("embed", "kv_heads"))
        self.v_proj = make(D, K * E, axes=("embed", "kv_heads"))
        self.o_proj = make(H * E, D, axes=("q_heads", "embed"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(E, cfg.rms_norm_eps, dt, stack)
            self.k_norm = RMSNorm(E, cfg.rms_norm_eps, dt, stack)
        if cfg.attention_sinks:
            lead = ("layers",) * len(stack)
            self.sinks = nnx.Param(jnp.zeros((*stack, H), dt), logical_axes=(*lead, "q_heads"))
        self.heads, self.kv_heads, self.head_dim = H, K, E
        # YaRN scales cos and sin, so each of q and k, by its factor: the scores by its square.
        self.score_scale = (cfg.rope_scaling.attention_factor if cfg.rope_scaling else 1.0) ** 2 / math.sqrt(E)

    def project_qkv(
        self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array, rows: LoRARows | None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        B, T, _ = x.shape
        q = self.q_proj(x, rows).reshape(B, T, self.heads, self.head_dim)
        k = self.k_proj(x, rows).reshape(B, T, self.kv_heads, self.head_dim)
        v = self.v_proj(x, rows).reshape(B, T, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def _sinks(self) -> jax.Array | None:
        """The sink logits as [K, G] (float32), None without."""
        if not hasattr(self, "sinks"):
            return None
        return self.sinks[...].astype(jnp.float32).reshape(self.kv_heads, self.heads // self.kv_heads)

    def attend(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        mask: AttentionMask,
        rows: LoRARows | None,
        window: jax.Array | None = None,
    ) -> jax.Array:
        """q [B, T, H, E] against k, v [B, S, K, E] -> o_proj output [B, T, D]."""
        B, T, H, E = q.shape
        K = self.kv_heads
        qg = q.reshape(B, T, K, H // K, E)
        sinks = self._sinks()
        if T == 1:  # decode: a streaming multiply-and-sum over the cache beats XLA CPU's tiny batched GEMMs
            allowed = mask.allowed(window)
            scores = jnp.sum(qg[:, 0, None].astype(jnp.float32) * k[:, :, :, None, :], axis=-1)  # [B, S, K, G]
            scores = jnp.where(allowed[:, 0, :, None, None], scores * self.score_scale, jnp.finfo(jnp.float32).min)
            sink = None if sinks is None else sinks[None, None]
            top = logit_top(scores, 1, sink)
            p = jnp.exp(scores - top)
            probs = (p / normaliser(p, 1, sink, top)).astype(v.dtype)
            out = jnp.sum(probs[..., None] * v[:, :, :, None, :], axis=1).reshape(B, 1, H * E)
            return self.o_proj(out, rows)
        kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, E]
        out = self_attention(qg * self.score_scale, kh, vh, mask, window, sinks)
        return self.o_proj(out, rows)

    def attend_written(
        self,
        q: jax.Array,
        k_cache: jax.Array,
        v_cache: jax.Array,
        positions: jax.Array,
        rows: LoRARows | None,
        window: jax.Array | None = None,
    ) -> jax.Array:
        """Attention over a cache that already holds this call's keys: q [B, T, H, E] at `positions` [B, T]
        sees cache positions <= its own (keys [B, K, E, S], values [B, K, S, E]; later positions are stale)."""
        B, T, H, E = q.shape
        K = self.kv_heads
        qg = (q.reshape(B, T, K, H // K, E) * self.score_scale).astype(jnp.float32)
        mask = AttentionMask.of_cache(positions, k_cache.shape[-1])
        sinks = self._sinks()
        if T == 1:  # decode: multiply-and-sum streams the cache (XLA CPU's tiny batched GEMMs are slower)
            seen = mask.allowed(window)  # [B, T, S]
            s = jnp.sum(qg[:, 0, :, :, :, None] * k_cache[:, :, None], axis=-2)  # [B, K, G, S]
            s = jnp.where(seen[:, 0, None, None, :], s, jnp.finfo(jnp.float32).min)
            sink = None if sinks is None else sinks[None, :, :, None]
            top = logit_top(s, -1, sink)
            p = jnp.exp(s - top)
            num = jnp.sum(p[..., None] * v_cache[:, :, None], axis=-2)  # [B, K, G, E]
            out = (num / normaliser(p, -1, sink, top)).astype(v_cache.dtype).reshape(B, 1, H * E)
            return self.o_proj(out, rows)
        out = blocked_attention(qg, k_cache, v_cache, mask, window, sinks, keys_es=True)  # prefill
        return self.o_proj(out, rows)

    def attend_cached(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        k_cache: jax.Array,
        v_cache: jax.Array,
        start: jax.Array,
        rows: LoRARows | None,
        window: jax.Array | None = None,
    ) -> jax.Array:
        """`cached_attention` through o_proj."""
        heads = cached_attention(
            q, k, v, k_cache, v_cache, start, self._sinks(), window, self.score_scale * math.sqrt(self.head_dim)
        )
        return self.o_proj(heads, rows)


def cached_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    start: jax.Array,
    sinks: jax.Array | None = None,
    window: jax.Array | None = None,
    score_factor: float = 1.0,
) -> jax.Array:
    """Attention of this call's queries over the cache's earlier positions and this call's own keys.

    q [B, T, H, E]; k, v [B, T, K, E] for positions start[b] + 0..T-1; k_cache, v_cache [B, S, K, E]
    hold positions < start[b] (later cache positions are stale and masked) -> the heads' output
    [B, T, H*E]. The two blocks are combined with one softmax, so the cache is read, never copied, and
    written once per call by the caller. `sinks` [K, G], `window`: as in `Attention`; `score_factor`
    multiplies the usual 1/sqrt(E) (YaRN). A call whose scores would not fit `SCORE_BLOCK_BYTES` runs in
    blocks of queries (`tx.models.attention.query_block`).
    """
    B, T, H, E = q.shape
    K = k.shape[2]
    qg = (q.reshape(B, T, K, H // K, E) * (score_factor / math.sqrt(E))).astype(jnp.float32)
    low = jnp.finfo(jnp.float32).min
    key_at = jnp.arange(k_cache.shape[1])[None, None, :]  # [1, 1, S]
    query_at = start[:, None] + jnp.arange(T)[None, :]  # [B, T]
    old = (key_at < start[:, None, None]) & in_window(query_at[:, :, None], key_at, window)  # [B, T, S]
    if T == 1:  # decode: streaming multiply-and-sum beats XLA CPU's tiny batched GEMMs
        s_old = jnp.sum(qg[:, 0, None] * k_cache[:, :, :, None, :], axis=-1)  # [B, S, K, G]
        s_old = jnp.where(old[:, 0, :, None, None], s_old, low)
        s_new = jnp.sum(qg[:, 0] * k[:, 0, :, None, :], axis=-1)[:, None]  # [B, 1, K, G]
        top = jnp.maximum(s_old.max(axis=1, keepdims=True), s_new)
        sink = None if sinks is None else sinks[None, None]
        top = top if sink is None else jnp.maximum(top, sink)
        p_old, p_new = jnp.exp(s_old - top), jnp.exp(s_new - top)
        denom = (normaliser(p_old, 1, sink, top) + p_new)[:, 0]  # [B, K, G]
        num = jnp.sum(p_old[..., None] * v_cache[:, :, :, None, :], axis=1) + p_new[:, 0, ..., None] * v[:, 0, :, None]
        return (num / denom[..., None]).astype(v.dtype).reshape(B, 1, H * E)
    C = query_block(B, H, T, k_cache.shape[1] + T)
    if C >= T:
        out = _cached_block(qg, jnp.arange(T), old, k, v, k_cache, v_cache, sinks, window)
        return out.reshape(B, T, H * E)
    # A long call in query blocks (a scan: forward only, nothing kept), each block's scores within the budget.
    n = -(-T // C)
    pad = ((0, 0), (0, n * C - T))
    old = jnp.broadcast_to(old, (B, T, k_cache.shape[1]))  # [B, 1, S] without a window
    blocks = (
        jnp.moveaxis(jnp.pad(qg, (*pad, (0, 0), (0, 0), (0, 0))).reshape(B, n, C, K, H // K, E), 1, 0),
        jnp.arange(n * C).reshape(n, C),
        jnp.moveaxis(jnp.pad(old, (*pad, (0, 0))).reshape(B, n, C, -1), 1, 0),
    )

    def block(x: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        return _cached_block(x[0], x[1], x[2], k, v, k_cache, v_cache, sinks, window)

    out = jax.lax.map(block, blocks)
    return jnp.moveaxis(out, 0, 1).reshape(B, n * C, H * E)[:, :T]


def _cached_block(
    qg: jax.Array,
    own_C: jax.Array,
    old: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    sinks: jax.Array | None,
    window: jax.Array | None,
) -> jax.Array:
    """`cached_attention` for queries qg [B, C, K, G, E] at call indices `own_C` [C] -> [B, C, K, G, E]:
    over the cache where `old` [B, C, S] allows, and over the call's own keys up to its index."""
    low = jnp.finfo(jnp.float32).min
    s_old = jnp.einsum("btkge,bske->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    s_old = jnp.where(old[:, None, None], s_old, low)
    s_new = jnp.einsum("btkge,bske->bkgts", qg, k, preferred_element_type=jnp.float32)
    own = jnp.arange(k.shape[1])
    causal = (own[None, :] <= own_C[:, None]) & in_window(own_C[:, None], own[None, :], window)
    s_new = jnp.where(causal, s_new, low)
    sink = None if sinks is None else sinks[None, :, :, None, None]
    top = logit_top(jnp.maximum(s_old.max(-1, keepdims=True), s_new.max(-1, keepdims=True)), -1, sink)
    p_old, p_new = jnp.exp(s_old - top), jnp.exp(s_new - top)
    denom = normaliser(p_old, -1, sink, top)[..., 0] + p_new.sum(-1)  # [B, K, G, C]
    num = jnp.einsum("bkgts,bske->bkgte", p_old, v_cache) + jnp.einsum("bkgts,bske->bkgte", p_new, v)
    return (num / denom[..., None]).astype(v.dtype).transpose(0, 3, 1, 2, 4)


class MLP(nnx.Module):
    def __init__(
        self, cfg: ModelConfig, lora: LoRASpec | None, stack: tuple[int, ...], tuning: Tuning, size: int = 0
    ) -> None:
        """`size`: the width F (default `cfg.intermediate_size`; a MoE's shared expert has its own)."""
        dt = jnp.dtype(cfg.dtype)
        D, F = cfg.hidden_size, size or cfg.intermediate_size
        rows = tuning.weight_major_rows
        make = functools.partial(LoRALinear, dtype=dt, lora=lora, stack=stack, weight_major_rows=rows)
        self.gate_proj = make(D, F, axes=("embed", "mlp"))
        self.up_proj = make(D, F, axes=("embed", "mlp"))
        self.down_proj = make(F, D, axes=("mlp", "embed"))

    def __call__(self, x: jax.Array, rows: LoRARows | None) -> jax.Array:
        return self.down_proj(swiglu(self.gate_proj(x, rows), self.up_proj(x, rows)), rows)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up, differentiated from its two inputs alone: the backward pass recomputes the
    sigmoid instead of keeping it, so a training step stores two [tokens, F] activations per layer where
    autodiff of the plain expression kept five (each copied into the layer scan's stacked residuals)."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate: jax.Array, up: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res: tuple[jax.Array, jax.Array], d: jax.Array) -> tuple[jax.Array, jax.Array]:
    gate, up = res
    g32 = gate.astype(jnp.float32)
    sig = jax.nn.sigmoid(g32)
    d32 = d.astype(jnp.float32)
    d_gate = d32 * up.astype(jnp.float32) * sig * (1.0 + g32 * (1.0 - sig))
    d_up = d32 * g32 * sig
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
