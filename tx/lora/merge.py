"""Merge one LoRA adapter into a Hugging Face safetensors checkpoint, producing a plain HF model directory.

The base is read shard by shard (a single `model.safetensors` or shards listed in
`model.safetensors.index.json`); each targeted weight becomes `W + scaling * (A @ B).T`, computed in
float32 and cast back to the tensor's own dtype (or `dtype` when given), and each shard is written
before the next is read, so peak memory is about one shard. Every other file at the top of the base
directory (config.json, generation_config.json, tokenizer files, chat templates) is copied.

Tied embeddings: a LoRA on `lm_head` changes the output projection but not the input embedding, so
when the adapter targets `lm_head` the merged model is untied: `lm_head.weight` is written explicitly
(embedding plus delta, next to `model.embed_tokens.weight`) and `tie_word_embeddings` is set to false
in the written config.json. (PEFT's own `merge_and_unload` instead adds the delta to the shared
matrix, which changes the input embeddings too.) The output directory appears atomically.
"""

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from tx.lora.peft import AdapterConfig, atomic_dir, lora_delta

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
EMBED = "model.embed_tokens.weight"
MULTIMODAL_TEXT = "model.language_model."  # where a multimodal checkpoint (Qwen3.5's hub class) keeps its text model
LM_HEAD = "lm_head.weight"
# Weight files of any format are never copied verbatim: the merged safetensors replace them.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_DTYPE_NAMES = ("float32", "float16", "bfloat16")

DTypeLike = str | np.dtype[Any] | type | None
Pair = tuple[np.ndarray, np.ndarray]


def merge_to_hf(
    base_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    config: AdapterConfig,
    weights: Mapping[str, tuple[np.ndarray, np.ndarray]],
    dtype: DTypeLike = None,
) -> None:
    """Write the base model at `base_dir` with the adapter merged in to `out_dir` (replaced atomically).

    `dtype` ("float32", "float16", "bfloat16" or a numpy dtype) casts every floating tensor; default keeps each
    tensor's own dtype.
    """
    base = Path(base_dir)
    out_dtype = _resolve_dtype(dtype)
    shards = _shard_files(base)
    names = {name: shard for shard in shards for name in _tensor_names(base / shard)}
    weights, embed = _as_stored(weights, names)
    _check_modules(weights, names, embed)
    targets_lm_head = "lm_head" in weights
    add_lm_head = targets_lm_head and LM_HEAD not in names
    with atomic_dir(out_dir) as tmp:
        weight_map: dict[str, str] = {}
        sizes: dict[str, tuple[int, int]] = {}
        for shard in shards:
            written = _merge_shard(base / shard, tmp / shard, config, weights, out_dtype, add_lm_head, embed)
            weight_map.update({name: shard for name in written})
            sizes.update(written)
        if (base / INDEX_NAME).exists():
            _write_index(base / INDEX_NAME, tmp, weight_map, sizes)
        _copy_side_files(base, tmp)
        _write_config(base, tmp, untie=targets_lm_head, dtype=out_dtype)


def _resolve_dtype(dtype: DTypeLike) -> np.dtype[Any] | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported merge dtype {dtype!r}; choose one of {list(_DTYPE_NAMES)}")
        if dtype == "bfloat16":
            # numpy has no bfloat16; ml_dtypes (a JAX dependency) provides the one safetensors reads and writes.
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(dtype)
    return np.dtype(dtype)


