"""Qwen3.5 / Qwen3.6 text model: a hybrid stack of Gated DeltaNet and gated full-attention layers.

The calling convention is `causal_lm.CausalLM`'s: tokens, positions and segments [B, T] (packed rows:
attention stays in a segment, and the DeltaNet's conv and recurrent state restart at every segment
boundary), per-row adapter slots, a cache passed explicitly and returned updated. The weights of each
decoder sub-module are stacked over the layers that hold it (`ModelConfig.layers_holding`): `mlp` and the
norms over all L layers, `linear_attn` over the linear layers, `self_attn` over the full ones. The forward
pass scans over the repeating group of layer types (3 linear + 1 full in released checkpoints), one
iteration per group with the group's layers unrolled inside, so compile time does not grow with depth.
Qwen3.5-MoE (`qwen3_5_moe`) is the same stack with `tx.models.moe.SparseMoeBlock` (routed experts plus the
sigmoid-gated shared expert) as every layer's `mlp`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tx.lora.layers import LoRASpec
from tx.lora.params import LoRARows
from tx.models.cache import HybridCache, KVCache, LinearState
from tx.models.causal_lm import Embedding, LMHead, _write_cache, layer_state
from tx.models.config import ModelConfig
from tx.models.layers import MLP, RMSNorm
from tx.models.moe import SparseMoeBlock
from tx.models.qwen3_5_layers import GatedAttention, GatedDeltaNet, TokenFlags
from tx.models.rotary import rope_frequencies
from tx.tuning import PLAIN, Tuning, for_backend, moe_forms

MIXERS = {"linear_attention": "linear_attn", "full_attention": "self_attn"}
PER_LAYER = ("input_layernorm", "post_attention_layernorm", "mlp")
ALL_PARTS = (*PER_LAYER, *MIXERS.values())
ModuleAt = Callable[[str, int], nnx.Module]  # (sub-module name, index among the layers holding it) -> module


def repeating_group(kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The shortest pattern whose repetition gives the stack (the whole stack when none is shorter)."""
    L = len(kinds)
    return next(kinds[:p] for p in range(1, L + 1) if L % p == 0 and kinds[:p] * (L // p) == kinds)


class HybridLayers(nnx.Module):
    """HF's `model.layers.*`, each sub-module stacked over the layers that have it."""

    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None, tuning: Tuning) -> None:
        dt, L, D = jnp.dtype(cfg.dtype), cfg.num_layers, cfg.hidden_size
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps, dt, (L,), offset=1.0)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps, dt, (L,), offset=1.0)
        # the backend's MoE product forms; every other product plain (`tx.tuning.moe_forms`)
        self.mlp = SparseMoeBlock(cfg, lora, (L,), moe_forms(tuning)) if cfg.moe else MLP(cfg, lora, (L,), PLAIN)
        if cfg.layers_holding("linear_attn"):
            self.linear_attn = GatedDeltaNet(cfg, lora, (len(cfg.layers_holding("linear_attn")),))
        if cfg.layers_holding("self_attn"):
            self.self_attn = GatedAttention(cfg, lora, (len(cfg.layers_holding("self_attn")),))


