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
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

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


def dense_experts(x: jax.Array, routing: Routing, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """x [N, D], expert weights gate, up [X, F, D] and down [X, D, F] -> [N, D]: all experts on all
    tokens, each expert's activations scaled by its routing weight before the down projection."""
    combine = dense_combine(routing, gate.shape[0])
    g = jnp.einsum("nd,xfd->xnf", x, gate)
    u = jnp.einsum("nd,xfd->xnf", x, up)
    h = swiglu(g, u) * combine.T[:, :, None].astype(x.dtype)
    return jnp.einsum("xnf,xdf->nd", h, down)


_OUT_IN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)  # lhs [M, in] against rhs [X, out, in]: the checkpoint's [out, in] layout, no transposed copy


def _grouped(rows: jax.Array, weight: jax.Array, sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot_general(rows, weight, sizes, _OUT_IN)


def ragged_experts(x: jax.Array, routing: Routing, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """x [N, D] -> [N, D]: the (token, expert) pairs sorted by expert, one ragged group per expert."""
    N, k = routing.experts.shape
    flat = routing.experts.reshape(N * k)
    order = jnp.argsort(flat, stable=True)  # pair indices, grouped by expert
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    rows = jnp.take(x, order // k, axis=0)  # [M, D]
    h = swiglu(_grouped(rows, gate, sizes), _grouped(rows, up, sizes))
    out = _grouped(h, down, sizes) * jnp.take(routing.weights.reshape(N * k), order)[:, None].astype(x.dtype)
    back = jnp.argsort(order)  # the inverse permutation: pair i's row in the sorted order
    return jnp.sum(jnp.take(out, back, axis=0).reshape(N, k, -1), axis=1)


FORMS = {"ragged": ragged_experts, "dense": dense_experts}


class ExpertLinear(nnx.Module):
    """One projection of every expert: weight [*stack, X, out, in] (the checkpoint's per-expert layout)."""

    def __init__(self, experts: int, d_in: int, d_out: int, axes: tuple[str, str], dtype: jnp.dtype, stack: tuple):
        lead = ("layers",) * len(stack)
        shape = (*stack, experts, d_out, d_in)
        self.weight = nnx.Param(jnp.zeros(shape, dtype), logical_axes=(*lead, "expert", axes[1], axes[0]))


class Experts(nnx.Module):
    """HF's `mlp.experts`: the routed experts' gate, up and down projections, stacked."""

    def __init__(self, cfg: ModelConfig, moe: MoE, stack: tuple[int, ...]) -> None:
        dt, D, F, X = jnp.dtype(cfg.dtype), cfg.hidden_size, moe.expert_size, moe.experts
        self.gate_proj = ExpertLinear(X, D, F, ("embed", "mlp"), dt, stack)
        self.up_proj = ExpertLinear(X, D, F, ("embed", "mlp"), dt, stack)
        self.down_proj = ExpertLinear(X, F, D, ("mlp", "embed"), dt, stack)

    def __call__(self, x: jax.Array, routing: Routing, form: Form) -> jax.Array:
        weights = (self.gate_proj.weight[...], self.up_proj.weight[...], self.down_proj.weight[...])
        return FORMS[form](x, routing, *weights)


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
        self.experts = Experts(cfg, moe, stack)
        if moe.shared_expert_size:
            self.shared_expert = MLP(cfg, lora, stack, tuning, size=moe.shared_expert_size)
            self.shared_expert_gate = LoRALinear(
                cfg.hidden_size, 1, axes=("embed", "router"), dtype=jnp.dtype(cfg.dtype), stack=stack
            )
        self.top_k, self.normalize = moe.top_k, moe.norm_topk_prob
        self.form: Form = "dense" if moe.experts <= tuning.moe_dense_max_experts else "ragged"

    def __call__(self, x: jax.Array, rows: LoRARows | None) -> jax.Array:
        """x [B, T, D] -> [B, T, D]."""
        B, T, D = x.shape
        tokens = x.reshape(B * T, D)
        routing = route(self.gate(tokens), self.top_k, self.normalize)
        out = self.experts(tokens, routing, self.form).reshape(B, T, D)
        if hasattr(self, "shared_expert"):
            gate = jax.nn.sigmoid(self.shared_expert_gate(x, None))
            out = out + gate * self.shared_expert(x, rows)
        return out
