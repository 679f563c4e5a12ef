"""Decoder-only causal LM (Qwen3, Llama 3, Qwen3-MoE, gpt-oss) as one Flax NNX definition with scanned layers.

All decoder layers live in one `DecoderLayer` whose weights carry a leading layer axis; the forward
pass scans over it, so compile time does not grow with depth. The module tree mirrors the HF
checkpoint (`model.embed_tokens`, `model.layers.*`, `model.norm`, `lm_head`). Callers pass positions,
segment ids (packed rows: attention stays inside a segment, positions restart) and per-row adapter
slots explicitly; with a `KVCache`, a call's tokens occupy consecutive positions from `positions[:, 0]`:
they attend to the cache's earlier positions and to each other, and their keys/values are written into
the fixed-shape cache once, after the layer scan (prefill and decode are the same code path).
Qwen3-MoE differs from Qwen3 only in its MLP, the routed `tx.models.moe.SparseMoeBlock` in every layer
(or, with dense layers, `tx.models.mixed_mlp.MixedMLP`, still one layer body);
gpt-oss too, and in its attention (biases, sinks, YaRN: `tx.models.layers.Attention`), whose sliding-window
layers take their window as a per-layer value of the scan (`layer_windows`), so one layer body serves both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from tx.lora.kernels import lora_delta
from tx.lora.layers import LoRASpec, linear, lora_pair
from tx.lora.params import AdapterRoles, LoRARows
from tx.models.attention import AttentionMask
from tx.models.cache import KVCache, LayerCache, storable
from tx.models.config import ModelConfig
from tx.models.layers import MLP, Attention, RMSNorm
from tx.models.mixed_mlp import MixedMLP, Placement
from tx.models.moe import SparseMoeBlock
from tx.models.rotary import rope_frequencies
from tx.tuning import Tuning, for_backend

CacheT = TypeVar("CacheT", KVCache, LayerCache)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None, stack: tuple[int, ...], tuning: Tuning) -> None:
        dt = jnp.dtype(cfg.dtype)
        f32 = cfg.family == "gpt_oss"  # its norms multiply in float32 and round once (`RMSNorm`)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, stack, f32_product=f32)
        self.self_attn = Attention(cfg, lora, stack, tuning)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, stack, f32_product=f32)
        if cfg.dense_mlp_layers:  # Qwen3-MoE with dense layers: one `mlp` holding both kinds' stacks
            self.mlp: MLP | SparseMoeBlock = MixedMLP(cfg, lora, tuning)
        elif cfg.moe:
            self.mlp = SparseMoeBlock(cfg, lora, stack, tuning)
        else:
            self.mlp = MLP(cfg, lora, stack, tuning)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        segments: jax.Array,
        inv_freq: jax.Array,
        rows: LoRARows | None,
        cache: tuple[KVCache | LayerCache, jax.Array | int] | None,
        window: jax.Array | None = None,
        mlp_at: tuple[jax.Array | bool, jax.Array | None] | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, jax.Array | None]:
        """Returns (x, cache part, the experts each token picked [B*T, k], None for a dense MLP).
        With `cache` = (a `KVCache`, this layer's index), read only: the cache part is this call's (k, v).
        With `cache` = (a `LayerCache`, this layer's index): writes this call's keys and values into the
        layer's buffers first, attends over them, and returns the updated buffers. Writing first makes the
        read depend on the write, so XLA updates the buffers in place (a read-then-write order made it copy
        every layer's cache twice per decode step). `window`: this layer's sliding window (None: attends fully).
        `mlp_at`: a `MixedMLP`'s (is this layer sparse, its rank among its kind; None when the MLP holds this
        layer's weights alone)."""
        q, k, v = self.self_attn.project_qkv(self.input_layernorm(x), positions, inv_freq, rows)
        if cache is None:
            mask = AttentionMask(segments, segments, positions, positions)
            x = x + self.self_attn.attend(q, k, v, mask, rows, window)
            new = None
        elif isinstance(cache[0], LayerCache):
            own, layer = cache[0], cache[1]
            assert isinstance(layer, int)
            k_old, v_old = own.k[layer], own.v[layer]
            row = jnp.arange(k.shape[0])[:, None]  # k, v [B, T, K, E] into keys [B, K, E, S], values [B, K, S, E]
            k_own = k_old.at[row, :, :, positions].set(storable(k, k_old.dtype), mode="drop")
            v_own = v_old.at[row, :, positions].set(storable(v, v_old.dtype), mode="drop")
            x = x + self.self_attn.attend_written(q, k_own, v_own, positions, rows, window)
            new = (k_own, v_own)
        else:
            full, layer = cache
            k_in, v_in = full.k[layer], full.v[layer]
            x = x + self.self_attn.attend_cached(q, k, v, k_in, v_in, positions[:, 0], rows, window)
            new = (k, v)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MixedMLP):
            assert mlp_at is not None
            out, picks = self.mlp.mix_at(h, rows, *mlp_at)
        elif isinstance(self.mlp, SparseMoeBlock):
            out, picks = self.mlp.mix(h, rows)
        else:
            out, picks = self.mlp(h, rows), None
        return x + out, new, picks


def layer_windows(cfg: ModelConfig) -> jax.Array | None:
    """Each layer's sliding window [L] int32, a full layer's larger than any position; None without any."""
    if not cfg.sliding_layers:
        return None
    full = 2**30
    return jnp.asarray([cfg.sliding_window if i in cfg.sliding_layers else full for i in range(cfg.num_layers)])


def _write_cache(cache: KVCache, k: jax.Array, v: jax.Array, positions: jax.Array) -> KVCache:
    """Scatter a call's new keys/values [L, B, T, K, E] into the cache at `positions` [B, T], once for all
    layers; positions past the cache length are dropped."""
    row = jnp.arange(k.shape[1])[:, None]
    k_all = cache.k.at[:, row, positions].set(storable(k, cache.k.dtype), mode="drop")
    v_all = cache.v.at[:, row, positions].set(storable(v, cache.v.dtype), mode="drop")
    return KVCache(k_all, v_all)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.zeros((vocab, dim), dtype), logical_axes=("vocab", "embed"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0)


class Model(nnx.Module):
    """HF's `model.*` subtree: embeddings, the stacked decoder layers, the final norm."""

    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None, tuning: Tuning) -> None:
        dt = jnp.dtype(cfg.dtype)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dt)
        self.layers = DecoderLayer(cfg, lora, (cfg.num_layers,), tuning)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, f32_product=cfg.family == "gpt_oss")