class Model(nnx.Module):
    """HF's text `model.*` subtree (`model.language_model.*` in the multimodal checkpoint)."""

    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None, tuning: Tuning) -> None:
        dt = jnp.dtype(cfg.dtype)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dt)
        self.layers = HybridLayers(cfg, lora, tuning)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, offset=1.0)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What every layer of one call reads besides the hidden states."""

    positions: jax.Array
    segments: jax.Array
    flags: TokenFlags
    inv_freq: jax.Array
    rows: LoRARows | None


class Qwen3_5CausalLM(nnx.Module):
    def __init__(
        self, cfg: ModelConfig, lora: LoRASpec | None = None, remat: bool = False, tuning: Tuning = PLAIN
    ) -> None:
        self.config = cfg
        self.model = Model(cfg, lora, tuning)
        self.lm_head = LMHead(cfg, lora, PLAIN)
        self.remat = remat

    def hidden(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segments: jax.Array | None = None,
        rows: LoRARows | None = None,
        cache: HybridCache | None = None,
        layers: Sequence[Mapping[tuple[str, ...], jax.Array]] | None = None,
    ) -> tuple[jax.Array, HybridCache | None]:
        """tokens, positions [B, T] -> final normed hidden states [B, T, D] (and the updated cache).
        `layers`: the base weights split per stacked entry (`causal_lm.per_layer`); the layers then run
        unrolled over those separate buffers (the CPU decode form: a slice of a stacked weight is copied)."""
        h, cache, _ = self.hidden_and_picks(tokens, positions, segments, rows, cache, layers)
        return h, cache

    def hidden_and_picks(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segments: jax.Array | None = None,
        rows: LoRARows | None = None,
        cache: HybridCache | None = None,
        layers: Sequence[Mapping[tuple[str, ...], jax.Array]] | None = None,
    ) -> tuple[jax.Array, HybridCache | None, jax.Array | None]:
        """`hidden`, and for the MoE variant the experts each token picked in each layer, [L, B*T, k] int16
        (None for dense MLPs)."""
        cfg = self.config
        segments = jnp.ones_like(tokens) if segments is None else segments
        inv_freq = rope_frequencies(cfg.rotary_dim, cfg.rope_theta, None)
        inputs = _Inputs(positions, segments, TokenFlags.of(segments), inv_freq, rows)
        n_linear = len(cfg.layers_holding("linear_attn"))
        linear = cache.linear if cache is not None else LinearState.zeros(cfg, tokens.shape[0], n_linear)
        kv = None if cache is None else cache.full
        h = self.model.embed_tokens(tokens)
        if layers is None:
            h, (linear, new_kv, picks) = self._scanned(h, inputs, linear, kv)
        else:
            h, (linear, new_kv, picks) = _layers(h, cfg.kinds, self._split_layer(layers), linear, kv, inputs)
        if cache is None:
            return self.model.norm(h), None, picks
        k_new, v_new = new_kv
        full = _write_cache(cache.full, k_new, v_new, positions)  # written once, after every layer ran
        return self.model.norm(h), HybridCache(full, linear), picks

    def _scanned(self, h: jax.Array, inputs: _Inputs, linear: LinearState, kv: KVCache | None) -> tuple:
        """The layers over their stacked weights: one scan step per repeating group of layer types."""
        group = repeating_group(self.config.kinds)
        G = self.config.num_layers // len(group)
        parts = {name: nnx.split(getattr(self.model.layers, name)) for name in (*PER_LAYER, *_mixers(group))}
        graphs = {name: graph for name, (graph, _) in parts.items()}
        xs = ({name: state for name, (_, state) in parts.items()}, linear, kv)

        def body(h: jax.Array, x: tuple) -> tuple[jax.Array, tuple]:
            weights, linear, kv = x
            return _layers(h, group, lambda name, i: _at(graphs[name], weights[name], i), linear, kv, inputs)

        if self.remat:
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
        h, out = jax.lax.scan(body, h, _by_group(xs, G))
        return h, _ungroup(out)

    def _split_layer(self, layers: Sequence[Mapping[tuple[str, ...], jax.Array]]) -> ModuleAt:
        """Sub-module `name` of its index-th layer over the per-layer buffers `layers[index]` (`per_layer`:
        index i holds entry i of every stacked sub-module; the adapters stay stacked and are sliced)."""
        parts = {
            name: nnx.split(getattr(self.model.layers, name)) for name in ALL_PARTS if hasattr(self.model.layers, name)
        }

        def module_at(name: str, index: int) -> nnx.Module:
            graph, stacked = parts[name]
            own = {path[1:]: x for path, x in layers[index].items() if path[0] == name}
            return nnx.merge(graph, layer_state(stacked, own, index))

        return module_at

    def logits(self, h: jax.Array, rows: LoRARows | None = None) -> jax.Array:
        """[B, T, D] hidden -> [B, T, V] float32 logits."""
        return self.lm_head(h, self.model.embed_tokens.weight[...], rows)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segments: jax.Array | None = None,
        rows: LoRARows | None = None,
        cache: HybridCache | None = None,
        layers: Sequence[Mapping[tuple[str, ...], jax.Array]] | None = None,
    ) -> tuple[jax.Array, HybridCache | None]:
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        h, cache = self.hidden(tokens, positions, segments, rows, cache, layers)
        return self.logits(h, rows), cache


def _mixers(group: tuple[str, ...]) -> list[str]:
    return sorted({MIXERS[kind] for kind in group})


def _by_group(tree: Any, G: int) -> Any:
    """Every array's leading stacked axis [n, ...] -> [G, n / G, ...] (a free reshape)."""
    return jax.tree.map(lambda a: a.reshape(G, a.shape[0] // G, *a.shape[1:]), tree)


def _index(tree: object, index: int) -> Any:
    return jax.tree.map(lambda a: a[index], tree)


def _at(graph: nnx.GraphDef, state: object, index: int) -> nnx.Module:
    return nnx.merge(graph, _index(state, index))


def _ungroup(tree: Any) -> Any:
    """[G, n / G, ...] -> [n, ...]."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)  # -1 fails at size 0


def _layers(
    h: jax.Array, kinds: tuple[str, ...], module_at: ModuleAt, linear: LinearState, kv: KVCache | None, inputs: _Inputs
) -> tuple:
    """Layers of `kinds` in order; `module_at(name, i)` is sub-module `name` of the i-th layer holding it
    here, `linear` / `kv` the states of these layers' linear / full mixers -> (h, (new linear states,
    this call's (k, v) or None, the experts each token picked per layer or None))."""
    seen = {"linear_attn": 0, "self_attn": 0}
    states: list[LinearState] = []
    written: list[tuple[jax.Array, jax.Array] | None] = []
    picks: list[jax.Array | None] = []
    for i, kind in enumerate(kinds):
        mixer = MIXERS[kind]
        j = seen[mixer]
        seen[mixer] += 1
        x_in = module_at("input_layernorm", i)(h)
        state = _index(linear, j) if mixer == "linear_attn" else _index(kv, j)
        out, new = _mix(module_at(mixer, j), x_in, inputs, state)
        (states if mixer == "linear_attn" else written).append(new)
        h = h + out
        mlp_out, picked = _mlp(module_at("mlp", i), module_at("post_attention_layernorm", i)(h), inputs.rows)
        h = h + mlp_out
        picks.append(picked)
    return h, (_stack(states) if states else linear, _stack(written) if kv is not None else None, _stack(picks))


def _mlp(module: nnx.Module, x: jax.Array, rows: LoRARows | None) -> tuple[jax.Array, jax.Array | None]:
    """One layer's MLP -> (its output, the experts each token picked [B*T, k], None for a dense MLP)."""
    if isinstance(module, SparseMoeBlock):
        return module.mix(x, rows)
    assert isinstance(module, MLP)
    return module(x, rows), None


def _mix(module: nnx.Module, x: jax.Array, inputs: _Inputs, state: Any) -> tuple[jax.Array, Any]:
    """One layer's token mixer -> (its output, its new state: a `LinearState`, this call's (k, v), or None)."""
    if isinstance(module, GatedDeltaNet):
        return module(x, inputs.flags, inputs.rows, state)
    assert isinstance(module, GatedAttention)
    if state is None:
        return module(x, inputs.positions, inputs.segments, inputs.inv_freq, inputs.rows), None
    out, k, v = module.cached(x, inputs.positions, inputs.inv_freq, inputs.rows, state.k, state.v)
    return out, (k, v)


def _stack(items: list) -> Any:
    return jax.tree.map(lambda *a: jnp.stack(a), *items) if items and items[0] is not None else None


def abstract_qwen3_5(
    cfg: ModelConfig, lora: LoRASpec | None = None, remat: bool = False, tuning: Tuning | None = None
) -> Qwen3_5CausalLM:
    """The model's structure with shapes only: weights are filled by the loader, never initialised.
    `tuning`: the backend choices (default: those of the backend JAX runs on; only its MoE forms apply)."""
    return nnx.eval_shape(lambda: Qwen3_5CausalLM(cfg, lora, remat, tuning or for_backend()))
