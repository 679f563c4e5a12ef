"""Check a Hugging Face checkpoint directory against the model it would build, without loading it.

`check_checkpoint(model_dir)` parses `config.json` into a `ModelConfig` (an unsupported architecture or
field is a `ValueError` naming it, with the supported list), builds the model abstractly (shapes only,
`nnx.eval_shape`: no weight is allocated) and reads only the safetensors headers: every file's header must
fit the file (a truncated shard is named), every tensor must be floating point, and every tensor's name and
shape is placed through `tx.models.weights.place_tensor`, the loader's own mapping, so a directory that
passes is one `load_model` loads. A sharded checkpoint's index must name exactly the tensors its shards hold.
A config that describes more weights than the files can hold (at 2 bytes each) is refused first, so a
hostile layer count costs nothing. Memory: one header at a time; no tensor data is read. gpt-oss's MXFP4
experts (uint8 `*_blocks` and `*_scales`, half a byte a weight: the size floor is a quarter byte for it)
are placed as the weights they dequantize to, and each blocks tensor must have its scales.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from flax import nnx

from tx.lora.params import LoRAParam
from tx.models import gpt_oss_checkpoint
from tx.models.config import ModelConfig, load_hf_config
from tx.models.safetensors_io import DTYPES, read_header, shard_files
from tx.models.weights import Path_, abstract_for, check_complete, check_weight_dtype, hub_layout, place_tensor
from tx.names import is_valid_name

INDEX = "model.safetensors.index.json"


def check_checkpoint(model_dir: Path) -> ModelConfig:
    """The directory's `ModelConfig`, after checking every tensor against the model; `ValueError` (or
    `FileNotFoundError` for a missing config or weights file) naming the first problem."""
    cfg = load_hf_config(model_dir)
    expected = expected_weights(cfg)
    weight_map = _read_index(model_dir)
    files = shard_files(model_dir)
    _check_size(cfg, expected, files)
    whole: set[Path_] = set()
    layers_seen: dict[Path_, set[tuple[int | None, int | None]]] = {}
    held: dict[str, str] = {}  # tensor name -> file
    quantized: dict[str, tuple[int, ...]] = {}  # gpt-oss's MXFP4 tensors -> shape
    for file in files:
        header, _ = read_header(file)
        for key, info in header.items():
            if key in held:
                raise ValueError(f"tensor {key!r} is stored twice, in {held[key]} and {file.name}")
            held[key] = file.name
            if cfg.family == "gpt_oss" and gpt_oss_checkpoint.is_quantized(key):
                quantized[key] = tuple(info["shape"])
            _place_all(cfg, expected, key, info, file.name, whole, layers_seen)
    gpt_oss_checkpoint.check_pairs(quantized)
    check_complete(expected, whole, layers_seen, cfg)
    if weight_map is not None:
        _check_index(weight_map, held)
    return cfg


def expected_weights(cfg: ModelConfig) -> dict[Path_, nnx.Variable]:
    """The base weights (shapes only) a model of `cfg` holds, by path: nothing is allocated."""
    _, state = nnx.split(abstract_for(cfg, None, False))
    flat = {tuple(map(str, p)): v for p, v in nnx.to_flat_state(state)}
    return {p: v for p, v in flat.items() if not isinstance(v, LoRAParam)}


def _check_size(cfg: ModelConfig, expected: dict[Path_, nnx.Variable], files: list[Path]) -> None:
    """The weights the config describes must fit in the files, at 2 bytes each at least (`_least_bytes`): a config that
    claims a billion layers is refused here, before anything is built or counted per layer."""
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{INDEX} names {missing[0]}, which is not in the directory")
    count = sum(math.prod(var.shape) for var in expected.values())
    floor = sum(math.prod(var.shape) * _least_bytes(cfg, path) for path, var in expected.items())
    stored = sum(f.stat().st_size for f in files)
    if floor > stored:
        raise ValueError(
            f"config.json describes {count} weights, at least {int(floor)} bytes as stored, "
            f"but the safetensors files hold {stored} bytes"
        )


def _least_bytes(cfg: ModelConfig, path: Path_) -> float:
    """The fewest bytes a checkpoint stores one weight of `path` in: 2, or half a byte for gpt-oss's experts
    (MXFP4: 4 bits, plus a byte per 32)."""
    return 0.5 if cfg.family == "gpt_oss" and "experts" in path and path[-1] == "weight" else 2.0


def _place_all(
    cfg: ModelConfig, expected: dict, key: str, info: dict, file: str, whole: set, layers_seen: dict
) -> None:
    """Place one stored tensor (a fused expert tensor is several) as the loader would, recording what it fills."""
    if cfg.family == "gpt_oss":
        if not gpt_oss_checkpoint.is_quantized(key) or info["dtype"] != "U8":
            check_weight_dtype(key, file, DTYPES[info["dtype"]])
        shapes = gpt_oss_checkpoint.stored_shapes(key, tuple(info["shape"]))
    else:
        check_weight_dtype(key, file, DTYPES[info["dtype"]])
        shaped = np.broadcast_to(np.zeros((), DTYPES[info["dtype"]]), tuple(info["shape"]))  # shape only, no bytes
        shapes = [(name, view.shape) for name, view in hub_layout(key, shaped)]
    for name, shape in shapes:
        placed = place_tensor(cfg, expected, name, shape, file)
        if placed is None:
            continue
        path, index, seen = placed
        if index:
            layers_seen.setdefault(path, set()).add(seen)
        else:
            whole.add(path)


def _read_index(model_dir: Path) -> dict[str, str] | None:
    """A sharded checkpoint's weight map (tensor -> shard file), its file names plain names in the directory."""
    index = model_dir / INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{INDEX} has no weight_map object")
    for file in set(weight_map.values()):
        if not is_valid_name(file) or not str(file).endswith(".safetensors"):
            raise ValueError(f"{INDEX} names shard {str(file)[:80]!r}: shards are .safetensors files of the directory")
    return weight_map


def _check_index(weight_map: dict[str, str], held: dict[str, str]) -> None:
    for key, file in weight_map.items():
        if held.get(key) != file:
            raise ValueError(f"{INDEX} puts tensor {key!r} in {file}, but {held.get(key) or 'no shard'} holds it")
    unlisted = sorted(set(held) - set(weight_map))
    if unlisted:
        raise ValueError(f"tensor {unlisted[0]!r} in {held[unlisted[0]]} is not in {INDEX}")
