"""Turn wire request bodies (protobuf or JSON) into `tx.protocol` request objects.

Both encodings of a forward/forward_backward request land in the same `ForwardBackwardRequest`:
text chunks are concatenated into one flat token list, tensors (dense or sparse CSR, any wire
dtype) become numpy arrays of their declared shape, and `loss_fn_config_v2` wins over the legacy
map. Anything malformed raises `WireError` with a message naming the offending field; the routes
answer it with HTTP 400 before anything is queued.
"""

from __future__ import annotations

import base64
import functools
import io
import math
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import numpy as np
import zstandard

from tx.api import wire_proto
from tx.api.limits import Limits
from tx.api.wire_scan import MalformedBody, ScanError, check_forward_backward
from tx.loss_spec import INPUT_IS_TOKEN_IDS
from tx.protocol import Datum, ForwardBackwardRequest, SamplingParams

P = ParamSpec("P")
# The loss inputs the engine reads; others are dropped here, before their tensors are decoded.
READ_INPUTS = frozenset(INPUT_IS_TOKEN_IDS)
T = TypeVar("T")

_PROTO_DTYPES: dict[int, np.dtype] = {
    wire_proto.DTYPE_FLOAT32: np.dtype(np.float32),
    wire_proto.DTYPE_INT64: np.dtype(np.int64),
    wire_proto.DTYPE_INT32: np.dtype(np.int32),
    wire_proto.DTYPE_BFLOAT16: np.dtype(np.uint16),
}
_JSON_DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32), "int64": np.dtype(np.int64)}


class WireError(ValueError):
    """The request body is malformed; the message names the field."""


def wire_errors(fn: Callable[P, T]) -> Callable[P, T]:
    """Decoders raise `WireError` only: anything else a hostile body provokes becomes one."""

    @functools.wraps(fn)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except WireError:
            raise
        except (ValueError, TypeError, OverflowError, KeyError, IndexError, AttributeError, MemoryError) as exc:
            raise WireError(f"malformed request body ({type(exc).__name__}: {exc})") from exc

    return wrapped


def decompress(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """The body without its zstd encoding, read in pieces and refused past `max_bytes` of output (a frame's
    declared size is not trusted: a few KiB can claim, or expand to, gigabytes)."""
    if not content_encoding or content_encoding.lower() in ("identity", ""):
        return body
    if content_encoding.lower() != "zstd":
        raise WireError(f"unsupported Content-Encoding {content_encoding!r} (only zstd)")
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True) as reader:
            out = reader.read(max_bytes + 1)
    except zstandard.ZstdError as exc:
        raise WireError(f"body is not a valid zstd frame: {exc}") from exc
    if len(out) > max_bytes:
        raise WireError(f"the decompressed body is larger than the limit of {max_bytes} bytes")
    return out


# ---- protobuf ---------------------------------------------------------------------------------


@wire_errors
def parse_forward_backward_proto(body: bytes, limits: Limits) -> tuple[Any, ForwardBackwardRequest]:
    """Parse a serialized `ForwardBackwardRequest`; returns (message, protocol request)."""
    try:  # counted first: parsing builds an object per message, so many empty ones swelled a body 28-fold
        check_forward_backward(body, limits.max_datums, limits.max_datum_entries)
    except MalformedBody as exc:
        raise WireError(f"body is not a valid ForwardBackwardRequest protobuf: {exc}") from None
    except ScanError as exc:
        raise WireError(str(exc)) from None
    message = wire_proto.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as exc:
        raise WireError(f"body is not a valid ForwardBackwardRequest protobuf: {exc}") from exc
    if len(message.data) > limits.max_datums:
        raise WireError(f"data has {len(message.data)} datums, more than the limit {limits.max_datums}")
    budget = _Budget(limits)
    data = [_proto_datum(datum, i, limits, budget) for i, datum in enumerate(message.data)]
    config: dict[str, float | str] = {k: float(v) for k, v in message.loss_fn_config.items()}
    if message.loss_fn_config_v2:
        config = {k: _config_value(v) for k, v in message.loss_fn_config_v2.items()}
    request = ForwardBackwardRequest(data, message.loss_fn, config, bool(message.forward_only))
    return message, request


