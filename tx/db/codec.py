"""Serialize the `tx.protocol` dataclasses to compact JSON bytes and back.

Request payloads and results are stored in the queue as blobs. The format is JSON in which a
dataclass becomes `{"__t": <type name>, ...fields}`, a numpy array `{"__nd": [dtype, shape,
base64]}` and a tuple `{"__tu": [...]}`. Decoding only ever instantiates the types listed in
`tx.protocol.PROTOCOL_TYPES`, so a blob can never construct arbitrary objects (unlike pickle).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import numpy as np

from tx.protocol import PROTOCOL_TYPES

_TYPES: dict[str, type] = {t.__name__: t for t in PROTOCOL_TYPES}
_ALLOWED_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "float16", "float32", "float64"}
)


def _to_jsonable(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        return {"__nd": [array.dtype.name, list(array.shape), base64.b64encode(array.tobytes()).decode("ascii")]}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: _to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        out["__t"] = type(obj).__name__
        return out
    if isinstance(obj, dict):
        return {str(k): _to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_jsonable(v) for v in obj]
    if isinstance(obj, tuple):
        return {"__tu": [_to_jsonable(v) for v in obj]}
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _from_jsonable(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_from_jsonable(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__nd" in obj:
        return _decode_array(obj["__nd"])
    if "__tu" in obj:
        return tuple(_from_jsonable(v) for v in obj["__tu"])
    if "__t" in obj:
        cls = _TYPES.get(obj["__t"])
        if cls is None:
            raise ValueError(f"blob names unknown type {obj['__t']!r}")
        return cls(**{k: _from_jsonable(v) for k, v in obj.items() if k != "__t"})
    return {k: _from_jsonable(v) for k, v in obj.items()}


def _decode_array(spec: list[Any]) -> np.ndarray:
    dtype, shape, data = spec
    if dtype not in _ALLOWED_DTYPES:
        raise ValueError(f"blob has unsupported array dtype {dtype!r}")
    return np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype)).reshape(shape).copy()


def encode(obj: Any) -> bytes:
    """Serialize a protocol object (or a plain JSON-like structure containing them)."""
    return json.dumps(_to_jsonable(obj), separators=(",", ":")).encode()


def decode(blob: bytes) -> Any:
    """Inverse of `encode`; raises ValueError on a blob naming a type outside the protocol."""
    return _from_jsonable(json.loads(blob))
