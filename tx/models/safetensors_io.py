"""Minimal safetensors reader over a memory map, so a shard is never read into memory whole.

The `safetensors` numpy loader cannot represent bfloat16; this reader maps the file and views each
tensor with `ml_dtypes`, touching only the bytes of the tensor being loaded. The header is checked before any
tensor is viewed: a known dtype, a shape of non-negative integers, data offsets that hold exactly that many
bytes and lie inside the file, so a truncated or inconsistent file is an error naming the tensor, never a
short read.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from tx.names import is_valid_name

DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "U8": np.dtype(np.uint8),  # MXFP4 blocks and scales (gpt-oss's experts)
}


MAX_HEADER_BYTES = 100 << 20  # the format's own limit on the JSON header


class BadSafetensors(ValueError):
    """A .safetensors file whose header is malformed or whose tensors do not fit in the file."""


def read_header(path: Path) -> tuple[dict, int]:
    """(tensor name -> {dtype, shape, data_offsets}, byte where the data starts), every entry checked
    against the file's size."""
    file_bytes = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise BadSafetensors(f"{path.name} is truncated: {file_bytes} bytes, not even a header length")
        (size,) = struct.unpack("<Q", prefix)
        if size > min(MAX_HEADER_BYTES, file_bytes - 8):
            raise BadSafetensors(f"{path.name} is truncated or not safetensors: header of {size} bytes")
        try:
            header = json.loads(f.read(size))
        except (ValueError, RecursionError) as err:  # RecursionError: JSON nested past Python's stack
            raise BadSafetensors(f"{path.name}: header is not JSON ({type(err).__name__}: {err})") from None
    if not isinstance(header, dict):
        raise BadSafetensors(f"{path.name}: header is not a JSON object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        _check_entry(path.name, name, info, file_bytes - 8 - size)
    return header, 8 + size


def _check_entry(file: str, name: str, info: object, data_bytes: int) -> None:
    if not isinstance(info, dict) or info.get("dtype") not in DTYPES:
        dtype = info.get("dtype") if isinstance(info, dict) else None
        raise BadSafetensors(f"{file}: tensor {name!r} has unsupported dtype {dtype}; supported: {sorted(DTYPES)}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise BadSafetensors(f"{file}: tensor {name!r} has shape {shape!r}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(n, int) for n in offsets):
        raise BadSafetensors(f"{file}: tensor {name!r} has data_offsets {offsets!r}, not [start, end]")
    start, end = offsets
    want = math.prod(shape) * DTYPES[info["dtype"]].itemsize
    if not 0 <= start <= end or end - start != want:
        held = end - start
        raise BadSafetensors(f"{file}: tensor {name!r} of shape {shape} needs {want} bytes, its offsets hold {held}")
    if end > data_bytes:
        raise BadSafetensors(
            f"{file} is truncated: tensor {name!r} ends at data byte {end}, the file holds {data_bytes} data bytes"
        )


def iter_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, read-only array view) for every tensor of one .safetensors file."""
    header, base = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in header.items():
        start, end = info["data_offsets"]
        raw = data[base + start : base + end]
        yield name, raw.view(DTYPES[info["dtype"]]).reshape(info["shape"])


def shard_files(model_dir: Path) -> list[Path]:
    """The checkpoint's .safetensors files: the sharded index if present, else the single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for name in names:  # an index naming "/elsewhere/model.safetensors" or "../x" read any file on the server
            if not (isinstance(name, str) and is_valid_name(name) and name.endswith(".safetensors")):
                raise ValueError(f"model.safetensors.index.json names {str(name)[:80]!r}: shards are files beside it")
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir} (PyTorch .bin checkpoints are not supported)")
    return found