def _config_value(value: Any) -> float | str:
    return value.text if value.WhichOneof("value") == "text" else float(value.number)


def _proto_datum(datum: Any, index: int, limits: Limits, budget: _Budget) -> Datum:
    where = f"data[{index}].model_input"
    pieces: list[bytes] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(_not_text(where, kind))
        pieces.append(chunk.encoded_text.tokens)
    raw = b"".join(pieces)
    if len(raw) % 4:
        raise WireError(f"{where}: token bytes are not a whole number of int32 values")
    _check_count(len(raw) // 4, limits.max_seq_len, where, "tokens")
    inputs = {
        name: _proto_tensor(t, f"data[{index}].loss_fn_inputs.{name}", budget)
        for name, t in datum.loss_fn_inputs.items()
        if name in READ_INPUTS
    }
    return Datum(np.frombuffer(raw, dtype="<i4").tolist(), inputs)


def _check_count(count: int, limit: int, where: str, unit: str) -> None:
    if count > limit:
        what = "the maximum length" if unit == "tokens" else "the limit"
        raise WireError(f"{where} has {count} {unit}, more than {what} {limit}")


def _proto_tensor(tensor: Any, where: str, budget: _Budget) -> np.ndarray:
    dtype = _PROTO_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"{where}: unsupported dtype enum {tensor.dtype}")
    shape = _checked_shape([int(s) for s in tensor.shape[: MAX_DIMS + 1]], where)
    if tensor.WhichOneof("encoding") == "sparse_csr":
        csr = tensor.sparse_csr
        budget.take(shape, where)
        values = _widen(_frombuffer(csr.values, dtype, where), tensor.dtype)
        crow = _frombuffer(csr.crow_indices, np.dtype(np.int64), where)
        cols = _frombuffer(csr.col_indices, np.dtype(np.int64), where)
        return _densify(values, crow, cols, shape, where)
    flat = _widen(_frombuffer(tensor.dense, dtype, where), tensor.dtype)
    return _reshape(flat, shape, where)


class _Budget:
    """The elements a request's sparse tensors may expand to: each at most one loss input's worth, and all of
    them together no more than the body could hold densely, so a few bytes of CSR indices per tensor
    (39 bytes for a [1, 262144] of zeros) cannot make gigabytes of arrays out of one body."""

    def __init__(self, limits: Limits) -> None:
        self.limits, self.left = limits, limits.max_body_bytes // 4

    def take(self, shape: list[int], where: str) -> None:
        """Check a declared shape before anything of that size is allocated, and count it."""
        if len(shape) > 2 or any(s < 0 for s in shape):
            raise WireError(f"{where}: shape {shape} must have 1 or 2 non-negative dimensions")
        elements = math.prod(shape)
        _check_count(elements, self.limits.max_tensor_elements, where, "elements")
        if elements > self.left:
            raise WireError(
                f"{where}: the request's sparse tensors expand to more than {self.limits.max_body_bytes // 4} "
                "elements in all (the body limit in float32 values)"
            )
        self.left -= elements


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


@wire_errors
def parse_forward_backward_json(body: dict[str, Any], input_key: str, limits: Limits) -> ForwardBackwardRequest:
    """Legacy JSON body: `{"forward_backward_input" | "forward_input": {data, loss_fn, loss_fn_config}}`."""
    inner = body.get(input_key)
    if not isinstance(inner, dict):
        raise WireError(f"missing object field {input_key!r}")
    raw_data = inner.get("data")
    if not isinstance(raw_data, list):
        raise WireError(f"{input_key}.data must be a list of datums")
    _check_count(len(raw_data), limits.max_datums, f"{input_key}.data", "datums")
    budget = _Budget(limits)
    data = [_json_datum(d, i, limits, budget) for i, d in enumerate(raw_data)]
    config = inner.get("loss_fn_config") or {}
    if not isinstance(config, dict):
        raise WireError(f"{input_key}.loss_fn_config must be an object")
    loss_fn = inner.get("loss_fn", "")
    if not isinstance(loss_fn, str):
        raise WireError(f"{input_key}.loss_fn must be a string")
    return ForwardBackwardRequest(data, loss_fn, config, input_key == "forward_input")


