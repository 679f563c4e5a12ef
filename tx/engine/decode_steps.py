"""The sampler's jitted programs: prompt prefill into the decode cache, a chunk of decode steps, cache resize.

The decode cache is preallocated, its row count B and length S from the sampler's buckets, in one of two
forms kept between chunks: a `LayerCache` (one buffer per layer, for per-layer weights) or the stacked
`KVCache` [L, B, S, K, E] (for stacked weights); every program takes either, and converts only when the
cache and the weights disagree. A decode row feeds one token per step at its own position and attends to every
cache position up to it; every such position was written by the row itself (its prefilled prompt or an
earlier step), so stale keys left by a previous occupant of the row are never seen. An empty row sits at
position >= S, where the model drops its writes. Prefill runs the distinct prompts (all tokens but the
last, which the first decode step feeds) in a cache of their own and copies each prompt's cache rows
into every decode row that samples it, so `num_samples` rows share one prefill. Dimension letters:
B decode rows, N prefill rows, P prefill length, C chunk steps, k top-k width.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tx.engine.sampling import row_keys, select_tokens
from tx.engine.vocab_blocks import block_size, over_blocks
from tx.lora.params import AdapterRoles, LoRARows
from tx.lora.select import Selection, take_adapters
from tx.models.cache import HybridCache, KVCache, LayerCache, decode_cache, prefill_cache
from tx.models.causal_lm import per_layer
from tx.models.config import ModelConfig

# The weights a program reads: an nnx State, or {path: array} whose decoder base weights may be split
# into per-layer buffers (`tx.models.causal_lm.split_layers`), which decodes about twice as fast on CPU.
Weights = nnx.State | dict
Cache = LayerCache | KVCache | HybridCache
Fresh = KVCache | HybridCache  # what a prefill writes: the stacked form of every layer's state
# Prompt scores build full-vocabulary logits a block of positions at a time, at most this many at once
# (128 MiB of float32 logits, as much again of log-probabilities). All positions at once were N x P x V
# (8 prompts of 4096 tokens over Qwen's 152k vocabulary: 20 GB, and twice that with the log-softmax).
SCORE_ELEMENTS = 1 << 25


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeRows:
    """Per-row inputs of a decode chunk, all [B]."""

    token: jax.Array  # int32: the token fed at the first step (last prompt token, or the last sampled one)
    position: jax.Array  # int32: where that token goes; >= S for an empty row
    step: jax.Array  # int32: generated-token index of the token the first step samples (seeds the key)
    seed: jax.Array  # uint32
    temperature: jax.Array  # float32, 0 = greedy
    top_k: jax.Array  # int32, <= 0 = off
    top_p: jax.Array  # float32, 1 = off


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """Prompts to prefill, and which decode rows receive each prompt's cache."""

    tokens: jax.Array  # [N, P] int32
    positions: jax.Array  # [N, P] int32; P on padding, so its writes are dropped
    targets: jax.Array  # [N, P] int32: the next prompt token, scored when prompt logprobs are wanted


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptScores:
    """log p(prompt[j+1] | prompt[<=j]) at prefill position j, and the k best tokens there."""

    logprobs: jax.Array  # [N, P]
    topk_ids: jax.Array  # [N, P, k]
    topk_logprobs: jax.Array  # [N, P, k]


