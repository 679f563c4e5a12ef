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

Mixture-of-experts adapters name one module per expert; a checkpoint that stores each layer's experts fused
(transformers 5's layout, gpt-oss's) gets each expert's delta in its slice of the fused tensor, and a gpt-oss
base in MXFP4 is written with its experts dequantized (`tx.lora.merge_experts`; its `quantization_config`
dropped from config.json), since the merged weights are no longer MXFP4 values.
"""

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from tx.lora.merge_experts import Dequantizer, FusedDeltas
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
    dequantizer: Dequantizer | None = None,
) -> None:
    """Write the base model at `base_dir` with the adapter merged in to `out_dir` (replaced atomically).

    `dtype` ("float32", "float16", "bfloat16" or a numpy dtype) casts every floating tensor; default keeps each
    tensor's own dtype (bfloat16 for dequantized experts). `dequantizer`: the base's quantized expert format.
    """
    base = Path(base_dir)
    out_dtype = _resolve_dtype(dtype)
    shards = _shard_files(base)
    names = {name: shard for shard in shards for name in _tensor_names(base / shard)}
    quantized = {n for n in names if dequantizer is not None and dequantizer.is_quantized(n)}
    weights, embed = _as_stored(weights, names)
    weights, fused = FusedDeltas.split(weights, _float_names(names, quantized), _model_type(base) == "gpt_oss")
    _check_modules(weights, names, embed)
    targets_lm_head = "lm_head" in weights
    add_lm_head = targets_lm_head and LM_HEAD not in names
    reader = _Reader(base, names, quantized, dequantizer)
    with atomic_dir(out_dir) as tmp:
        weight_map: dict[str, str] = {}
        sizes: dict[str, tuple[int, int]] = {}
        for shard in shards:
            merge = _ShardMerge(config, weights, fused, out_dtype, embed if add_lm_head else None)
            written = merge.write(reader.tensors(shard), tmp / shard, reader.metadata(shard))
            weight_map.update({name: shard for name in written})
            sizes.update(written)
        if (base / INDEX_NAME).exists():
            _write_index(base / INDEX_NAME, tmp, weight_map, sizes)
        _copy_side_files(base, tmp)
        _write_config(base, tmp, untie=targets_lm_head, dtype=out_dtype, dequantized=bool(quantized))


def _float_names(names: Mapping[str, str], quantized: set[str]) -> set[str]:
    """The tensor names the merged checkpoint will hold: a quantized pair as its one float tensor."""
    return {n.rsplit("_", 1)[0] if n in quantized else n for n in names}


def _model_type(base: Path) -> str:
    config = json.loads((base / "config.json").read_text()) if (base / "config.json").is_file() else {}
    return str(config.get("model_type", ""))


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


class _Reader:
    """The base's tensors shard by shard; a quantized pair (its halves maybe in two shards) as its float tensor,
    yielded where its first half is stored."""

    def __init__(self, base: Path, names: Mapping[str, str], quantized: set[str], dequantizer: Dequantizer | None):
        self.base, self.names, self.quantized, self.dequantizer = base, names, quantized, dequantizer

    def metadata(self, shard: str) -> dict[str, str]:
        with safe_open(str(self.base / shard), framework="numpy") as f:
            return dict(f.metadata() or {})

    def tensors(self, shard: str) -> Iterator[tuple[str, np.ndarray]]:
        with safe_open(str(self.base / shard), framework="numpy") as f:
            for name in f.keys():
                if name not in self.quantized:
                    yield name, f.get_tensor(name)
                    continue
                assert self.dequantizer is not None
                partner = self.dequantizer.partner(name)
                if partner not in self.names:
                    raise ValueError(f"quantized tensor {name!r} has no {partner!r} in the base checkpoint")
                if (self.names[partner], partner) < (shard, name):
                    continue  # written with its partner
                yield self.dequantizer.dequantize(name, f.get_tensor(name), self._read(partner))

    def _read(self, name: str) -> np.ndarray:
        with safe_open(str(self.base / self.names[name]), framework="numpy") as f:
            return f.get_tensor(name)


class _ShardMerge:
    """One shard's tensors with the adapter merged in. `untie_from`: the embedding that `lm_head` is written
    from (a tied model whose adapter targets lm_head), else None."""

    def __init__(
        self,
        config: AdapterConfig,
        weights: Mapping[str, Pair],
        fused: FusedDeltas,
        dtype: np.dtype[Any] | None,
        untie_from: str | None,
    ) -> None:
        self.config, self.weights, self.fused, self.dtype, self.untie_from = config, weights, fused, dtype, untie_from

    def write(self, tensors: Iterator[tuple[str, np.ndarray]], dst: Path, metadata: dict[str, str]) -> dict:
        """Merge and write to `dst`; returns (bytes, elements) of each tensor written (lm_head too when untying)."""
        out: dict[str, np.ndarray] = {}
        for name, tensor in tensors:
            out[name] = self._one(name, tensor)
            if name == self.untie_from:
                out[LM_HEAD] = _merged(tensor, self.weights["lm_head"], self.config, self.dtype)
        # transformers refuses safetensors files whose metadata lacks a known "format".
        save_file(out, str(dst), metadata={**metadata, "format": metadata.get("format", "pt")})
        return {name: (tensor.nbytes, tensor.size) for name, tensor in out.items()}

    def _one(self, name: str, tensor: np.ndarray) -> np.ndarray:
        experts = self.fused.merged(name, tensor, self.config)
        if experts is not None:
            return experts.astype(self.dtype or tensor.dtype)
        return _merged(tensor, self.weights.get(name.removesuffix(".weight")), self.config, self.dtype)


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


def _write_config(base: Path, tmp: Path, untie: bool, dtype: np.dtype[Any] | None, dequantized: bool = False) -> None:
    config = json.loads((base / "config.json").read_text())
    if dequantized:
        config.pop("quantization_config", None)
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