class LMHead(nnx.Module):
    """The unembedding: its own [V, D] weight, or the embedding matrix when tied; an adapter either way."""

    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None, tuning: Tuning) -> None:
        self.weight_major_rows = tuning.weight_major_rows
        if not cfg.tie_word_embeddings:
            shape = (cfg.vocab_size, cfg.hidden_size)
            self.weight = nnx.Param(jnp.zeros(shape, cfg.dtype), logical_axes=("vocab", "embed"))
        if lora is not None:
            self.lora_a, self.lora_b = lora_pair(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), lora, ())
            self.kernel_form = lora.kernel

    def __call__(self, h: jax.Array, embedding: jax.Array, rows: LoRARows | None) -> jax.Array:
        weight = self.weight[...] if hasattr(self, "weight") else embedding  # tied: the [V, D] embedding itself
        logits = linear(h, weight, jnp.float32, self.weight_major_rows)
        if rows is not None and hasattr(self, "lora_a"):
            logits = logits + lora_delta(h, rows, self.lora_a[...], self.lora_b[...], self.kernel_form)
        return logits


class CausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None, remat: bool, tuning: Tuning) -> None:
        self.config = cfg
        self.model = Model(cfg, lora, tuning)
        self.lm_head = LMHead(cfg, lora, tuning)
        self.remat = remat

    def hidden(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segments: jax.Array | None = None,
        rows: LoRARows | None = None,
        cache: CacheT | None = None,
        layers: Sequence[Mapping[tuple[str, ...], jax.Array]] | None = None,
    ) -> tuple[jax.Array, CacheT | None]:
        """tokens, positions [B, T] -> final normed hidden states [B, T, D] (and the updated cache).

        `layers`: the decoder's base weights as one {path: array} per layer (`split_layers`); the layers
        then run unrolled over those separate buffers instead of scanned over the stacked ones, and a
        cache must come as a `LayerCache`."""
        h, cache, _ = self.hidden_and_picks(tokens, positions, segments, rows, cache, layers)
        return h, cache

    def hidden_and_picks(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segments: jax.Array | None = None,
        rows: LoRARows | None = None,
        cache: CacheT | None = None,
        layers: Sequence[Mapping[tuple[str, ...], jax.Array]] | None = None,
    ) -> tuple[jax.Array, CacheT | None, jax.Array | None]:
        """`hidden`, and for a MoE model the experts each token picked in each sparse layer, [L_sparse, B*T, k]
        int16 (None for a dense model)."""
        cfg = self.config
        inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        segments = jnp.ones_like(tokens) if segments is None else segments
        graphdef, stacked = nnx.split(self.model.layers)
        windows = layer_windows(cfg)
        placement = Placement.of(cfg) if cfg.dense_mlp_layers else None

        def run_layer(h: jax.Array, layer: jax.Array | int, layer_state: nnx.State, mlp_at: tuple | None) -> tuple:
            read = None if cache is None else (cache, layer)
            window = None if windows is None else windows[layer]
            return nnx.merge(graphdef, layer_state)(h, positions, segments, inv_freq, rows, read, window, mlp_at)

        h = self.model.embed_tokens(tokens)
        if layers is not None:
            assert not isinstance(cache, KVCache), "per-layer weights take a LayerCache (KVCache.per_layer)"
            news, picks = [], []
            for index in range(len(layers)):
                state, mlp_at = _unrolled_state(stacked, layers, index, placement)
                h, one, chosen = run_layer(h, index, state, mlp_at)
                news.append(one)
                picks.extend([] if chosen is None else [chosen])
            picked = jnp.stack(picks) if picks else None
            if cache is None:
                return self.model.norm(h), None, picked
            # Each layer wrote its own buffer before reading it.
            written = LayerCache(tuple(n[0] for n in news), tuple(n[1] for n in news))
            return self.model.norm(h), written, picked  # type: ignore[return-value]
        assert not isinstance(cache, LayerCache), "a LayerCache needs per-layer weights"
        xs, mlp_state = _scan_inputs(stacked, placement)

        def body(carry: tuple, x: tuple) -> tuple[tuple, tuple]:
            h, layer = carry
            part, mlp_at = x
            state = part if mlp_state is None else nnx.State({**part, "mlp": mlp_state})
            h, new, chosen = run_layer(h, layer, state, mlp_at)
            return (h, layer + 1), (new, chosen)

        if self.remat:
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
        # Layers index the (loop-invariant) cache in place; the call's new keys/values come out stacked
        # [L, B, T, K, E] and are written once, after the scan.
        (h, _), (new, picked) = jax.lax.scan(body, (h, jnp.int32(0)), xs)
        if cache is not None and new is not None:
            cache = _write_cache(cache, new[0], new[1], positions)
        if placement is not None:  # a dense layer's picks are placeholders
            picked = picked[jnp.asarray(cfg.moe.sparse_layers if cfg.moe else ())]
        return self.model.norm(h), cache, picked

    def logits(self, h: jax.Array, rows: LoRARows | None = None) -> jax.Array:
        """[B, T, D] hidden -> [B, T, V] float32 logits."""
        return self.lm_head(h, self.model.embed_tokens.weight[...], rows)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segments: jax.Array | None = None,
        rows: LoRARows | None = None,
        cache: CacheT | None = None,
        layers: Sequence[Mapping[tuple[str, ...], jax.Array]] | None = None,
    ) -> tuple[jax.Array, CacheT | None]:
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        h, cache = self.hidden(tokens, positions, segments, rows, cache, layers)
        return self.logits(h, rows), cache