class DecodePrograms:
    """The compiled programs for one model graph. `compile_count` counts traces, i.e. new shapes compiled.
    `roles`: which weights are LoRA factors (`AdapterRoles`; None for a model without adapters)."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        chunk_steps: int,
        k_cap: int,
        roles: AdapterRoles | None = None,
        score_elements: int = SCORE_ELEMENTS,
    ) -> None:
        self.graphdef = graphdef
        self.score_elements = score_elements
        self.roles = roles
        self.chunk_steps = chunk_steps
        self.k_cap = k_cap
        self.compile_count = 0
        self.decode = jax.jit(self._decode, donate_argnames="cache")
        self.prefill = jax.jit(self._prefill, static_argnames=("scores", "topk"))
        self.insert = jax.jit(self._insert, donate_argnames="cache")
        self.resize = jax.jit(self._resize, static_argnames="length")
        self.clear = jax.jit(self._clear, donate_argnames="cache")
        # One program per prompt kept for reuse (the row index traced): slicing eagerly dispatched two slices
        # per prompt and compiled them again for every row index (8 prompts of `small`: 8.3 -> 5.4 ms of host).
        self.head = jax.jit(self._head, static_argnames="length")
        self._empty: dict[tuple[int, int, bool], Callable[[], Cache]] = {}

    def empty(self, cfg: ModelConfig, rows: int, length: int, per_layer: bool) -> Cache:
        """A zeroed decode cache (`tx.models.cache.decode_cache`) made by one program per shape: drawn
        eagerly, each layer's keys and values were a dispatch of their own (`small`, 8 rows: 5.2 ms of host).
        One `DecodePrograms` serves one model, so `cfg` is the same at every call."""
        make = self._empty.get((rows, length, per_layer))
        if make is None:
            self.compile_count += 1
            make = jax.jit(functools.partial(decode_cache, cfg, rows, length, per_layer))
            self._empty[(rows, length, per_layer)] = make
        return make()

    def _decode(
        self, state: Weights, adapters: Selection | None, cache: Cache, rows: DecodeRows
    ) -> tuple[Cache, jax.Array, jax.Array]:
        """`chunk_steps` decode steps -> (cache, sampled tokens [B, C], their raw logprobs [B, C]).

        `adapters` selects the adapter slots the rows read (None: no row has one), see `tx.lora.select`."""
        self.compile_count += 1  # runs only while tracing
        state, layers, lora = _select(state, adapters, self.roles)

        def one_step(carry: tuple, _: None) -> tuple[tuple, tuple[jax.Array, jax.Array]]:
            cache, token, position, step = carry
            model = nnx.merge(self.graphdef, state)
            live = (position < cache.length).astype(jnp.int32)[:, None]  # empty rows leave their state alone
            logits, cache = model(token[:, None], position[:, None], live, rows=lora, cache=cache, layers=layers)
            keys = row_keys(rows.seed, step)
            token, logprob = select_tokens(
                logits[:, 0], keys, rows.temperature, rows.top_k, rows.top_p, k_cap=self.k_cap
            )
            return (cache, token, position + 1, step + 1), (token, logprob)

        # Per-layer weights read a LayerCache, the scanned model over stacked weights a KVCache; a cache in the
        # other form is converted here, twice per chunk (the sampler keeps the form its weights read).
        carry: tuple = (_as_form(cache, layers is not None), rows.token, rows.position, rows.step)
        (out, *_), (tokens_CB, logprobs_CB) = jax.lax.scan(one_step, carry, length=self.chunk_steps)
        return _as_form(out, isinstance(cache, LayerCache)), tokens_CB.T, logprobs_CB.T

    def _prefill(
        self, state: Weights, adapters: Selection | None, batch: PrefillBatch, *, scores: bool, topk: int
    ) -> tuple[Fresh, PromptScores | None]:
        """The prompts' own cache (N rows of P positions), and their scores when `scores`.

        Kept apart from `insert` so that this, the expensive compile, does not depend on the decode shape.
        """
        self.compile_count += 1
        state, layers, lora = _select(state, adapters, self.roles)
        model = nnx.merge(self.graphdef, state)
        N, P = batch.tokens.shape
        empty = prefill_cache(model.config, N, P)
        live = (batch.positions < P).astype(jnp.int32)  # padding is neutral to recurrent state
        if layers is None or not isinstance(empty, KVCache):  # only attention-only models have a LayerCache
            h_NPD, fresh = model.hidden(batch.tokens, batch.positions, live, lora, empty, layers)
        else:
            h_NPD, own = model.hidden(batch.tokens, batch.positions, live, lora, empty.per_layer(), layers)
            fresh = None if own is None else own.stacked()
        assert fresh is not None
        if not scores:
            return fresh, None
        return fresh, self._scores(model, h_NPD, lora, batch.targets, topk)

    def _scores(
        self, model: Any, h_NPD: jax.Array, lora: LoRARows | None, targets_NP: jax.Array, topk: int
    ) -> PromptScores:
        """Every prompt position's scores, a block of C positions at a time: only one block's
        full-vocabulary logits [N, C, V] (at most `score_elements` of them) exist at once."""
        N, P, _ = h_NPD.shape
        C = block_size(N, P, model.config.vocab_size, self.score_elements)

        def block(h_NCD: jax.Array, t_NC: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            logp_NCV = jax.nn.log_softmax(model.logits(h_NCD, lora), axis=-1)
            target_NC = jnp.take_along_axis(logp_NCV, t_NC[..., None], axis=-1)[..., 0]
            top_lp, top_ids = jax.lax.top_k(logp_NCV, topk) if topk else (logp_NCV[..., :0], t_NC[..., None][..., :0])
            return target_NC, top_ids.astype(jnp.int32), top_lp

        target_NP, ids_NPK, lp_NPK = over_blocks(block, C, h_NPD, targets_NP)
        return PromptScores(target_NP, ids_NPK, lp_NPK)

    def _insert(self, cache: Cache, fresh: Fresh, source: jax.Array) -> Cache:
        """Copy prefill row `source[b]` into the head of decode row b; rows with -1 keep their cache."""
        self.compile_count += 1
        return cache.insert(fresh, source)  # type: ignore[arg-type]

    def _resize(self, cache: Cache, index: jax.Array, *, length: int) -> Cache:
        """Decode rows `index` [B'] of `cache`, cut or zero-padded to `length` positions."""
        self.compile_count += 1
        return cache.take(index, length)

    def _head(self, fresh: Fresh, row: jax.Array, *, length: int) -> Fresh:
        """Prefill row `row` of `fresh`, its first `length` positions (what the prompt cache keeps)."""
        return fresh.head(row, length)

    def _clear(self, cache: Cache, new: jax.Array) -> Cache:
        """Rows `new` [B] (bool) start from an empty state (only stateful caches hold any)."""
        self.compile_count += 1
        return cache.clear(new)


def _as_form(cache: Cache, per_layer: bool) -> Cache:
    """An attention-only model's cache as a LayerCache when `per_layer`, else as a KVCache (converted only
    if it is the other); a hybrid model's cache has one form."""
    if isinstance(cache, HybridCache):
        return cache
    if per_layer:
        return cache if isinstance(cache, LayerCache) else cache.per_layer()
    return cache.stacked() if isinstance(cache, LayerCache) else cache


def _select(
    weights: Weights, adapters: Selection | None, roles: AdapterRoles | None
) -> tuple[nnx.State, list | None, LoRARows | None]:
    """(the model's state, its decoder layers' own buffers when the weights come split, the rows' adapters)."""
    if isinstance(weights, nnx.State):
        weights = {tuple(str(k) for k in path): leaf for path, leaf in nnx.to_flat_state(weights)}
    flat = {p: v.get_value() if isinstance(v, nnx.Variable) else v for p, v in weights.items()}
    if adapters is not None:
        assert roles is not None, "a selection over a model without adapter roles"
        flat = take_adapters(flat, adapters, roles)
    rest, layers = per_layer(flat)
    return nnx.from_flat_state(list(rest.items())), layers, None if adapters is None else adapters.rows
