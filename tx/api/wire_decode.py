"""Turn wire request bodies (protobuf or JSON) into `tx.protocol` request objects.

Both encodings of a forward/forward_backward request land in the same `ForwardBackwardRequest`:
text chunks are concatenated into one flat token list, tensors (dense or sparse CSR, any wire
dtype) become numpy arrays of their declared shape, and `loss_fn_config_v2` wins over the legacy
map. Anything malformed raises `WireError` with a message naming the offending field; the routes
answer it with HTTP 400 before anything is queued.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import zstandard

from tx.api import wire_proto
from tx.protocol import Datum, ForwardBackwardRequest, SamplingParams

MAX_DECOMPRESSED_BYTES = 1 << 30

_PROTO_DTYPES: dict[int, np.dtype] = {
    wire_proto.DTYPE_FLOAT32: np.dtype(np.float32),
    wire_proto.DTYPE_INT64: np.dtype(np.int64),
    wire_proto.DTYPE_INT32: np.dtype(np.int32),
    wire_proto.DTYPE_BFLOAT16: np.dtype(np.uint16),
}
_JSON_DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32), "int64": np.dtype(np.int64)}


class WireError(ValueError):
    """The request body is malformed; the message names the field."""


def decompress(body: bytes, content_encoding: str | None) -> bytes:
    if not content_encoding or content_encoding.lower() in ("identity", ""):
        return body
    if content_encoding.lower() != "zstd":
        raise WireError(f"unsupported Content-Encoding {content_encoding!r} (only zstd)")
    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_DECOMPRESSED_BYTES)
    except zstandard.ZstdError as exc:
        raise WireError(f"body is not a valid zstd frame: {exc}") from exc


# ---- protobuf ---------------------------------------------------------------------------------


def parse_forward_backward_proto(body: bytes) -> tuple[Any, ForwardBackwardRequest]:
    """Parse a serialized `ForwardBackwardRequest`; returns (message, protocol request)."""
    message = wire_proto.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as exc:
        raise WireError(f"body is not a valid ForwardBackwardRequest protobuf: {exc}") from exc
    data = [_proto_datum(datum, i) for i, datum in enumerate(message.data)]
    config: dict[str, float | str] = {k: float(v) for k, v in message.loss_fn_config.items()}
    if message.loss_fn_config_v2:
        config = {k: _config_value(v) for k, v in message.loss_fn_config_v2.items()}
    request = ForwardBackwardRequest(data, message.loss_fn, config, bool(message.forward_only))
    return message, request


def _config_value(value: Any) -> float | str:
    return value.text if value.WhichOneof("value") == "text" else float(value.number)


def _proto_datum(datum: Any, index: int) -> Datum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"data[{index}].model_input: {kind or 'empty'} chunks are not supported (text only)")
        if len(chunk.encoded_text.tokens) % 4:
            raise WireError(f"data[{index}].model_input: token bytes are not a whole number of int32 values")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
    inputs = {
        name: _proto_tensor(t, f"data[{index}].loss_fn_inputs.{name}") for name, t in datum.loss_fn_inputs.items()
    }
    return Datum(tokens, inputs)


def _proto_tensor(tensor: Any, where: str) -> np.ndarray:
    dtype = _PROTO_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"{where}: unsupported dtype enum {tensor.dtype}")
    shape = [int(s) for s in tensor.shape]
    if tensor.WhichOneof("encoding") == "sparse_csr":
        csr = tensor.sparse_csr
        values = _widen(_frombuffer(csr.values, dtype, where), tensor.dtype)
        crow = _frombuffer(csr.crow_indices, np.dtype(np.int64), where)
        cols = _frombuffer(csr.col_indices, np.dtype(np.int64), where)
        return _densify(values, crow, cols, shape, where)
    flat = _widen(_frombuffer(tensor.dense, dtype, where), tensor.dtype)
    return _reshape(flat, shape, where)


def _frombuffer(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise WireError(f"{where}: byte length {len(raw)} is not a multiple of {dtype.itemsize}")
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<"))


def _widen(array: np.ndarray, proto_dtype: int) -> np.ndarray:
    if proto_dtype == wire_proto.DTYPE_BFLOAT16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    if proto_dtype == wire_proto.DTYPE_INT32:
        return array.astype(np.int64)
    return array.astype(array.dtype.newbyteorder("="), copy=False)


# ---- JSON -------------------------------------------------------------------------------------


def parse_forward_backward_json(body: dict[str, Any], input_key: str) -> ForwardBackwardRequest:
    """Legacy JSON body: `{"forward_backward_input" | "forward_input": {data, loss_fn, loss_fn_config}}`."""
    inner = body.get(input_key)
    if not isinstance(inner, dict):
        raise WireError(f"missing object field {input_key!r}")
    raw_data = inner.get("data")
    if not isinstance(raw_data, list):
        raise WireError(f"{input_key}.data must be a list of datums")
    data = [_json_datum(d, i) for i, d in enumerate(raw_data)]
    config = inner.get("loss_fn_config") or {}
    if not isinstance(config, dict):
        raise WireError(f"{input_key}.loss_fn_config must be an object")
    return ForwardBackwardRequest(data, str(inner.get("loss_fn", "")), config, input_key == "forward_input")


def _json_datum(datum: Any, index: int) -> Datum:
    if not isinstance(datum, dict):
        raise WireError(f"data[{index}] must be an object")
    tokens = model_input_tokens(datum.get("model_input"), f"data[{index}].model_input")
    raw_inputs = datum.get("loss_fn_inputs") or {}
    if not isinstance(raw_inputs, dict):
        raise WireError(f"data[{index}].loss_fn_inputs must be an object")
    inputs = {k: json_tensor(v, f"data[{index}].loss_fn_inputs.{k}") for k, v in raw_inputs.items()}
    return Datum(tokens, inputs)


def model_input_tokens(model_input: Any, where: str) -> list[int]:
    """Flatten a JSON ModelInput (`{"chunks": [...]}`) into tokens; non-text chunks are rejected."""
    if not isinstance(model_input, dict) or not isinstance(model_input.get("chunks"), list):
        raise WireError(f"{where} must be an object with a 'chunks' list")
    tokens: list[int] = []
    for chunk in model_input["chunks"]:
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise WireError(f"{where}: {kind} chunks are not supported (text only)")
        chunk_tokens = chunk.get("tokens")
        if not isinstance(chunk_tokens, list) or not all(isinstance(t, int) for t in chunk_tokens):
            raise WireError(f"{where}: encoded_text.tokens must be a list of integers")
        tokens.extend(chunk_tokens)
    return tokens


def json_tensor(tensor: Any, where: str) -> np.ndarray:
    """A JSON TensorData (`{"data", "dtype", "shape"?, "sparse_*_indices"?}`) as a numpy array."""
    if not isinstance(tensor, dict) or "data" not in tensor:
        raise WireError(f"{where} must be a TensorData object with 'data'")
    dtype = _JSON_DTYPES.get(tensor.get("dtype", "float32"))
    if dtype is None:
        raise WireError(f"{where}: dtype must be 'float32' or 'int64', got {tensor.get('dtype')!r}")
    data = tensor["data"]
    try:
        flat = np.frombuffer(base64.b64decode(data), dtype=dtype) if isinstance(data, str) else np.asarray(data, dtype)
    except (TypeError, ValueError) as exc:
        raise WireError(f"{where}: data is not numeric: {exc}") from exc
    shape = tensor.get("shape")
    if tensor.get("sparse_crow_indices") is not None:
        crow = np.asarray(tensor["sparse_crow_indices"], np.int64)
        cols = np.asarray(tensor.get("sparse_col_indices") or [], np.int64)
        return _densify(flat, crow, cols, list(shape or []), where)
    return _reshape(flat.reshape(-1), list(shape) if shape else [], where)


def _reshape(flat: np.ndarray, shape: list[int], where: str) -> np.ndarray:
    if not shape:
        return flat.copy()
    if any(s < 0 for s in shape) or int(np.prod(shape)) != flat.size:
        raise WireError(f"{where}: {flat.size} values do not fit shape {shape}")
    return flat.reshape(shape).copy()


def _densify(values: np.ndarray, crow: np.ndarray, cols: np.ndarray, shape: list[int], where: str) -> np.ndarray:
    if len(shape) != 2:
        raise WireError(f"{where}: sparse tensors must be 2-D with an explicit shape")
    rows, width = shape
    if len(crow) != rows + 1 or len(cols) != len(values) or (len(crow) and crow[-1] != len(values)):
        raise WireError(f"{where}: inconsistent sparse CSR indices for shape {shape}")
    if len(cols) and (cols.min() < 0 or cols.max() >= width):
        raise WireError(f"{where}: sparse column index out of range for shape {shape}")
    dense = np.zeros(shape, dtype=values.dtype)
    row_ids = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_ids, cols] = values
    return dense


# ---- sampling ---------------------------------------------------------------------------------


def sampling_params(raw: dict[str, Any], default_max_tokens: int) -> SamplingParams:
    """SamplingParams from JSON; `stop=None` stops at EOS, an explicit list (even []) replaces it."""
    stop = raw.get("stop")
    stop_ids: list[int] = []
    stop_strings: list[str] = []
    if isinstance(stop, str):
        stop_strings = [stop]
    elif isinstance(stop, list):
        if all(isinstance(s, int) for s in stop):
            stop_ids = list(stop)
        elif all(isinstance(s, str) for s in stop):
            stop_strings = list(stop)
        else:
            raise WireError("sampling_params.stop must be a string, a list of strings or a list of token ids")
    elif stop is not None:
        raise WireError("sampling_params.stop must be a string, a list of strings or a list of token ids")
    max_tokens = raw.get("max_tokens")
    return SamplingParams(
        max_tokens=int(max_tokens) if max_tokens is not None else default_max_tokens,
        temperature=float(raw.get("temperature", 1.0)),
        top_k=int(raw.get("top_k", -1)),
        top_p=float(raw.get("top_p", 1.0)),
        seed=int(raw["seed"]) if raw.get("seed") is not None else None,
        stop_token_ids=stop_ids,
        stop_strings=stop_strings,
        stop_at_eos=stop is None,
    )
