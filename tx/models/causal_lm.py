"""Decoder-only causal LM (Qwen3, Llama 3) as one Flax NNX definition with scanned layers.

All decoder layers live in one `DecoderLayer` whose weights carry a leading layer axis; the forward
pass scans over it, so compile time does not grow with depth. The module tree mirrors the HF
checkpoint (`model.embed_tokens`, `model.layers.*`, `model.norm`, `lm_head`). Callers pass positions,
segment ids (packed rows: attention stays inside a segment, positions restart) and per-row adapter
slots explicitly; with a `KVCache`, a call's tokens occupy consecutive positions from `positions[:, 0]`:
they attend to the cache's earlier positions and to each other, and their keys/values are written into
the fixed-shape cache once, after the layer scan (prefill and decode are the same code path).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tx.lora.kernels import lora_delta
from tx.lora.layers import LoRASpec, lora_pair
from tx.lora.params import LoRARows
from tx.models.config import ModelConfig
from tx.models.layers import MLP, Attention, AttentionMask, RMSNorm, rope_frequencies


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Preallocated keys and values, [L, B, S, K, E] each."""

    k: jax.Array
    v: jax.Array

    @staticmethod
    def zeros(cfg: ModelConfig, batch: int, length: int) -> KVCache:
        shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
        return KVCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None, stack: tuple[int, ...]) -> None:
        dt = jnp.dtype(cfg.dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, stack)
        self.self_attn = Attention(cfg, lora, stack)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, stack)
        self.mlp = MLP(cfg, lora, stack)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        segments: jax.Array,
        inv_freq: jax.Array,
        rows: LoRARows | None,
        cache: tuple[jax.Array, jax.Array, jax.Array] | None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """With `cache` = (k, v [L, B, S, K, E], this layer's index), read only: returns this call's (k, v)."""
        q, k, v = self.self_attn.project_qkv(self.input_layernorm(x), positions, inv_freq, rows)
        if cache is None:
            mask = AttentionMask(segments, segments, positions, positions)
            x = x + self.self_attn.attend(q, k, v, mask, rows)
            new = None
        else:
            k_all, v_all, layer = cache
            x = x + self.self_attn.attend_cached(q, k, v, k_all[layer], v_all[layer], positions[:, 0], rows)
            new = (k, v)
        x = x + self.mlp(self.post_attention_layernorm(x), rows)
        return x, new


def _write_cache(cache: KVCache, k: jax.Array, v: jax.Array, positions: jax.Array) -> KVCache:
    """Scatter a call's new keys/values [L, B, T, K, E] into the cache at `positions` [B, T], once for all
    layers; positions past the cache length are dropped."""
    row = jnp.arange(k.shape[1])[:, None]
    k_all = cache.k.at[:, row, positions].set(k.astype(cache.k.dtype), mode="drop")
    v_all = cache.v.at[:, row, positions].set(v.astype(cache.v.dtype), mode="drop")
    return KVCache(k_all, v_all)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.zeros((vocab, dim), dtype), logical_axes=("vocab", "embed"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0)


class Model(nnx.Module):
    """HF's `model.*` subtree: embeddings, the stacked decoder layers, the final norm."""

    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None) -> None:
        dt = jnp.dtype(cfg.dtype)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dt)
        self.layers = DecoderLayer(cfg, lora, (cfg.num_layers,))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)


class LMHead(nnx.Module):
    """The unembedding: its own [V, D] weight, or the embedding matrix when tied; an adapter either way."""

    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None) -> None:
        if not cfg.tie_word_embeddings:
            shape = (cfg.vocab_size, cfg.hidden_size)
            self.weight = nnx.Param(jnp.zeros(shape, cfg.dtype), logical_axes=("vocab", "embed"))
        if lora is not None:
            self.lora_a, self.lora_b = lora_pair(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), lora, ())
            self.kernel_form = lora.kernel

    def __call__(self, h: jax.Array, embedding: jax.Array, rows: LoRARows | None) -> jax.Array:
        weight = self.weight[...] if hasattr(self, "weight") else embedding  # tied: the [V, D] embedding itself
        logits = jnp.einsum("btd,vd->btv", h, weight, preferred_element_type=jnp.float32)
        if rows is not None and hasattr(self, "lora_a"):
            logits = logits + lora_delta(h, rows, self.lora_a[...], self.lora_b[...], self.kernel_form)
        return logits


class CausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None = None, remat: bool = False) -> None:
        self.config = cfg
        self.model = Model(cfg, lora)
        self.lm_head = LMHead(cfg, lora)
        self.remat = remat

    def hidden(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segments: jax.Array | None = None,
        rows: LoRARows | None = None,
        cache: KVCache | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """tokens, positions [B, T] -> final normed hidden states [B, T, D] (and the updated cache)."""
        cfg = self.config
        inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        segments = jnp.ones_like(tokens) if segments is None else segments
        graphdef, stacked = nnx.split(self.model.layers)

        def body(carry: tuple, layer_state: nnx.State) -> tuple[tuple, tuple | None]:
            h, layer = carry
            read = None if cache is None else (cache.k, cache.v, layer)
            h, new = nnx.merge(graphdef, layer_state)(h, positions, segments, inv_freq, rows, read)
            return (h, layer + 1), new

        if self.remat:
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
        h = self.model.embed_tokens(tokens)
        # Layers index the (loop-invariant) cache in place; the call's new keys/values come out stacked
        # [L, B, T, K, E] and are written once, after the scan.
        (h, _), new = jax.lax.scan(body, (h, jnp.int32(0)), stacked)
        if cache is not None and new is not None:
            cache = _write_cache(cache, new[0], new[1], positions)
        return self.model.norm(h), cache

    def logits(self, h: jax.Array, rows: LoRARows | None = None) -> jax.Array:
        """[B, T, D] hidden -> [B, T, V] float32 logits."""
        return self.lm_head(h, self.model.embed_tokens.weight[...], rows)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segments: jax.Array | None = None,
        rows: LoRARows | None = None,
        cache: KVCache | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        h, cache = self.hidden(tokens, positions, segments, rows, cache)
        return self.logits(h, rows), cache


def abstract_model(cfg: ModelConfig, lora: LoRASpec | None = None, remat: bool = False) -> CausalLM:
    """The model's structure with shapes only: weights are filled by the loader, never initialised."""
    return nnx.eval_shape(lambda: CausalLM(cfg, lora, remat))
