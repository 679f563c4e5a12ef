"""Move one adapter between a slot of the model's stacked LoRA state and the neutral `AdapterWeights` form.

The model's adapters are `LoRAParam` variables shaped A `[*stack, S, in, R]` and B `[*stack, S, R, out]`
(`stack`: the scanned layer axis, absent for `lm_head`, then the `expert` axis on a MoE block's experts).
Everything here is generic over the state from `nnx.state(model, LoRAParam)`: variables are chosen by
type, their slot, stacked and rank axes are read from the `logical_axes` metadata (`adapter`, `layers`,
`expert`, `lora_rank`), A and B are told apart by their types (`LoRAA`, `LoRAB`), and the path is read only to
spell the HF module name (`model.layers.3.self_attn.q_proj`, `model.layers.3.mlp.experts.5.up_proj`,
`lm_head`). Writes go through small jitted functions that take the slot as a traced integer (one compile
per array shape, not per slot), keep each array's sharding, and donate the array they replace: the input
state's arrays are consumed, so apply the returned state (`nnx.update(model, new)`) or thread it on.
Slot 0 is the base model and is never written.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tx.gather import to_host
from tx.lora.params import LoRAA, LoRAParam
from tx.lora.peft import AdapterConfig, AdapterWeights
from tx.lora.select import slot_slice

LayerOf = Callable[[tuple[str, ...], int], int]  # (module path, stacked index) -> model layer number


STACKED = ("layers", "expert")  # the axes an adapter may be stacked over before its slot axis, in this order
_CONTAINER = {"layers": "layers", "expert": "experts"}  # the path entry whose children the stacked axis numbers


@dataclasses.dataclass(frozen=True)
class _Module:
    """One adapted module: its A and B variables' flat-state paths and where their axes are."""

    path: tuple[str, ...]  # module path, e.g. ("model", "layers", "self_attn", "q_proj")
    a: tuple[str, ...]
    b: tuple[str, ...]
    stacked: tuple[str, ...]  # the stacked axes before the slot axis: (), ("layers",) or ("layers", "expert")
    lead: tuple[int, ...]  # their sizes

    @property
    def slot_axis(self) -> int:
        return len(self.stacked)

    @property
    def short(self) -> str:
        return self.path[-1]

    def hf_names(self, layer_of: LayerOf | None = None) -> list[str]:
        """HF module names, one per stacked entry (row-major over the stacked axes): a layer number follows
        the `layers` container in the path, an expert number the `experts` container
        (`model.layers.3.mlp.experts.5.gate_proj`). `layer_of(path, i)`: the model layer that stacked entry i
        is (default i; a model whose sub-modules are stacked over only some layers, as Qwen3.5's mixers are,
        maps them)."""
        number = layer_of or (lambda _, i: i)
        names = []
        for index in np.ndindex(*self.lead):
            parts = list(self.path)
            for axis, i in reversed(list(zip(self.stacked, index, strict=True))):
                label = number(self.path, int(i)) if axis == "layers" else int(i)
                parts.insert(parts.index(_CONTAINER[axis]) + 1, str(label))
            names.append(".".join(parts))
        return names

    def entries(self, array: np.ndarray) -> np.ndarray:
        """One slot's array [*lead, d0, d1] as [entries, d0, d1], in `hf_names` order (a view where possible)."""
        return array.reshape(-1, *array.shape[-2:])


def _axes(path: tuple[str, ...], var: nnx.Variable) -> tuple[str | None, ...]:
    axes = tuple(var.get_metadata().get("logical_axes") or ())
    if "adapter" not in axes or "lora_rank" not in axes:
        raise ValueError(f"LoRA variable {'.'.join(path)} lacks logical_axes naming its 'adapter' and 'lora_rank' axes")
    return axes


def _modules(flat: Mapping[tuple[str, ...], nnx.Variable]) -> dict[tuple[str, ...], _Module]:
    """Pair every module's A and B factor (by their types)."""
    parts: dict[tuple[str, ...], dict[str, tuple[str, ...]]] = {}
    for path, var in flat.items():
        kind = "a" if isinstance(var, LoRAA) else "b"
        parts.setdefault(path[:-1], {})[kind] = path
    modules = {}
    for module, pair in parts.items():
        if set(pair) != {"a", "b"}:
            raise ValueError(f"LoRA state for {'.'.join(module)} lacks its {'A' if 'a' not in pair else 'B'} factor")
        axes = _axes(pair["a"], flat[pair["a"]])
        depth = axes.index("adapter")
        if axes[:depth] != STACKED[:depth]:
            raise ValueError(f"LoRA state for {'.'.join(module)} is stacked over {axes[:depth]}, not {STACKED[:depth]}")
        lead = tuple(flat[pair["a"]].shape[:depth])
        modules[module] = _Module(module, pair["a"], pair["b"], STACKED[:depth], lead)
    return modules