def _json_datum(datum: Any, index: int, limits: Limits, budget: _Budget) -> Datum:
    if not isinstance(datum, dict):
        raise WireError(f"data[{index}] must be an object")
    tokens = model_input_tokens(datum.get("model_input"), f"data[{index}].model_input", limits.max_seq_len)
    raw_inputs = datum.get("loss_fn_inputs") or {}
    if not isinstance(raw_inputs, dict):
        raise WireError(f"data[{index}].loss_fn_inputs must be an object")
    inputs = {
        k: json_tensor(v, f"data[{index}].loss_fn_inputs.{k}", limits, budget)
        for k, v in raw_inputs.items()
        if k in READ_INPUTS
    }
    return Datum(tokens, inputs)


@wire_errors
def _not_text(where: str, kind: object) -> str:
    if isinstance(kind, str) and kind.startswith("image"):
        return f"{where}: image input is not supported yet for this model (send encoded_text chunks only)"
    return f"{where}: {kind or 'empty'} chunks are not supported (encoded_text only)"


def model_input_tokens(model_input: Any, where: str, max_tokens: int) -> list[int]:
    """Flatten a JSON ModelInput (`{"chunks": [...]}`) into tokens; non-text chunks are rejected."""
    if not isinstance(model_input, dict) or not isinstance(model_input.get("chunks"), list):
        raise WireError(f"{where} must be an object with a 'chunks' list")
    tokens: list[int] = []
    for chunk in model_input["chunks"]:
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise WireError(_not_text(where, kind))
        chunk_tokens = chunk.get("tokens")
        if not isinstance(chunk_tokens, list) or not all(type(t) is int for t in chunk_tokens):
            raise WireError(f"{where}: encoded_text.tokens must be a list of integers")
        tokens.extend(chunk_tokens)
        _check_count(len(tokens), max_tokens, where, "tokens")
    return tokens


def json_tensor(tensor: Any, where: str, limits: Limits, budget: _Budget | None = None) -> np.ndarray:
    """A JSON TensorData (`{"data", "dtype", "shape"?, "sparse_*_indices"?}`) as a numpy array; `budget`:
    what the request's sparse tensors may still expand to (a tensor alone: one loss input's worth)."""
    if not isinstance(tensor, dict) or "data" not in tensor:
        raise WireError(f"{where} must be a TensorData object with 'data'")
    dtype = _JSON_DTYPES.get(tensor.get("dtype", "float32"))
    if dtype is None:
        raise WireError(f"{where}: dtype must be 'float32' or 'int64', got {tensor.get('dtype')!r}")
    data = tensor["data"]
    if not isinstance(data, str | list):
        raise WireError(f"{where}: data must be a list of numbers or a base64 string")
    if isinstance(data, list) and dtype == np.int64:
        data = _int_list(data, f"{where}.data")  # numpy would truncate 1.5 to 1 without a word
    elif isinstance(data, list) and not all(type(v) is float or type(v) is int for v in data):
        # numpy would read "1e3" as 1000, true as 1, null as NaN and [[1], [2]] as two values
        raise WireError(f"{where}.data must be a flat list of numbers")
    try:
        flat = np.frombuffer(base64.b64decode(data), dtype=dtype) if isinstance(data, str) else np.asarray(data, dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"{where}: data is not numeric: {exc}") from exc
    shape = _json_shape(tensor.get("shape"), where)
    if tensor.get("sparse_crow_indices") is not None:
        (budget or _Budget(limits)).take(shape, where)
        crow = _int_list(tensor["sparse_crow_indices"], f"{where}.sparse_crow_indices")
        cols = _int_list(tensor.get("sparse_col_indices") or [], f"{where}.sparse_col_indices")
        return _densify(flat, crow, cols, shape, where)
    return _reshape(flat.reshape(-1), shape, where)


def _int_list(values: Any, where: str) -> np.ndarray:
    """A JSON list of 64-bit integers as int64 (not floats, strings or booleans)."""
    if not isinstance(values, list) or not all(type(v) is int and -(1 << 63) <= v < (1 << 63) for v in values):
        raise WireError(f"{where} must be a list of 64-bit integers")
    return np.asarray(values, np.int64)