def _shard_files(base: Path) -> list[str]:
    if (base / INDEX_NAME).exists():
        weight_map: dict[str, str] = json.loads((base / INDEX_NAME).read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    if (base / SINGLE_NAME).exists():
        return [SINGLE_NAME]
    raise FileNotFoundError(f"{base} has neither {SINGLE_NAME} nor {INDEX_NAME}; only safetensors bases can be merged")


def _tensor_names(file: Path) -> list[str]:
    with safe_open(str(file), framework="numpy") as f:
        return list(f.keys())


def _as_stored(weights: Mapping[str, Pair], names: Mapping[str, str]) -> tuple[dict[str, Pair], str]:
    """Adapter modules (the text model's names, `model.layers.N...`) renamed as the checkpoint stores them
    (a multimodal one keeps the text model under `model.language_model`), and its embedding's name."""
    if not any(name.startswith(MULTIMODAL_TEXT) for name in names):
        return dict(weights), EMBED

    def stored(module: str) -> str:
        text = module.startswith("model.") and not module.startswith(MULTIMODAL_TEXT)
        return MULTIMODAL_TEXT + module.removeprefix("model.") if text else module

    moved = {stored(module): pair for module, pair in weights.items()}
    return moved, MULTIMODAL_TEXT + EMBED.removeprefix("model.")


def _check_modules(weights: Mapping[str, Pair], names: Mapping[str, str], embed: str) -> None:
    wanted = {f"{module}.weight" for module in weights}
    missing = sorted(n for n in wanted if n not in names and not (n == LM_HEAD and embed in names))
    if missing:
        raise ValueError(f"the base checkpoint has no tensors {missing} for the adapter's modules")


def _merge_shard(
    src: Path,
    dst: Path,
    config: AdapterConfig,
    weights: Mapping[str, tuple[np.ndarray, np.ndarray]],
    dtype: np.dtype[Any] | None,
    add_lm_head: bool,
    embed: str,
) -> dict[str, tuple[int, int]]:
    """Merge one shard into `dst`; returns (bytes, elements) of each tensor written (lm_head too when untying)."""
    out: dict[str, np.ndarray] = {}
    with safe_open(str(src), framework="numpy") as f:
        metadata = f.metadata() or {}
        for name in f.keys():
            tensor = f.get_tensor(name)
            out[name] = _merged(tensor, weights.get(name.removesuffix(".weight")), config, dtype)
            if add_lm_head and name == embed:
                out[LM_HEAD] = _merged(tensor, weights["lm_head"], config, dtype)
    # transformers refuses safetensors files whose metadata lacks a known "format".
    save_file(out, str(dst), metadata={**metadata, "format": metadata.get("format", "pt")})
    return {name: (tensor.nbytes, tensor.size) for name, tensor in out.items()}


def _merged(
    tensor: np.ndarray, pair: tuple[np.ndarray, np.ndarray] | None, config: AdapterConfig, dtype: np.dtype[Any] | None
) -> np.ndarray:
    target = dtype if dtype is not None and np.issubdtype(tensor.dtype, np.floating) else tensor.dtype
    if pair is None:
        return tensor.astype(target, copy=False)
    delta = lora_delta(config, *pair)
    if delta.shape != tensor.shape:
        raise ValueError(f"adapter delta {delta.shape} does not fit base weight {tensor.shape}")
    # Sum in float32 so a bf16 base is rounded once, at the end.
    return (tensor.astype(np.float32) + delta).astype(target)


def _write_index(src: Path, tmp: Path, weight_map: Mapping[str, str], sizes: Mapping[str, tuple[int, int]]) -> None:
    index = json.loads(src.read_text())
    index["weight_map"] = dict(sorted(weight_map.items()))
    # Both totals change when lm_head is added or tensors are cast.
    metadata = dict(index.get("metadata") or {})
    metadata["total_size"] = sum(nbytes for nbytes, _ in sizes.values())
    if "total_parameters" in metadata:
        metadata["total_parameters"] = sum(size for _, size in sizes.values())
    index["metadata"] = metadata
    (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _copy_side_files(base: Path, tmp: Path) -> None:
    for file in base.iterdir():
        if file.is_file() and not file.name.endswith(_WEIGHT_SUFFIXES) and file.name not in (INDEX_NAME, "config.json"):
            shutil.copy2(file, tmp / file.name)


def _write_config(base: Path, tmp: Path, untie: bool, dtype: np.dtype[Any] | None) -> None:
    config = json.loads((base / "config.json").read_text())
    # Multimodal-style configs repeat these fields in text_config; keep both views consistent.
    nested = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if untie:
        config["tie_word_embeddings"] = False
        if "tie_word_embeddings" in nested:
            nested["tie_word_embeddings"] = False
    if dtype is not None:
        for section in (config, nested):
            for key in ("dtype", "torch_dtype"):
                if key in section or (section is config and key == "dtype"):
                    section[key] = dtype.name
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
