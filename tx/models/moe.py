"""The mixture-of-experts MLP: a softmax top-k router over stacked SwiGLU experts, exact (no token dropped).

Attribute names follow the hub checkpoints (`mlp.gate` the router, `mlp.experts.{i}.gate_proj` ...): each
expert projection is one `weight [*stack, X, out, in]`, the checkpoint's per-expert [out, in] tensors
stacked on a leading `expert` logical axis, which the sharding rules map onto the mesh's `expert` axis
(expert parallelism). An optional shared expert (a dense SwiGLU MLP, scaled by a per-token sigmoid gate)
runs beside the routed ones (Qwen3.5-MoE). gpt-oss names its router `mlp.router` and gives it a bias, picks
the top-k logits before a softmax over them, and fuses each expert's gate and up into one interleaved
`mlp.experts.gate_up_proj` (gate in the even rows, as its checkpoint stores them), with biases on both
projections and its clamped SwiGLU; the same two forms run it. Letters as in `tx.models.layers`, plus
N tokens (B*T), X experts, k experts per token, M = N*k (token, expert) pairs, F an expert's width.

The grouped expert product has four exact forms, chosen per backend by measurement
(`Tuning.moe_dense_max_experts`, `Tuning.moe_block_rows`, numbers in `benchmarks/bench_moe.py`):
- `ragged`: the M pairs sorted by expert, each expert's rows one group of `jax.lax.ragged_dot`;
  the work is the active FLOPs where the ragged dot is native.
- `dense`: every expert on every token, the outputs summed with the routing weights (0 for experts a token
  did not choose); X / k times the active FLOPs, but plain batched matmuls.
- `blocked`: the pairs sorted by expert, each expert's rows padded to whole blocks, one plain matmul per
  block against its expert's weight, read in place (`tx.models.grouped`): the active FLOPs plus at most X
  blocks' padding.
  It runs per call where its blocks hold fewer rows than `dense` computes, in blocks sized to the call.
- `pairs`: each (token, expert) pair on its own row, unrolled, the chosen expert's weights read by index;
  for a call of at most X (and `MOST_PAIRS`) pairs, a decode step (`SparseMoeBlock.form_for`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from tx.lora.experts import ExpertAdapter, expert_lora_pair, token_columns
from tx.lora.layers import LoRALinear, LoRASpec, linear
from tx.lora.params import LoRARows
from tx.models.config import ModelConfig, MoE
from tx.models.grouped import block_product, block_rows, blocks_of, entry, permute_rows
from tx.models.layers import MLP, swiglu
from tx.tuning import Tuning

Form = Literal["ragged", "dense", "blocked", "pairs"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """Each token's chosen experts and their weights: experts, weights [N, k]."""

    experts: jax.Array
    weights: jax.Array