# ---- the decoder's weights as separate per-layer buffers ------------------------------------------------
#
# The model stores each decoder weight stacked over layers ([L, ...]) so that training scans one layer
# body (compile time independent of depth). Reading layer l of a stacked weight inside a program is a
# dynamic slice, and XLA:CPU copies such a slice before a library matmul: at decode, where a step is
# bound by weight reads, that copy doubles the traffic (small, batch 8: 4.5 vs 2.2 ms for the layer
# matmuls alone). So on CPU the sampler reads its own copy of the weights split into one buffer per
# layer under HF-like paths (`model/layers/3/self_attn/q_proj/weight`) and runs the layers unrolled
# over them (`decode_layout`, where `tx.tuning` says so: on CPU only). Training keeps the stacked form:
# stacking split weights inside the training program cost 24% of a Qwen3-0.6B-shape LoRA step and doubled
# its first step.

LAYERS = ("model", "layers")
Flat = dict[tuple[str, ...], jax.Array]


def _is_split(path: tuple[str, ...]) -> bool:
    return path[:2] == LAYERS and len(path) > 2 and path[2].isdigit()


@functools.partial(jax.jit, static_argnames="adapters")
def split_layers(weights: Flat, adapters: AdapterRoles | None = None) -> Flat:
    """Stacked decoder base weights [L, ...] -> one entry per layer; the LoRA factors among `weights`
    (`adapters`, known by their variable types) and the rest as they are. Jitted: the per-layer buffers
    keep the stacked arrays' sharding on their other axes."""
    keep = adapters or AdapterRoles(frozenset(), frozenset())
    out: Flat = {}
    for path, x in weights.items():
        if path[:2] == LAYERS and not _is_split(path) and path not in keep:
            for index in range(x.shape[0]):
                out[(*LAYERS, str(index), *path[2:])] = x[index]
        else:
            out[path] = x
    return out


