"""The mixture-of-experts MLP: a softmax top-k router over stacked SwiGLU experts, exact (no token dropped).

Attribute names follow the hub checkpoints (`mlp.gate` the router, `mlp.experts.{i}.gate_proj` ...): each
expert projection is one `weight [*stack, X, out, in]`, the checkpoint's per-expert [out, in] tensors
stacked on a leading `expert` logical axis, which the sharding rules map onto the mesh's `expert` axis
(expert parallelism). An optional shared expert (a dense SwiGLU MLP, scaled by a per-token sigmoid gate)
runs beside the routed ones (Qwen3.5-MoE). Letters as in `tx.models.layers`, plus N tokens (B*T),
X experts, k experts per token, M = N*k (token, expert) pairs, F an expert's width.

The grouped expert product has two exact forms, chosen per backend by measurement
(`Tuning.moe_dense_max_experts`, numbers in `benchmarks/bench_moe.py`):
- `ragged`: the M pairs sorted by expert, each expert's rows one group of `jax.lax.ragged_dot`;
  the work is the active FLOPs where the ragged dot is native.
- `dense`: every expert on every token, the outputs summed with the routing weights (0 for experts a token
  did not choose); X / k times the active FLOPs, but plain batched matmuls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from tx.lora.experts import ExpertAdapter, expert_lora_pair, token_columns
from tx.lora.layers import LoRALinear, LoRASpec, linear
from tx.lora.params import LoRARows
from tx.models.config import ModelConfig, MoE
from tx.models.layers import MLP, swiglu
from tx.tuning import Tuning

Form = Literal["ragged", "dense"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """Each token's chosen experts and their weights: experts, weights [N, k]."""

    experts: jax.Array
    weights: jax.Array


def route(logits: jax.Array, top_k: int, normalize: bool) -> Routing:
    """Router logits [N, X] -> the top-k experts by softmax probability (ties to the lower index), the
    probabilities renormalised to sum to 1 over the chosen ones when `normalize`."""
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


def _plus(y: jax.Array, adapter: ExpertAdapter | None, delta: Callable[[ExpertAdapter], jax.Array]) -> jax.Array:
    return y if adapter is None else y + delta(adapter)


def dense_experts(
    x: jax.Array,
    routing: Routing,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    adapters: Adapters = NO_ADAPTERS,
) -> jax.Array:
    """x [N, D], expert weights gate, up [X, F, D] and down [X, D, F] -> [N, D]: all experts on all
    tokens, each expert's activations scaled by its routing weight before the down projection."""
    combine = dense_combine(routing, gate.shape[0])
    g = _plus(jnp.einsum("nd,xfd->xnf", x, gate), adapters[0], lambda a: a.dense(x))
    u = _plus(jnp.einsum("nd,xfd->xnf", x, up), adapters[1], lambda a: a.dense(x))
    h = swiglu(g, u) * combine.T[:, :, None].astype(x.dtype)
    return _plus(jnp.einsum("xnf,xdf->nd", h, down), adapters[2], lambda a: a.dense_summed(h))


_OUT_IN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)  # lhs [M, in] against rhs [X, out, in]: the checkpoint's [out, in] layout, no transposed copy


def _grouped(rows: jax.Array, weight: jax.Array, sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot_general(rows, weight, sizes, _OUT_IN)


def ragged_experts(
    x: jax.Array,
    routing: Routing,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    adapters: Adapters = NO_ADAPTERS,
) -> jax.Array:
    """x [N, D] -> [N, D]: the (token, expert) pairs sorted by expert, one ragged group per expert."""
    N, k = routing.experts.shape
    flat = routing.experts.reshape(N * k)
    order = jnp.argsort(flat, stable=True)  # pair indices, grouped by expert
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    token = order // k
    rows = jnp.take(x, token, axis=0)  # [M, D]

    def project(inputs: jax.Array, weight: jax.Array, adapter: ExpertAdapter | None) -> jax.Array:
        return _plus(_grouped(inputs, weight, sizes), adapter, lambda a: a.ragged(inputs, token, sizes))

    h = swiglu(project(rows, gate, adapters[0]), project(rows, up, adapters[1]))
    out = project(h, down, adapters[2]) * jnp.take(routing.weights.reshape(N * k), order)[:, None].astype(x.dtype)
    back = jnp.argsort(order)  # the inverse permutation: pair i's row in the sorted order
    return jnp.sum(jnp.take(out, back, axis=0).reshape(N, k, -1), axis=1)


FORMS = {"ragged": ragged_experts, "dense": dense_experts}


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
    ) -> None:
        lead = ("layers",) * len(stack)
        shape = (*stack, experts, d_out, d_in)
        self.weight = nnx.Param(jnp.zeros(shape, dtype), logical_axes=(*lead, "expert", axes[1], axes[0]))
        if lora is not None:
            self.lora_a, self.lora_b = expert_lora_pair(experts, d_in, d_out, axes, lora, stack)

    def adapter(self, mask: jax.Array | None) -> ExpertAdapter | None:
        if mask is None or not hasattr(self, "lora_a"):
            return None
        return ExpertAdapter.of(self.lora_a[...], self.lora_b[...], mask)


