"""Logical axis names -> mesh axes, in one table, and the helpers that place a state on a mesh.

Every weight declares logical axes (`embed`, `q_heads`, `vocab`, `adapter`, ...) as Param metadata;
modules never read the mesh. The mesh always has the axes `data`, `fsdp`, `expert`, `tp` (size 1 where unused),
so the same program runs on one device or many. A dimension the mesh axis does not divide stays
replicated rather than failing, which keeps tiny test models runnable on any simulated mesh.

Expert parallelism has its own mesh axis, `expert` (size 1 unless asked for): the stacked experts of a
mixture-of-experts block are split across it (each device holds X / expert of them, and their
projections may split their width over `tp` as a dense MLP does), and batch rows are split across it
too, so attention stays data-parallel over the expert ranks. A separate axis rather than reusing `fsdp`
lets the expert degree differ from the degree to which dense weights are split.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tp")

RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp", "expert"),
    "seq": None,
    "layers": None,
    "embed": "fsdp",
    "q_heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "expert": "expert",  # a MoE block's stacked experts
    "router": None,  # the router's per-expert logits (small; every device routes its own tokens)
    "v_heads": "tp",  # Gated DeltaNet value heads (z, a, b, out_proj)
    "conv_channels": "tp",  # Gated DeltaNet q, k, v channels (in_proj_qkv, conv1d)
    "conv_kernel": None,
    "vocab": "tp",
    "norm": None,
    "adapter": None,
    "lora_rank": None,
}


def make_mesh(
    data: int = 1, fsdp: int = 1, tp: int = 1, devices: Sequence[jax.Device] | None = None, *, expert: int = 1
) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    need = data * fsdp * expert * tp
    if need > len(devices):
        sizes = f"data={data} x fsdp={fsdp} x expert={expert} x tp={tp}"
        raise ValueError(f"mesh {sizes} needs {need} devices, only {len(devices)} exist")
    return Mesh(np.array(devices[:need]).reshape(data, fsdp, expert, tp), MESH_AXES)


def partition_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for name, dim in zip(axes, shape, strict=True):
        target = RULES.get(name) if name else None
        names = (target,) if isinstance(target, str) else tuple(target or ())
        names = tuple(n for n in names if n not in used and mesh.shape[n] > 1)
        size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
        if not names or dim % size:
            spec.append(None)
            continue
        used.update(names)
        spec.append(names[0] if len(names) == 1 else names)
    return PartitionSpec(*spec)


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """The NamedSharding of every variable in `state`, from its `logical_axes` metadata."""

    def one(var: nnx.Variable) -> NamedSharding:
        axes = var.get_metadata().get("logical_axes") or (None,) * len(var.shape)
        return NamedSharding(mesh, partition_spec(axes, var.shape, mesh))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def activation_sharding(mesh: Mesh, *axes: str | None) -> NamedSharding:
    """Sharding for a host array such as a [B, T] token batch: rows over data x fsdp when they divide."""
    return NamedSharding(mesh, PartitionSpec(*[RULES.get(a) if a else None for a in axes]))