def decode_layout(weights: Flat, tuning: Tuning, copy: bool = False, adapters: AdapterRoles | None = None) -> Flat:
    """The weights as the sampler reads them: split per layer where `tuning.per_layer_decode` (new buffers),
    else the same buffers (no second copy of the weights; copied only when `copy`: a snapshot of weights
    that will change). The engine passes base weights only; `adapters` names LoRA factors among them."""
    if tuning.per_layer_decode:
        split = split_layers(weights, adapters)  # new buffers for the layers; the other entries pass through
        return {p: jnp.array(v, copy=True) if copy and not _is_split(p) else v for p, v in split.items()}
    return {p: jnp.array(v, copy=True) for p, v in weights.items()} if copy else dict(weights)


def per_layer(weights: Mapping[tuple[str, ...], jax.Array]) -> tuple[Flat, list[Flat] | None]:
    """Split weights -> (the rest, with each stacked path mapped to layer 0's array as a stand-in that
    `hidden(layers=...)` never reads; one {path inside a layer: array} per layer). Stacked weights ->
    (themselves, None)."""
    rest: Flat = {}
    layers: dict[int, Flat] = {}
    for path, x in weights.items():
        if _is_split(path):
            layers.setdefault(int(path[2]), {})[path[3:]] = x
            if path[2] == "0":
                rest[(*LAYERS, *path[3:])] = x
        else:
            rest[path] = x
    if not layers:
        return rest, None
    return rest, [layers[i] for i in range(len(layers))]


def layer_state(
    stacked: nnx.State,
    weights: Mapping[tuple[str, ...], jax.Array],
    index: int,
    entry: Callable[[tuple[str, ...]], int] | None = None,
) -> nnx.State:
    """Layer `index` of the stacked decoder state: its own base buffers from `weights`, its slice of the
    stacked adapters (small): entry `index` of each, or `entry(path)` where stacks differ in what they hold."""
    items = []
    for path, var in nnx.to_flat_state(stacked):
        key = tuple(str(k) for k in path)
        value = weights[key] if key in weights else var.get_value()[index if entry is None else entry(key)]
        items.append((path, var.replace(value)))
    return nnx.from_flat_state(items)


def _unrolled_state(
    stacked: nnx.State, layers: Sequence[Mapping[tuple[str, ...], jax.Array]], index: int, placement: Placement | None
) -> tuple[nnx.State, tuple[bool, None] | None]:
    """Layer `index`'s state over the per-layer buffers, and a `MixedMLP`'s (kind, None): its MLP parts come
    from the entry of the layer's rank among its kind (`Placement.entry`)."""
    if placement is None:
        return layer_state(stacked, layers[index], index), None
    weights = {key: layers[placement.entry(key, index)][key] for key in layers[0]}
    return layer_state(stacked, weights, index, lambda key: placement.entry(key, index)), (
        placement.sparse[index],
        None,
    )


def _scan_inputs(stacked: nnx.State, placement: Placement | None) -> tuple[tuple, nnx.State | None]:
    """The layer scan's inputs (each layer's state slice, a `MixedMLP`'s (kind, rank) per layer) and the state
    every step reads whole (a `MixedMLP`'s stacks, which hold other counts of layers than L)."""
    if placement is None:
        return (stacked, None), None
    rest = nnx.State({k: v for k, v in stacked.items() if k != "mlp"})
    kinds = (jnp.asarray(placement.sparse), jnp.asarray(placement.rank, jnp.int32))
    return (rest, kinds), stacked["mlp"]


def abstract_model(
    cfg: ModelConfig, lora: LoRASpec | None = None, remat: bool = False, tuning: Tuning | None = None
) -> CausalLM:
    """The model's structure with shapes only: weights are filled by the loader, never initialised.
    `tuning`: the backend choices (default: those of the backend JAX runs on)."""
    return nnx.eval_shape(lambda: CausalLM(cfg, lora, remat, tuning or for_backend()))