def seed_key(seed: int) -> jax.Array:
    """A PRNG key from every bit of a 64-bit `seed` (negative ones too): `jax.random.key` keeps the low 32
    (2**32 seeded what 0 did); seeds below 2**32 keep the key they always had."""
    key = jax.random.key(seed & 0xFFFFFFFF)
    high = (seed >> 32) & 0xFFFFFFFF
    return jax.random.fold_in(key, high) if high else key


def _lora_flat(lora_state: nnx.State) -> dict[tuple[str, ...], nnx.Variable]:
    flat = {tuple(map(str, p)): v for p, v in nnx.to_flat_state(lora_state)}
    return {p: v for p, v in flat.items() if isinstance(v, LoRAParam)}


def _with_values(lora_state: nnx.State, values: Mapping[tuple[str, ...], jax.Array]) -> nnx.State:
    """A new state: the same variables, with `values` replacing those paths' arrays."""
    flat = [(p, v) for p, v in nnx.to_flat_state(lora_state)]
    return nnx.from_flat_state(
        [(p, v.replace(values[k]) if (k := tuple(map(str, p))) in values else v) for p, v in flat]
    )


def _check_slot(slot: int, var: nnx.Variable, axis: int, writing: bool) -> None:
    S = var.shape[axis]
    if not (1 if writing else 0) <= slot < S:
        raise ValueError(f"LoRA slot {slot} is out of range: slots 1..{S - 1} hold adapters (slot 0 is the base model)")


# ------------------------------------------------------------------------------------------ device kernels