def _json_shape(shape: Any, where: str) -> list[int]:
    if shape is None:
        return []
    if not isinstance(shape, list) or not all(type(s) is int for s in shape[: MAX_DIMS + 1]):
        raise WireError(f"{where}: shape must be a list of integers")
    return _checked_shape(shape, where)


MAX_DIMS = 4  # loss inputs are [N] or [N, K]


def _checked_shape(shape: list[int], where: str) -> list[int]:
    """A shape of at most `MAX_DIMS` non-negative sizes, checked before anything multiplies it: the product
    of a list of 60,000 huge sizes (172 bytes of zstd protobuf) held the GIL, and the server, for 8 s."""
    if len(shape) > MAX_DIMS:
        raise WireError(f"{where}: shape has more than {MAX_DIMS} dimensions")
    if any(s < 0 or s >= 1 << 62 for s in shape):
        raise WireError(f"{where}: shape {shape} has a size below 0 or of 2^62 and more")
    return shape


def _reshape(flat: np.ndarray, shape: list[int], where: str) -> np.ndarray:
    if not shape:
        return flat.copy()
    if math.prod(shape) != flat.size:
        raise WireError(f"{where}: {flat.size} values do not fit shape {shape}")
    return flat.reshape(shape).copy()


def _densify(values: np.ndarray, crow: np.ndarray, cols: np.ndarray, shape: list[int], where: str) -> np.ndarray:
    if len(shape) != 2:
        raise WireError(f"{where}: sparse tensors must be 2-D with an explicit shape")
    rows, width = shape
    if len(crow) != rows + 1 or len(cols) != len(values) or (len(crow) and crow[-1] != len(values)):
        raise WireError(f"{where}: inconsistent sparse CSR indices for shape {shape}")
    if crow.ndim != 1 or cols.ndim != 1 or (len(crow) and (crow[0] != 0 or (np.diff(crow) < 0).any())):
        raise WireError(f"{where}: sparse CSR row offsets must start at 0 and never decrease")
    if len(cols) and (cols.min() < 0 or cols.max() >= width):
        raise WireError(f"{where}: sparse column index out of range for shape {shape}")
    dense = np.zeros(shape, dtype=values.dtype)
    row_ids = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_ids, cols] = values
    return dense


# ---- sampling ---------------------------------------------------------------------------------


@wire_errors
def sampling_params(raw: Any, default_max_tokens: int) -> SamplingParams:
    """SamplingParams from JSON; `stop=None` stops at EOS, stop strings or token ids stop there and at EOS,
    and `stop=[]` disables every stop, EOS included (generate to max_tokens). A missing or null field takes
    its default; a field of the wrong type is a `WireError` naming it."""
    if not isinstance(raw, dict):
        raise WireError("sampling_params must be an object")
    stop = raw.get("stop")
    stop_ids: list[int] = []
    stop_strings: list[str] = []
    if isinstance(stop, str):
        stop_strings = [stop]
    elif isinstance(stop, list):
        if all(type(s) is int for s in stop):
            stop_ids = list(stop)
        elif all(isinstance(s, str) for s in stop):
            stop_strings = list(stop)
        else:
            raise WireError("sampling_params.stop must be a string, a list of strings or a list of token ids")
    elif stop is not None:
        raise WireError("sampling_params.stop must be a string, a list of strings or a list of token ids")
    return SamplingParams(
        max_tokens=_field(raw, "max_tokens", int, default_max_tokens),
        temperature=_field(raw, "temperature", float, 1.0),
        top_k=_field(raw, "top_k", int, -1),
        top_p=_field(raw, "top_p", float, 1.0),
        seed=_field(raw, "seed", int, None),
        stop_token_ids=stop_ids,
        stop_strings=stop_strings,
        stop_at_eos=stop != [],
    )


def _field(raw: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    """A number field: an int for `int` fields (a float with an integral value is accepted), any real for
    `float` fields; booleans and strings are refused."""
    value = raw.get(name)
    if value is None:
        return default
    if type(value) is int or (kind is float and type(value) is float):
        try:
            return kind(value)
        except OverflowError:  # a 400-digit integer is no float
            raise WireError(f"sampling_params.{name} is too large for a number ({len(str(value))} digits)") from None
    if kind is int and type(value) is float and value.is_integer():
        return int(value)
    raise WireError(f"sampling_params.{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