def route(logits: jax.Array, top_k: int, normalize: bool, softmax_of_top: bool = False) -> Routing:
    """Router logits [N, X] -> the top-k experts by softmax probability (ties to the lower index), the
    probabilities renormalised to sum to 1 over the chosen ones when `normalize`. `softmax_of_top`
    (gpt-oss): the top-k logits first, then a softmax over those alone (the same function as normalised
    probabilities, computed the way gpt-oss does)."""
    if softmax_of_top:
        top, experts = jax.lax.top_k(logits.astype(jnp.float32), top_k)
        return Routing(experts.astype(jnp.int32), jax.nn.softmax(top, axis=-1).astype(logits.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(experts.astype(jnp.int32), weights.astype(logits.dtype))


def dense_combine(routing: Routing, experts: int) -> jax.Array:
    """The routing as a dense [N, X] matrix of weights, 0 where a token did not choose the expert."""
    pick = jax.nn.one_hot(routing.experts, experts, dtype=routing.weights.dtype)  # [N, k, X]
    return jnp.einsum("nkx,nk->nx", pick, routing.weights)


Adapters = tuple[ExpertAdapter | None, ExpertAdapter | None, ExpertAdapter | None]  # gate, up, down
NO_ADAPTERS: Adapters = (None, None, None)
Biases = tuple[jax.Array | None, jax.Array | None, jax.Array | None]  # gate, up, down: [X, out] each
NO_BIASES: Biases = (None, None, None)
Activation = Callable[..., jax.Array]  # the projected inputs (gate, up; or gpt-oss's fused gate_up) -> h


def _plus(y: jax.Array, adapter: ExpertAdapter | None, delta: Callable[[ExpertAdapter], jax.Array]) -> jax.Array:
    return y if adapter is None else y + delta(adapter)


def clamped_swiglu(alpha: float, limit: float) -> Activation:
    """gpt-oss's activation of its interleaved gate_up [..., 2F] (gate at even, up at odd indices) -> [..., F]."""

    def act(gate_up: jax.Array) -> jax.Array:
        pairs = gate_up.reshape(*gate_up.shape[:-1], -1, 2)
        gate, up = jnp.minimum(pairs[..., 0], limit), jnp.clip(pairs[..., 1], -limit, limit)
        return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)

    return act


def dense_experts(
    x: jax.Array,
    routing: Routing,
    gate: jax.Array,
    up: jax.Array | None,
    down: jax.Array,
    adapters: Adapters = NO_ADAPTERS,
    biases: Biases = NO_BIASES,
    act: Activation = swiglu,
) -> jax.Array:
    """x [N, D], expert weights gate, up [X, F, D] and down [X, D, F] -> [N, D]: all experts on all
    tokens, each expert's activations scaled by its routing weight before the down projection. With
    `up` None, `gate` is a fused input projection that `act` alone reads (gpt-oss)."""
    combine = dense_combine(routing, gate.shape[0])

    def project(w: jax.Array, bias: jax.Array | None, adapter: ExpertAdapter | None) -> jax.Array:
        y = jnp.einsum("nd,xfd->xnf", x, w) + (0 if bias is None else bias[:, None, :])
        return _plus(y, adapter, lambda a: a.dense(x))

    inputs = [project(w, b, a) for w, b, a in zip((gate, up), biases[:2], adapters[:2], strict=True) if w is not None]
    h = act(*inputs) * combine.T[:, :, None].astype(x.dtype)
    out = _plus(jnp.einsum("xnf,xdf->nd", h, down), adapters[2], lambda a: a.dense_summed(h))
    return out if biases[2] is None else out + combine.astype(x.dtype) @ biases[2]


_OUT_IN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)  # lhs [M, in] against rhs [X, out, in]: the checkpoint's [out, in] layout, no transposed copy


