"""Qwen3-MoE's MLP when some layers are dense (`mlp_only_layers`, `decoder_sparse_step`).

One module under HF's name `mlp` holds the sparse layers' router and experts (`mlp.gate`, `mlp.experts.*`,
stacked over the sparse layers) and the dense layers' SwiGLU (`mlp.gate_proj`, `mlp.up_proj`, `mlp.down_proj`,
stacked over the dense ones): the names the checkpoint gives each, so loading, PEFT and merging need no
renaming (`ModelConfig.layers_holding` says which layers each stack holds). A layer reads its own entry of
its own kind. In the scanned stack both stacks stay loop-invariant and `jax.lax.cond` on the layer's kind
picks the branch, which indexes its stack by the layer's rank among its kind: one layer body serves any
placement of the dense layers, so compile time stays flat in depth, and only the chosen branch runs.
Unrolled over one layer's weights (the CPU decode form), the kind is a Python bool and the branch plain.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tx.lora.layers import LoRASpec
from tx.lora.params import LoRARows
from tx.models.config import DENSE_MLP_PARTS, ModelConfig
from tx.models.layers import MLP, swiglu
from tx.models.moe import SparseMoeBlock
from tx.tuning import Tuning


@dataclasses.dataclass(frozen=True)
class Placement:
    """Per layer: whether its MLP is sparse, and its rank among the layers of its kind (its entry in that
    kind's stacks)."""

    sparse: tuple[bool, ...]
    rank: tuple[int, ...]

    @staticmethod
    def of(cfg: ModelConfig) -> Placement:
        assert cfg.moe is not None
        sparse = tuple(i in cfg.moe.sparse_layers for i in range(cfg.num_layers))
        rank = tuple(sum(1 for j in range(i) if sparse[j] == sparse[i]) for i in range(cfg.num_layers))
        return Placement(sparse, rank)

    def entry(self, key: tuple[str, ...], layer: int) -> int:
        """Layer `layer`'s entry in the stacked decoder weight at `key` (a path under `model.layers`): its rank
        for an MLP part of its own kind, 0 (unread) for one of the other kind, the layer itself otherwise."""
        if key[0] != "mlp":
            return layer
        own = (key[1] in DENSE_MLP_PARTS) != self.sparse[layer]
        return self.rank[layer] if own else 0


class MixedMLP(SparseMoeBlock):
    """`SparseMoeBlock` over the sparse layers plus the dense layers' `gate_proj`, `up_proj`, `down_proj`."""

    def __init__(self, cfg: ModelConfig, lora: LoRASpec | None, tuning: Tuning) -> None:
        assert cfg.moe is not None
        super().__init__(cfg, lora, (len(cfg.moe.sparse_layers),), tuning)
        dense = MLP(cfg, lora, (len(cfg.dense_mlp_layers),), tuning)
        self.gate_proj, self.up_proj, self.down_proj = dense.gate_proj, dense.up_proj, dense.down_proj

    def dense(self, x: jax.Array, rows: LoRARows | None) -> jax.Array:
        return self.down_proj(swiglu(self.gate_proj(x, rows), self.up_proj(x, rows)), rows)

    def mix_at(
        self, x: jax.Array, rows: LoRARows | None, sparse: jax.Array | bool, rank: jax.Array | None
    ) -> tuple[jax.Array, jax.Array | None]:
        """x [B, T, D] -> (out, the experts each token picked [B*T, k]: zeros for a dense layer in the scan,
        None unrolled). `rank` None: this module holds one layer's weights and `sparse` is a Python bool."""
        if rank is None:
            return self.mix(x, rows) if sparse else (self.dense(x, rows), None)
        graph, state = nnx.split(self)

        def at(parts: frozenset[str]) -> MixedMLP:
            sliced = {k: jax.tree.map(lambda a: a[rank], v) if k in parts else v for k, v in state.items()}
            module = nnx.merge(graph, nnx.State(sliced))
            assert isinstance(module, MixedMLP)
            return module

        dense_parts = frozenset(DENSE_MLP_PARTS)
        sparse_parts = frozenset(str(k) for k in state.keys()) - dense_parts
        N = x.shape[0] * x.shape[1]

        def dense_branch() -> tuple[jax.Array, jax.Array]:
            return at(dense_parts).dense(x, rows), jnp.zeros((N, self.top_k), jnp.int16)

        return jax.lax.cond(sparse, lambda: at(sparse_parts).mix(x, rows), dense_branch)
