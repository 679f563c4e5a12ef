"""Minimal safetensors reader over a memory map, so a shard is never read into memory whole.

The `safetensors` numpy loader cannot represent bfloat16; this reader maps the file and views each
tensor with `ml_dtypes`, touching only the bytes of the tensor being loaded.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
}


def read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def iter_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, read-only array view) for every tensor of one .safetensors file."""
    header, base = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        raw = data[base + start : base + end]
        yield name, raw.view(DTYPES[info["dtype"]]).reshape(info["shape"])


def shard_files(model_dir: Path) -> list[Path]:
    """The checkpoint's .safetensors files: the sharded index if present, else the single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir} (PyTorch .bin checkpoints are not supported)")
    return found