class Experts(nnx.Module):
    """HF's `mlp.experts`: the routed experts' gate, up and down projections, stacked."""

    def __init__(self, cfg: ModelConfig, moe: MoE, lora: LoRASpec | None, stack: tuple[int, ...]) -> None:
        dt, D, F, X = jnp.dtype(cfg.dtype), cfg.hidden_size, moe.expert_size, moe.experts
        self.gate_proj = ExpertLinear(X, D, F, ("embed", "mlp"), dt, stack, lora)
        self.up_proj = ExpertLinear(X, D, F, ("embed", "mlp"), dt, stack, lora)
        self.down_proj = ExpertLinear(X, F, D, ("mlp", "embed"), dt, stack, lora)

    def __call__(self, x: jax.Array, routing: Routing, form: Form, mask: jax.Array | None = None) -> jax.Array:
        """x [N, D]; `mask` [N, G*R]: each token's adapter columns (`tx.lora.experts.token_columns`)."""
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        adapters = (gate.adapter(mask), up.adapter(mask), down.adapter(mask))
        return FORMS[form](x, routing, gate.weight[...], up.weight[...], down.weight[...], adapters)


class Router(nnx.Module):
    """HF's `mlp.gate`: one logit per expert, weight [*stack, X, D] (replicated: it is small)."""

    def __init__(self, cfg: ModelConfig, moe: MoE, stack: tuple[int, ...]) -> None:
        lead = ("layers",) * len(stack)
        shape = (*stack, moe.experts, cfg.hidden_size)
        self.weight = nnx.Param(jnp.zeros(shape, cfg.dtype), logical_axes=(*lead, "router", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return linear(x, self.weight[...])


class SparseMoeBlock(nnx.Module):
    """HF's sparse `mlp`: router, routed experts, and the optional sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None, stack: tuple[int, ...], tuning: Tuning) -> None:
        moe = cfg.moe
        assert moe is not None, "a SparseMoeBlock needs the config's moe section"
        self.gate = Router(cfg, moe, stack)
        self.experts = Experts(cfg, moe, lora, stack)
        if moe.shared_expert_size:
            self.shared_expert = MLP(cfg, lora, stack, tuning, size=moe.shared_expert_size)
            self.shared_expert_gate = LoRALinear(
                cfg.hidden_size, 1, axes=("embed", "router"), dtype=jnp.dtype(cfg.dtype), stack=stack
            )
        self.top_k, self.normalize = moe.top_k, moe.norm_topk_prob
        self.form: Form = "dense" if moe.experts <= tuning.moe_dense_max_experts else "ragged"

    def __call__(self, x: jax.Array, rows: LoRARows | None) -> jax.Array:
        """x [B, T, D] -> [B, T, D]."""
        return self.mix(x, rows)[0]

    def mix(self, x: jax.Array, rows: LoRARows | None) -> tuple[jax.Array, jax.Array]:
        """x [B, T, D] -> (out [B, T, D], the experts each token picked [B*T, k] int16). Unused, the picks
        cost nothing (XLA drops them)."""
        B, T, D = x.shape
        tokens = x.reshape(B * T, D)
        routing = route(self.gate(tokens), self.top_k, self.normalize)
        mask = None if rows is None else token_columns(rows, T, x.dtype)
        out = self.experts(tokens, routing, self.form, mask).reshape(B, T, D)
        if hasattr(self, "shared_expert"):
            gate = jax.nn.sigmoid(self.shared_expert_gate(x, None))
            out = out + gate * self.shared_expert(x, rows)
        return out, routing.experts.astype(jnp.int16)