@functools.cache
def _writer(kind: str, axis: int, sharding: jax.sharding.Sharding) -> Callable[..., jax.Array]:
    """A jitted slot update for arrays with this slot axis and sharding; the stacked array is donated."""

    def put(stacked: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_index_in_dim(stacked, value.astype(stacked.dtype), slot, axis)

    def copy(stacked: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
        return put(stacked, dst, jax.lax.dynamic_index_in_dim(stacked, src, axis, keepdims=False))

    def init(stacked: jax.Array, slot: jax.Array, key: jax.Array, rank: jax.Array, bound: jax.Array) -> jax.Array:
        # PEFT's default A init (kaiming_uniform_ with a=sqrt(5)) is U(-1/sqrt(in), 1/sqrt(in)); columns past the
        # adapter's rank stay zero so the stacked maximum rank never leaks into a smaller adapter.
        shape = stacked.shape[:axis] + stacked.shape[axis + 1 :]
        draw = jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0) * bound
        return put(stacked, slot, jnp.where(jnp.arange(shape[-1]) < rank, draw, 0.0))

    def zero(stacked: jax.Array, slot: jax.Array) -> jax.Array:
        return put(stacked, slot, jnp.zeros(stacked.shape[:axis] + stacked.shape[axis + 1 :], stacked.dtype))

    fns: dict[str, Callable[..., jax.Array]] = {"put": put, "copy": copy, "init": init, "zero": zero}
    return jax.jit(fns[kind], donate_argnums=0, out_shardings=sharding)


def _run(kind: str, var: nnx.Variable, axis: int, *args: object) -> jax.Array:
    array = var.get_value()
    return _writer(kind, axis, array.sharding)(array, *(jnp.asarray(a) if isinstance(a, int) else a for a in args))


# ------------------------------------------------------------------------------------------ public API


def read_slot(
    lora_state: nnx.State, slot: int, rank: int, targets: frozenset[str], layer_of: LayerOf | None = None
) -> AdapterWeights:
    """The adapter in `slot` as {HF module name: (A [in, rank], B [rank, out])} float32, for `targets` only."""
    flat = _lora_flat(lora_state)
    weights: AdapterWeights = {}
    for module in _modules(flat).values():
        if module.short not in targets:
            continue
        a_var, b_var = flat[module.a], flat[module.b]
        _check_slot(slot, a_var, module.slot_axis, writing=False)
        a = to_host(slot_slice(a_var.get_value(), slot, rank, a=True)).astype(np.float32)
        b = to_host(slot_slice(b_var.get_value(), slot, rank, a=False)).astype(np.float32)
        a, b = module.entries(a), module.entries(b)
        for i, name in enumerate(module.hf_names(layer_of)):
            weights[name] = (np.ascontiguousarray(a[i]), np.ascontiguousarray(b[i]))
    return weights


def write_slot(
    lora_state: nnx.State,
    slot: int,
    config: AdapterConfig,
    weights: Mapping[str, tuple[np.ndarray, np.ndarray]],
    layer_of: LayerOf | None = None,
) -> nnx.State:
    """Load an adapter into `slot`: zero-padded to the stacked rank; every module not in `weights` is zeroed.

    `weights` may carry a padded rank above `config.rank`; only the first `config.rank` components are used.
    """
    flat = _lora_flat(lora_state)
    modules = _modules(flat)
    _check_rank(config.rank, flat, modules)
    names = {name: (module, i) for module in modules.values() for i, name in enumerate(module.hf_names(layer_of))}
    _check_names(config, weights, names)
    values: dict[tuple[str, ...], jax.Array] = {}
    for module in modules.values():
        a_var, b_var = flat[module.a], flat[module.b]
        _check_slot(slot, a_var, module.slot_axis, writing=True)
        a_host = np.zeros(_slot_shape(a_var, module.slot_axis), np.float32)
        b_host = np.zeros(_slot_shape(b_var, module.slot_axis), np.float32)
        a3, b3 = module.entries(a_host), module.entries(b_host)
        for i, name in enumerate(module.hf_names(layer_of)):
            if name in weights:
                a3[i, :, : config.rank], b3[i, : config.rank, :] = _fitted(name, config.rank, weights[name], a3, b3)
        values[module.a] = _run("put", a_var, module.slot_axis, slot, a_host)
        values[module.b] = _run("put", b_var, module.slot_axis, slot, b_host)
    return _with_values(lora_state, values)


def copy_slot(lora_state: nnx.State, src: int, dst: int) -> nnx.State:
    """Copy every adapter array of slot `src` into slot `dst` on device (a sampler snapshot of a run)."""
    flat = _lora_flat(lora_state)
    values = {}
    for module in _modules(flat).values():
        for path in (module.a, module.b):
            _check_slot(src, flat[path], module.slot_axis, writing=False)
            _check_slot(dst, flat[path], module.slot_axis, writing=True)
            values[path] = _run("copy", flat[path], module.slot_axis, src, dst)
    return _with_values(lora_state, values)


def init_slot(lora_state: nnx.State, slot: int, rank: int, targets: frozenset[str], seed: int) -> nnx.State:
    """A fresh adapter as PEFT starts one: A uniform in ±1/sqrt(in) on the first `rank` columns, B zero.

    Modules outside `targets` are zeroed. Each module's draw depends only on `seed` and its own path, so the
    same seed gives the same A whatever the other targets, slot or mesh.
    """
    flat = _lora_flat(lora_state)
    modules = _modules(flat)
    _check_rank(rank, flat, modules)
    values = {}
    for module in modules.values():
        a_var = flat[module.a]
        _check_slot(slot, a_var, module.slot_axis, writing=True)
        if module.short in targets:
            key = jax.random.fold_in(seed_key(seed), zlib.crc32(".".join(module.path).encode()))
            bound = jnp.float32(1.0 / np.sqrt(a_var.shape[module.slot_axis + 1]))
            values[module.a] = _run("init", a_var, module.slot_axis, slot, key, rank, bound)
        else:
            values[module.a] = _run("zero", a_var, module.slot_axis, slot)
        values[module.b] = _run("zero", flat[module.b], module.slot_axis, slot)
    return _with_values(lora_state, values)


def adapter_targets(lora_state: nnx.State) -> frozenset[str]:
    """The short module names (q_proj, ..., lm_head) that the model carries adapters for."""
    return frozenset(module.short for module in _modules(_lora_flat(lora_state)).values())


# ------------------------------------------------------------------------------------------ checks


def _slot_shape(var: nnx.Variable, axis: int) -> tuple[int, ...]:
    return var.shape[:axis] + var.shape[axis + 1 :]


def _check_rank(
    rank: int, flat: Mapping[tuple[str, ...], nnx.Variable], modules: Mapping[tuple[str, ...], _Module]
) -> None:
    max_rank = min((flat[m.a].shape[-1] for m in modules.values()), default=0)
    if rank > max_rank:
        raise ValueError(
            f"adapter rank {rank} is above the {max_rank} this server's LoRA slots hold; "
            f"restart with --max-lora-rank {rank} (or more) to load it"
        )


def _check_names(
    config: AdapterConfig, weights: Mapping[str, object], names: Mapping[str, tuple[_Module, int]]
) -> None:
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(
            f"the model has no LoRA-adapted modules {unknown[:5]} (the adapter was made for another model?)"
        )
    outside = sorted(n for n in weights if names[n][0].short not in config.target_modules)
    if outside:
        raise ValueError(f"weights for {outside[:5]} are not in the adapter's target_modules {config.target_modules}")


def _fitted(
    name: str, rank: int, pair: tuple[np.ndarray, np.ndarray], a3: np.ndarray, b3: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(pair[0], np.float32), np.asarray(pair[1], np.float32)
    d_in, d_out = a3.shape[1], b3.shape[2]
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != d_in or b.shape[1] != d_out or min(a.shape[1], b.shape[0]) < rank:
        raise ValueError(f"{name}: A {a.shape} and B {b.shape} do not fit [{d_in}, >={rank}] and [>={rank}, {d_out}]")
    return a[:, :rank], b[:rank, :]
