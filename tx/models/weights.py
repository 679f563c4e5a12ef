"""Load Hugging Face safetensors into a (sharded) model, streaming tensor by tensor.

The model is created abstractly (shapes only); each base weight is then written once: whole tensors
go straight to their sharded device array, and per-layer tensors are written into a preallocated
stacked array with a donated in-place update, so host memory holds one tensor at a time and no random
initialisation ever runs. Weights keep the checkpoint's layout ([out, in] for linear layers).
Missing, unexpected or mis-shaped tensors raise an error naming the tensor. A family whose text model
sits under another prefix (Qwen3.5's multimodal `model.language_model.*`) is read from there, its other
towers (`model.visual.*`) and the multi-token-prediction head (`mtp.*`) skipped; a decoder sub-module
stacked over only some layers (Qwen3.5's `linear_attn`, `self_attn`; Qwen3-MoE's experts and dense MLPs when
some layers are dense) takes layer i at its rank among them.
A mixture-of-experts block's per-expert tensors (`mlp.experts.{i}.gate_proj.weight`, the hub's layout and
what transformers' `save_pretrained` writes) are stacked on the expert axis as they stream; transformers 5's
fused in-memory form (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) is read too, split per expert.
gpt-oss keeps its fused, interleaved `gate_up_proj` whole per expert, read from its fused or MXFP4 tensors
and written back fused (`tx.models.gpt_oss_checkpoint`).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from tx.gather import is_writer, to_host
from tx.lora.layers import LoRASpec
from tx.lora.params import LoRAParam
from tx.lora.peft import atomic_dir
from tx.models import gpt_oss_checkpoint
from tx.models.catalog import SKIPPED_PARTS, locate_model
from tx.models.causal_lm import CausalLM, abstract_model
from tx.models.config import HYBRID_FAMILIES, ModelConfig, load_hf_config
from tx.models.qwen3_5 import Qwen3_5CausalLM, abstract_qwen3_5
from tx.models.safetensors_io import iter_tensors, shard_files
from tx.models.sharding import make_mesh, state_shardings
from tx.tuning import Tuning

log = logging.getLogger(__name__)

Path_ = tuple[str, ...]
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
SKIPPED = {family: SKIPPED_PARTS for family in HYBRID_FAMILIES}  # tensors of parts we do not run


def hf_key_to_path(key: str, prefix: str = "model") -> tuple[Path_, int | None]:
    """HF tensor name -> (our state path, layer index or None). Layouts are the checkpoint's own; the text
    model's `prefix` (e.g. "model.language_model") becomes our `model`."""
    if prefix != "model" and key.startswith(prefix + "."):
        key = "model" + key[len(prefix) :]
    m = _LAYER_KEY.match(key)
    if m:
        return ("model", "layers", *m.group(2).split(".")), int(m.group(1))
    return tuple(key.split(".")), None


def path_to_hf_key(path: Path_, layer: int | None, prefix: str = "model", expert: int | None = None) -> str:
    parts = list(path)
    if expert is not None:
        parts.insert(parts.index("experts") + 1, str(expert))
    if layer is not None:
        parts.insert(2, str(layer))
    if parts[0] == "model":
        parts[0] = prefix
    return ".".join(parts)


def text_module_name(name: str, cfg: ModelConfig) -> str:
    """A module name under the checkpoint's text prefix (`model.language_model.layers.3.mlp`) as the text
    model spells it (`model.layers.3.mlp`); other names unchanged."""
    prefix = cfg.checkpoint_prefix + "."
    return "model." + name[len(prefix) :] if cfg.checkpoint_prefix != "model" and name.startswith(prefix) else name


def split_expert(path: Path_) -> tuple[Path_, int | None]:
    """(..., "experts", "3", "gate_proj", "weight") -> ((..., "experts", "gate_proj", "weight"), 3)."""
    for i, part in enumerate(path[:-1]):
        if part == "experts" and path[i + 1].isdigit():
            return (*path[: i + 1], *path[i + 2 :]), int(path[i + 1])
    return path, None