def _grouped(rows: jax.Array, weight: jax.Array, sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot_general(rows, weight, sizes, _OUT_IN)


def ragged_experts(
    x: jax.Array,
    routing: Routing,
    gate: jax.Array,
    up: jax.Array | None,
    down: jax.Array,
    adapters: Adapters = NO_ADAPTERS,
    biases: Biases = NO_BIASES,
    act: Activation = swiglu,
) -> jax.Array:
    """x [N, D] -> [N, D]: the (token, expert) pairs sorted by expert, one ragged group per expert."""
    N, k = routing.experts.shape
    flat = routing.experts.reshape(N * k)
    order = jnp.argsort(flat, stable=True)  # pair indices, grouped by expert
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    token, expert = order // k, jnp.take(flat, order)
    rows = jnp.take(x, token, axis=0)  # [M, D]

    def project(
        inputs: jax.Array, weight: jax.Array, bias: jax.Array | None, adapter: ExpertAdapter | None
    ) -> jax.Array:
        y = _grouped(inputs, weight, sizes) + (0 if bias is None else jnp.take(bias, expert, axis=0))
        return _plus(y, adapter, lambda a: a.ragged(inputs, token, sizes))

    weights = zip((gate, up), biases[:2], adapters[:2], strict=True)
    h = act(*[project(rows, w, b, a) for w, b, a in weights if w is not None])
    pair_weights = jnp.take(routing.weights.reshape(N * k), order)[:, None].astype(x.dtype)
    out = project(h, down, biases[2], adapters[2]) * pair_weights
    back = jnp.argsort(order)  # the inverse permutation: pair i's row in the sorted order
    return jnp.sum(jnp.take(out, back, axis=0).reshape(N, k, -1), axis=1)


def blocked_experts(
    x: jax.Array,
    routing: Routing,
    gate: jax.Array,
    up: jax.Array | None,
    down: jax.Array,
    adapters: Adapters = NO_ADAPTERS,
    biases: Biases = NO_BIASES,
    act: Activation = swiglu,
    rows: int = 128,
) -> jax.Array:
    """x [N, D] -> [N, D]: the pairs sorted by expert and padded per expert to blocks of `rows`, each block
    one plain matmul against its expert's weight: at most X * rows padding rows over the active FLOPs, where
    a backend without a native ragged dot runs `ragged` as X masked products over all M rows."""
    N, k = routing.experts.shape
    X = gate.shape[0]
    layout = blocks_of(routing.experts.reshape(N * k), X, rows)
    nb = layout.expert.shape[0]
    inputs = permute_rows(jnp.repeat(x, k, axis=0), layout.pair, layout.at)  # [P, D], padding rows 0
    padded_mask = _padded_mask(adapters, layout.pair // k)

    def project(h: jax.Array, weight: jax.Array, bias: jax.Array | None, adapter: ExpertAdapter | None) -> jax.Array:
        blocks = h.reshape(nb, rows, h.shape[-1])
        y = block_product(blocks, weight, layout.expert, layout.used)
        y = y if bias is None else y + jnp.take(bias, layout.expert, axis=0)[:, None, :]
        y = _plus(y, adapter, lambda a: a.blocked(blocks, layout.expert, padded_mask))
        return y.reshape(nb * rows, -1)

    weights = zip((gate, up), biases[:2], adapters[:2], strict=True)
    h = act(*[project(inputs, w, b, a) for w, b, a in weights if w is not None])
    per_pair = permute_rows(project(h, down, biases[2], adapters[2]), layout.at, layout.pair)  # [M, D]
    return jnp.einsum("nkd,nk->nd", per_pair.reshape(N, k, -1), routing.weights.astype(x.dtype))


def _padded_mask(adapters: Adapters, token: jax.Array) -> jax.Array:
    """The tokens' adapter columns on the padded rows (padding rows: all 0), [P, Q]."""
    given = [a.mask for a in adapters if a is not None]
    if not given:
        return jnp.zeros((token.shape[0], 0))  # never read: no projection has an adapter
    return jnp.take(jnp.concatenate([given[0], jnp.zeros_like(given[0][:1])]), token, axis=0)


def block_height(M: int, X: int, most: int) -> int:
    """The blocked product's block height for M pairs over X experts: about two blocks per expert on average,
    a power of two, at most `most` (one row for a decode step's few pairs)."""
    return min(most, 1 << max(0, (2 * M // X) - 1).bit_length())


def pair_experts(
    x: jax.Array,
    routing: Routing,
    gate: jax.Array,
    up: jax.Array | None,
    down: jax.Array,
    adapters: Adapters = NO_ADAPTERS,
    biases: Biases = NO_BIASES,
    act: Activation = swiglu,
) -> jax.Array:
    """x [N, D] -> [N, D]: each (token, expert) pair's expert on its own row, unrolled, the chosen expert's
    weights read in place by index: no sort, no layout, no loop. For a call of a few pairs (a decode step)."""
    N, k = routing.experts.shape

    def pair(n: int, j: int) -> jax.Array:
        e, row = routing.experts[n, j], x[n : n + 1]

        def project(h: jax.Array, w: jax.Array, b: jax.Array | None, a: ExpertAdapter | None) -> jax.Array:
            y = linear(h, entry(w, e)) + (0 if b is None else entry(b, e))
            return _plus(y, a, lambda a: a.pair(h, e, n))

        inputs = [
            project(row, w, b, a) for w, b, a in zip((gate, up), biases[:2], adapters[:2], strict=True) if w is not None
        ]
        return routing.weights[n, j].astype(x.dtype) * project(act(*inputs), down, biases[2], adapters[2])

    return jnp.concatenate([sum(pair(n, j) for j in range(k)) for n in range(N)])


FORMS = {"ragged": ragged_experts, "dense": dense_experts, "blocked": blocked_experts, "pairs": pair_experts}
MOST_PAIRS = 16  # the pairs form unrolls a call of at most this many pairs (and at most X)


class ExpertLinear(nnx.Module):
    """One projection of every expert: weight [*stack, X, out, in] (the checkpoint's per-expert layout), and
    with a `LoRASpec` one adapter per expert and slot (`tx.lora.experts`)."""

    def __init__(
        self,
        experts: int,
        d_in: int,
        d_out: int,
        axes: tuple[str, str],
        dtype: jnp.dtype,
        stack: tuple,
        lora: LoRASpec | None = None,
        bias: bool = False,
    ) -> None:
        lead = ("layers",) * len(stack)
        shape = (*stack, experts, d_out, d_in)
        self.weight = nnx.Param(jnp.zeros(shape, dtype), logical_axes=(*lead, "expert", axes[1], axes[0]))
        if bias:  # [*stack, X, out]
            self.bias = nnx.Param(jnp.zeros(shape[:-1], dtype), logical_axes=(*lead, "expert", axes[1]))
        if lora is not None:
            self.lora_a, self.lora_b = expert_lora_pair(experts, d_in, d_out, axes, lora, stack)

    def adapter(self, mask: jax.Array | None) -> ExpertAdapter | None:
        if mask is None or not hasattr(self, "lora_a"):
            return None
        return ExpertAdapter.of(self.lora_a[...], self.lora_b[...], mask)

    def bias_or_none(self) -> jax.Array | None:
        return self.bias[...] if hasattr(self, "bias") else None


class Experts(nnx.Module):
    """HF's `mlp.experts`: the routed experts' gate, up and down projections, stacked; gpt-oss's fused
    `gate_up_proj` [X, 2F, D] (interleaved) and `down_proj`, with biases."""

    def __init__(self, cfg: ModelConfig, moe: MoE, lora: LoRASpec | None, stack: tuple[int, ...]) -> None:
        dt, D, F, X = jnp.dtype(cfg.dtype), cfg.hidden_size, moe.expert_size, moe.experts
        biased = moe.gpt_oss is not None
        if moe.gpt_oss is not None:
            self.gate_up_proj = ExpertLinear(X, D, 2 * F, ("embed", "mlp"), dt, stack, lora, bias=True)
        else:
            self.gate_proj = ExpertLinear(X, D, F, ("embed", "mlp"), dt, stack, lora)
            self.up_proj = ExpertLinear(X, D, F, ("embed", "mlp"), dt, stack, lora)
        self.down_proj = ExpertLinear(X, F, D, ("mlp", "embed"), dt, stack, lora, bias=biased)
        self.clamp = None if moe.gpt_oss is None else (moe.gpt_oss.alpha, moe.gpt_oss.limit)  # static floats

    def __call__(
        self, x: jax.Array, routing: Routing, form: Form, rows: int = 128, mask: jax.Array | None = None
    ) -> jax.Array:
        """x [N, D]; `mask` [N, G*R]: each token's adapter columns (`tx.lora.experts.token_columns`); `rows`:
        the block height of the blocked form."""
        gate = self.gate_up_proj if hasattr(self, "gate_up_proj") else self.gate_proj
        up, down = getattr(self, "up_proj", None), self.down_proj
        adapters = (gate.adapter(mask), None if up is None else up.adapter(mask), down.adapter(mask))
        biases = (gate.bias_or_none(), None, down.bias_or_none())
        weights = (gate.weight[...], None if up is None else up.weight[...], down.weight[...])
        act = swiglu if self.clamp is None else clamped_swiglu(*self.clamp)
        product = functools.partial(blocked_experts, rows=rows) if form == "blocked" else FORMS[form]
        return product(x, routing, *weights, adapters, biases, act)


class Router(nnx.Module):
    """HF's `mlp.gate` (`mlp.router` in gpt-oss, with a bias [*stack, X]): one logit per expert, weight
    [*stack, X, D] (replicated: it is small)."""

    def __init__(self, cfg: ModelConfig, moe: MoE, stack: tuple[int, ...], bias: bool = False) -> None:
        lead = ("layers",) * len(stack)
        shape = (*stack, moe.experts, cfg.hidden_size)
        self.weight = nnx.Param(jnp.zeros(shape, cfg.dtype), logical_axes=(*lead, "router", "embed"))
        if bias:
            self.bias = nnx.Param(jnp.zeros(shape[:-1], cfg.dtype), logical_axes=(*lead, "router"))

    def __call__(self, x: jax.Array) -> jax.Array:
        logits = linear(x, self.weight[...])
        return logits + self.bias[...] if hasattr(self, "bias") else logits


class SparseMoeBlock(nnx.Module):
    """HF's sparse `mlp`: router, routed experts, and the optional sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None, stack: tuple[int, ...], tuning: Tuning) -> None:
        moe = cfg.moe
        assert moe is not None, "a SparseMoeBlock needs the config's moe section"
        if moe.gpt_oss is not None:
            self.router = Router(cfg, moe, stack, bias=True)
        else:
            self.gate = Router(cfg, moe, stack)
        self.experts = Experts(cfg, moe, lora, stack)
        if moe.shared_expert_size:
            self.shared_expert = MLP(cfg, lora, stack, tuning, size=moe.shared_expert_size)
            self.shared_expert_gate = LoRALinear(
                cfg.hidden_size, 1, axes=("embed", "router"), dtype=jnp.dtype(cfg.dtype), stack=stack
            )
        self.top_k, self.normalize, self.softmax_of_top = moe.top_k, moe.norm_topk_prob, moe.gpt_oss is not None
        self.form: Form = "dense" if moe.experts <= tuning.moe_dense_max_experts else "ragged"
        self.block = tuning.moe_block_rows  # static: the blocked form runs where it computes fewer rows

    def form_for(self, N: int) -> tuple[Form, int]:
        """The product for N tokens and its block height (shapes are static at trace time). With blocks on:
        a call of at most X (and `MOST_PAIRS`) pairs, a decode step, runs each pair on its own (`pairs`:
        the chosen experts' weights read by index, nothing else); larger ones the blocked form where its
        padded rows are fewer than dense's (every expert on every token), in blocks of about two per expert
        on average (a power of two, at most `block`: `block` rows in training and prefill), so a decode step
        reads each chosen expert about once and skips the others; else the standing form."""
        X, M = self.experts.down_proj.weight.shape[-3], N * self.top_k
        if self.block and M <= min(X, MOST_PAIRS):
            return "pairs", 1
        if self.block:
            height = block_height(M, X, self.block)
            if block_rows(M, X, height) < N * X:
                return "blocked", height
        return self.form, self.block

    def __call__(self, x: jax.Array, rows: LoRARows | None) -> jax.Array:
        """x [B, T, D] -> [B, T, D]."""
        return self.mix(x, rows)[0]

    def mix(self, x: jax.Array, rows: LoRARows | None) -> tuple[jax.Array, jax.Array]:
        """x [B, T, D] -> (out [B, T, D], the experts each token picked [B*T, k] int16). Unused, the picks
        cost nothing (XLA drops them)."""
        B, T, D = x.shape
        tokens = x.reshape(B * T, D)
        router = self.router if hasattr(self, "router") else self.gate
        routing = route(router(tokens), self.top_k, self.normalize, self.softmax_of_top)
        mask = None if rows is None else token_columns(rows, T, x.dtype)
        out = self.experts(tokens, routing, *self.form_for(B * T), mask=mask).reshape(B, T, D)
        if hasattr(self, "shared_expert"):
            gate = jax.nn.sigmoid(self.shared_expert_gate(x, None))
            out = out + gate * self.shared_expert(x, rows)
        return out, routing.experts.astype(jnp.int16)
