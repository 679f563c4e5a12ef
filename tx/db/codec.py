"""Serialize the `tx.protocol` dataclasses to compact bytes and back.

Request payloads and results are stored in the queue as blobs:
`b"TXB1" | u32 header length | JSON header | raw array bytes`. In the JSON header a dataclass is
`{"__t": <type name>, ...fields}`, a tuple `{"__tu": [...]}`, and a numpy array or a long list of
ints (token ids) or floats (logprobs) is `{"__nd" | "__li" | "__lf": [dtype, shape, offset, nbytes]}`
pointing into the raw section, so large arrays are copied once and never text-encoded. Decoding only ever instantiates
the types listed in `tx.protocol.PROTOCOL_TYPES` and plain numeric dtypes, so a blob can never
construct arbitrary objects (unlike pickle).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import numpy as np

from tx.protocol import PROTOCOL_TYPES

MAGIC = b"TXB1"
_TYPES: dict[str, type] = {t.__name__: t for t in PROTOCOL_TYPES}
_PACK_MIN = 32
_ALLOWED_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "float16", "float32", "float64"}
)


class _Writer:
    """Collects raw array buffers while the header is built."""

    def __init__(self) -> None:
        self.buffers: list[bytes] = []
        self.offset = 0

    def array(self, tag: str, array: np.ndarray) -> dict[str, Any]:
        array = np.ascontiguousarray(array)
        if array.dtype.name not in _ALLOWED_DTYPES:
            raise TypeError(f"cannot store arrays of dtype {array.dtype}")
        raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        self.buffers.append(raw)
        spec = [array.dtype.name, list(array.shape), self.offset, len(raw)]
        self.offset += len(raw)
        return {tag: spec}

    def value(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self.array("__nd", obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            out = {f.name: self.value(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            out["__t"] = type(obj).__name__
            return out
        if isinstance(obj, dict):
            # Keys in sorted order: a request's blob (and so its dedupe digest) must not depend on the order
            # its maps were filled in. A protobuf map iterates in a per-process hash order, so the same
            # forward_backward parsed by two API servers (a retry after a failover) built its loss_fn_inputs
            # in different orders and was refused as "a different request".
            keys = sorted(obj, key=str)
            if _TAGS.intersection(map(str, keys)):  # a user's map (user_metadata) keyed like our tags
                return {"__d": [[str(k), self.value(obj[k])] for k in keys]}
            return {str(k): self.value(obj[k]) for k in keys}
        if isinstance(obj, list):
            return self._list(obj)
        if isinstance(obj, tuple):
            return {"__tu": [self.value(v) for v in obj]}
        if isinstance(obj, np.generic):
            return obj.item()
        return obj

    def _list(self, values: list[Any]) -> Any:
        """A long list of ints or of floats (a sample's tokens and logprobs) as one raw array: float64 keeps
        every Python float exactly, and encoding 128 x 4096 logprobs takes milliseconds, not a second."""
        kinds = set(map(type, values)) if len(values) > _PACK_MIN else set()
        if kinds == {int}:
            packed = _int_array(values)
            if packed is not None:
                return self.array("__li", packed)
        if kinds == {float}:
            return self.array("__lf", np.asarray(values, dtype=np.float64))
        return [self.value(v) for v in values]


def _int_array(values: list[int]) -> np.ndarray | None:
    try:
        array = np.asarray(values, dtype=np.int64)
    except OverflowError:
        return None
    if array.size and -(2**31) <= array.min() and array.max() < 2**31:
        return array.astype(np.int32)
    return array


_TAGS = frozenset({"__nd", "__li", "__lf", "__tu", "__t", "__d"})  # keys that mark an encoded value


class _Reader:
    def __init__(self, raw: memoryview) -> None:
        self.raw = raw

    def array(self, spec: list[Any]) -> np.ndarray:
        dtype, shape, offset, nbytes = spec
        if dtype not in _ALLOWED_DTYPES:
            raise ValueError(f"blob has unsupported array dtype {dtype!r}")
        data = np.frombuffer(self.raw[offset : offset + nbytes], dtype=np.dtype(dtype).newbyteorder("<"))
        return data.astype(np.dtype(dtype)).reshape(shape)

    def value(self, obj: Any) -> Any:
        if isinstance(obj, list):
            return [self.value(v) for v in obj]
        if not isinstance(obj, dict):
            return obj
        if "__nd" in obj:
            return self.array(obj["__nd"])
        if "__li" in obj or "__lf" in obj:
            return self.array(obj.get("__li") or obj["__lf"]).tolist()
        if "__tu" in obj:
            return tuple(self.value(v) for v in obj["__tu"])
        if "__d" in obj:
            return {k: self.value(v) for k, v in obj["__d"]}
        if "__t" in obj:
            cls = _TYPES.get(obj["__t"])
            if cls is None:
                raise ValueError(f"blob names unknown type {obj['__t']!r}")
            return cls(**{k: self.value(v) for k, v in obj.items() if k != "__t"})
        return {k: self.value(v) for k, v in obj.items()}


def encode(obj: Any) -> bytes:
    """Serialize a protocol object (or a plain JSON-like structure containing them)."""
    writer = _Writer()
    header = json.dumps(writer.value(obj), separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, *writer.buffers])


def decode(blob: bytes) -> Any:
    """Inverse of `encode`; raises ValueError on a malformed blob or one naming a foreign type."""
    if blob[:4] != MAGIC:
        raise ValueError("not a SmolGym blob")
    (length,) = struct.unpack_from("<I", blob, 4)
    view = memoryview(blob)
    return _Reader(view[8 + length :]).value(json.loads(bytes(view[8 : 8 + length])))