def hub_layout(key: str, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """transformers 5's fused expert tensors, `experts.gate_up_proj` [X, 2F, D] (gate rows first) and
    `experts.down_proj` [X, D, F], as the hub's per-expert [out, in] tensors; any other tensor as it is."""
    if key.endswith(".experts.gate_up_proj"):
        base, F = key[: -len("gate_up_proj")], array.shape[1] // 2
        for e in range(array.shape[0]):
            yield f"{base}{e}.gate_proj.weight", array[e, :F]
            yield f"{base}{e}.up_proj.weight", array[e, F:]
    elif key.endswith(".experts.down_proj"):
        for e in range(array.shape[0]):
            yield f"{key[: -len('down_proj')]}{e}.down_proj.weight", array[e]
    else:
        yield key, array


def checkpoint_tensors(cfg: ModelConfig, files: list[Path]) -> Iterator[tuple[str, str, np.ndarray]]:
    """The checkpoint's tensors in the names and layouts the model holds (experts per expert), each with the
    name of the file it came from. gpt-oss's MXFP4 blocks and scales may sit in different files."""
    current = [""]

    def raw() -> Iterator[tuple[str, np.ndarray]]:
        for file in files:
            current[0] = file.name
            yield from iter_tensors(file)

    if cfg.family == "gpt_oss":
        stream = gpt_oss_checkpoint.per_expert(raw())
    else:
        stream = (pair for key, array in raw() for pair in hub_layout(key, array))
    for key, array in stream:
        yield current[0], key, array


def abstract_for(
    cfg: ModelConfig, lora: LoRASpec | None, remat: bool, tuning: Tuning | None = None
) -> CausalLM | Qwen3_5CausalLM:
    """The family's model class, with shapes only (Qwen3.5 takes only the MoE forms of `tuning`)."""
    if cfg.family in HYBRID_FAMILIES:
        return abstract_qwen3_5(cfg, lora, remat, tuning)
    return abstract_model(cfg, lora, remat, tuning)


def _stack_index(cfg: ModelConfig, path: Path_, layer: int, key: str) -> int:
    """Layer `layer`'s index in the stacked weight at `path` (its rank among the layers holding it)."""
    holding = cfg.layers_holding(*path[2:4])
    if layer not in holding:
        raise ValueError(
            f"unexpected tensor {key!r}: layer {layer} has no {'.'.join(path[2:4])} (of {cfg.num_layers} layers)"
        )
    return holding.index(layer)


@functools.partial(jax.jit, donate_argnums=0)
def _set_at(stacked: jax.Array, index: jax.Array, value: jax.Array) -> jax.Array:
    """stacked[*index] = value, in place; `index` [n] int32 over the leading (layer, expert) axes."""
    lead = index.shape[0]
    start = (*index, *(jnp.int32(0),) * value.ndim)
    return jax.lax.dynamic_update_slice(stacked, value.astype(stacked.dtype).reshape((1,) * lead + value.shape), start)


def _allocate(shape: tuple[int, ...], dtype: jnp.dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def load_model(
    name_or_dir: str,
    *,
    dtype: str | None = None,
    lora: LoRASpec | None = None,
    mesh: Mesh | None = None,
    remat: bool = False,
    progress: bool = True,
    tuning: Tuning | None = None,
) -> tuple[CausalLM | Qwen3_5CausalLM, ModelConfig]:
    """Build the model for a HF checkpoint and fill its weights; LoRA slots start at zero. `tuning`: the
    backend choices the model is built with (default: those of the backend JAX runs on)."""
    model_dir = locate_model(name_or_dir)
    cfg = load_hf_config(model_dir, dtype)
    mesh = mesh or make_mesh(devices=jax.devices()[:1])
    abstract = abstract_for(cfg, lora, remat, tuning)
    graphdef, state = nnx.split(abstract)
    shardings = state_shardings(state, mesh)
    flat: dict[Path_, nnx.Variable] = {tuple(map(str, p)): v for p, v in nnx.to_flat_state(state)}
    flat_shard = {tuple(map(str, p)): s for p, s in nnx.to_flat_state(shardings)}
    values = _stream_weights(model_dir, cfg, flat, flat_shard, progress)
    for path, var in flat.items():
        if isinstance(var, LoRAParam):
            values[path] = _allocate(var.shape, var.dtype, flat_shard[path])
        var.set_value(values[path])
    return nnx.merge(graphdef, state), cfg


def _stream_weights(
    model_dir: Path, cfg: ModelConfig, flat: dict, shardings: dict, progress: bool
) -> dict[Path_, jax.Array]:
    expected = {p: v for p, v in flat.items() if not isinstance(v, LoRAParam)}
    layers_seen: dict[Path_, set[tuple[int | None, int | None]]] = {}  # (layer, expert) written
    values: dict[Path_, jax.Array] = {}
    files = shard_files(model_dir)
    bar = tqdm(desc=f"loading {model_dir.name}", unit="tensor", disable=not progress, leave=False)
    for file_name, key, array in checkpoint_tensors(cfg, files):
        bar.update()
        check_weight_dtype(key, file_name, array.dtype)
        placed = place_tensor(cfg, expected, key, array.shape, file_name)
        if placed is None:
            continue
        path, index, seen = placed
        var = expected[path]
        if not index:
            values[path] = own_shards(array, var.dtype, shardings[path])
            continue
        if path not in values:
            values[path] = _allocate(var.shape, var.dtype, shardings[path])
        value = own_shards(array, var.dtype, _inner_sharding(shardings[path], len(index)))
        values[path] = _set_at(values[path], np.asarray(index, np.int32), value)
        layers_seen.setdefault(path, set()).add(seen)
    bar.close()
    check_complete(expected, set(values), layers_seen, cfg)
    return values


def own_shards(array: np.ndarray, dtype: jnp.dtype, sharding: NamedSharding) -> jax.Array:
    """A checkpoint tensor (memory-mapped) as a device array placed by `sharding`, each process reading and
    casting only the slices its own devices hold: on several hosts no process materialises the others' shards."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: np.asarray(array[index]).astype(dtype))


def _inner_sharding(stacked: NamedSharding, lead: int) -> NamedSharding:
    """The sharding of one entry of a stacked weight: the stacked weight's, less its `lead` leading axes."""
    return NamedSharding(stacked.mesh, PartitionSpec(*tuple(stacked.spec)[lead:]))


def check_weight_dtype(key: str, file: str, dtype: np.dtype) -> None:
    """Base weights are stored as floating point (cast to the model's dtype as they load); an integer tensor
    is a quantised or foreign checkpoint, which casting would silently corrupt."""
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"tensor {key!r} in {file} has dtype {dtype}; base weights must be floating point")


def place_tensor(
    cfg: ModelConfig, expected: dict[Path_, nnx.Variable], key: str, shape: tuple[int, ...], file: str
) -> tuple[Path_, tuple, tuple[int | None, int | None]] | None:
    """Where checkpoint tensor `key` of `shape` goes: (our weight's path, its index in the stacked weight,
    the (layer, expert) it fills), or None for a tensor loading skips. Raises `ValueError` naming the tensor
    when the model has no such weight or it has another shape. The loader and `tx.models.checkpoint_check`
    both place tensors through here, so a checked checkpoint is one that loads."""
    if key.startswith(SKIPPED.get(cfg.family, ())):
        return None
    path, layer = hf_key_to_path(key, cfg.checkpoint_prefix)
    path, expert = split_expert(path)
    if path == ("lm_head", "weight") and cfg.tie_word_embeddings:
        return None  # some checkpoints store the tied copy too
    if path not in expected:
        raise ValueError(f"unexpected tensor {key!r} in {file}: no such weight in a {cfg.family} model")
    var = expected[path]
    index = _indices(cfg, path, var, layer, expert, key)
    want = tuple(var.shape[len(index) :])
    if tuple(shape) != want:
        raise ValueError(f"tensor {key!r} has shape {tuple(shape)}, expected {want} (in {file})")
    return path, index, (layer, expert)


def _has_experts(var: nnx.Variable) -> bool:
    return "expert" in (var.get_metadata().get("logical_axes") or ())


def _indices(
    cfg: ModelConfig, path: Path_, var: nnx.Variable, layer: int | None, expert: int | None, key: str
) -> tuple:
    """Where a checkpoint tensor goes in its stacked weight: () whole, (layer rank,), or (layer rank, expert)."""
    if (expert is not None) != _has_experts(var):
        layout = "per expert" if _has_experts(var) else "whole"
        raise ValueError(f"unexpected tensor {key!r}: this model keeps {'.'.join(path)} {layout}")
    if layer is None:
        return ()
    index = (_stack_index(cfg, path, layer, key),)
    if expert is None:
        return index
    if expert >= var.shape[1]:
        raise ValueError(f"unexpected tensor {key!r}: expert {expert} of a model with {var.shape[1]} experts")
    return (*index, expert)


def check_complete(expected: dict, whole: set[Path_], layers_seen: dict, cfg: ModelConfig) -> None:
    """`ValueError` naming the first weight of `expected` the checkpoint did not fill: `whole` holds the
    unstacked weights seen, `layers_seen` the (layer, expert) pairs seen of each stacked one."""
    for path, var in expected.items():
        stacked = path[:2] == ("model", "layers")
        experts = range(var.shape[1]) if _has_experts(var) else [None]
        want = [(layer, e) for layer in cfg.layers_holding(*path[2:4]) for e in experts] if stacked else [(None, None)]
        seen = layers_seen.get(path, set()) if stacked else {(None, None)} if path in whole else set()
        missing = [w for w in want if w not in seen]
        if missing:
            key = path_to_hf_key(path, missing[0][0], cfg.checkpoint_prefix, missing[0][1])
            raise ValueError(f"missing tensor {key!r} in the checkpoint")


def save_hf(params: dict[Path_, jax.Array], cfg: ModelConfig, source_dir: Path, out_dir: Path) -> int:
    """Write `params` (a full weight set, our paths) as a HF model directory that `transformers` loads.

    Config, generation config and tokenizer files are copied from `source_dir`; the weights go to one
    `model.safetensors`. Written into a temporary directory and renamed (`tx.lora.peft.atomic_dir`), so it
    appears whole or not at all.
    Returns the bytes written. Over several processes each gathers the weights and process 0 writes (the others
    return 0).
    """
    import shutil

    from safetensors.numpy import save_file

    tensors = _skipped_tensors(source_dir, cfg)  # towers we do not run are written back unchanged
    for path, value in params.items():
        tensors.update(_hf_tensors(path, to_host(value), cfg))  # gathered on every process
    if not is_writer():
        return 0
    with atomic_dir(out_dir) as tmp:  # a failed write (a full disk) leaves nothing behind, a crash a swept temp
        for f in source_dir.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and not f.name.endswith(".index.json"):
                shutil.copy2(f, tmp / f.name)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return sum(f.stat().st_size for f in out_dir.iterdir())


def _hf_tensors(path: Path_, host: np.ndarray, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """One weight of ours (stacked, or one layer's own buffer from `split_layers`) as checkpoint tensors:
    one per layer, and one per expert of a stacked expert weight."""
    prefix = cfg.checkpoint_prefix
    if path[:2] != ("model", "layers"):
        yield path_to_hf_key(path, None, prefix), host
        return
    if path[2].isdigit():  # one layer's own buffer
        path, layers, host = (*path[:2], *path[3:]), [cfg.layers_holding(*path[3:5])[int(path[2])]], host[None]
    else:
        layers = list(cfg.layers_holding(*path[2:4]))
    experts = "experts" in path  # routed expert weights: [L, X, out, in]
    for index, layer in enumerate(layers):
        if experts and cfg.family == "gpt_oss":
            yield gpt_oss_checkpoint.fused(path_to_hf_key(path, layer, prefix), host[index])
            continue
        if not experts:
            yield path_to_hf_key(path, layer, prefix), np.ascontiguousarray(host[index])
            continue
        for e in range(host.shape[1]):
            yield path_to_hf_key(path, layer, prefix, e), np.ascontiguousarray(host[index, e])


def _skipped_tensors(source_dir: Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The source checkpoint's tensors that loading skips (e.g. Qwen3.5's vision tower), as stored."""
    skipped = SKIPPED.get(cfg.family, ())
    if not skipped:
        return {}
    return {k: np.array(a) for f in shard_files(source_dir) for k, a in iter_tensors(f) if k.startswith(skipped)}
