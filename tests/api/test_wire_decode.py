"""The wire decoders field by field: each limit at its edge, each malformed shape refused with its field named,
and each well-formed body decoded exactly (protobuf built with our own message classes, JSON as dicts)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import zstandard

from tx.api import wire_proto
from tx.api.limits import Limits
from tx.api.wire_decode import (
    WireError,
    decompress,
    json_tensor,
    model_input_tokens,
    parse_forward_backward_json,
    parse_forward_backward_proto,
    sampling_params,
)

LIMITS = Limits(max_seq_len=8, vocab_size=100, max_datums=2, max_targets=2)  # tensors of up to 16 elements


def _refused(fragment: str, decode: Any, *args: Any) -> None:
    with pytest.raises(WireError, match=fragment):
        decode(*args)


# ---- zstd ---------------------------------------------------------------------------------------


def test_decompress_limits_and_encodings() -> None:
    assert decompress(b"raw", None, 1) == b"raw" and decompress(b"raw", "identity", 1) == b"raw"
    assert decompress(b"raw", "", 1) == b"raw"
    _refused("unsupported Content-Encoding 'gzip'", decompress, b"raw", "gzip", 10)
    body = zstandard.ZstdCompressor().compress(b"x" * 10)
    assert decompress(body, "ZSTD", 10) == b"x" * 10  # exactly the limit
    _refused("larger than the limit of 9 bytes", decompress, body, "zstd", 9)
    two_frames = body + zstandard.ZstdCompressor().compress(b"y" * 5)
    assert decompress(two_frames, "zstd", 100) == b"x" * 10 + b"y" * 5
    _refused("not a valid zstd frame", decompress, b"not zstd", "zstd", 100)


# ---- protobuf -----------------------------------------------------------------------------------


def _proto_datum(message: Any, tokens: list[int], **inputs: Any) -> Any:
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, "<i4").tobytes()
    for name, tensor in inputs.items():
        datum.loss_fn_inputs[name].CopyFrom(tensor)
    return datum


def _tensor(values: Any, dtype: int, shape: list[int], wire: str = "<f4") -> Any:
    tensor = wire_proto.MESSAGES["Tensor"]()
    tensor.dtype, tensor.dense = dtype, np.asarray(values, wire).tobytes()
    tensor.shape.extend(shape)
    return tensor


def _proto(*datums: list[int], **fields: Any) -> Any:
    message = wire_proto.ForwardBackwardRequest(loss_fn="cross_entropy", **fields)
    for tokens in datums:
        _proto_datum(message, tokens)
    return message


def _decode(message: Any) -> Any:
    return parse_forward_backward_proto(message.SerializeToString(), LIMITS)[1]


def test_proto_datum_and_token_limits() -> None:
    request = _decode(_proto([1, 2, 3], [1] * 8))  # as many datums and tokens as allowed
    assert [d.tokens for d in request.data] == [[1, 2, 3], [1] * 8] and not request.forward_only
    _refused("data has more than 2 datums, the limit", _decode, _proto([1], [2], [3]))
    _refused(r"data\[0\].model_input has 9 tokens, more than the maximum length 8", _decode, _proto([1] * 9))
    split = _proto([1, 2])
    split.data[0].model_input.add().encoded_text.tokens = np.asarray([3], "<i4").tobytes()  # chunks join
    assert _decode(split).data[0].tokens == [1, 2, 3]
    ragged = _proto([1])
    ragged.data[0].model_input[0].encoded_text.tokens += b"\x00"
    _refused("not a whole number of int32 values", _decode, ragged)
    image = _proto([1])
    image.data[0].model_input.add().image.data = b"png"
    _refused("image input is not supported yet", _decode, image)
    assert _decode(_proto([1], forward_only=True)).forward_only


def test_many_empty_messages_are_counted_before_the_body_is_parsed() -> None:
    """Parsing builds an object per message: 4 million empty datums (8 MB, or 715 bytes of zstd) took 224 MB
    before the datum limit refused them. The counts are checked on the wire first, each naming its limit;
    a request within them (as the SDK sends it) decodes, and a body the walk cannot follow is refused."""
    limits = Limits(max_seq_len=8, vocab_size=100, max_datums=2)
    empty_datums = b"\x1a\x00" * 1000
    _refused("data has more than 2 datums, the limit", parse_forward_backward_proto, empty_datums, limits)
    chunks = b"\x1a\xd0\x0f" + b"\x0a\x00" * 1000  # one datum of 1000 empty chunks (2000 bytes)
    _refused("more than 48 entries .model_input chunks", parse_forward_backward_proto, chunks, limits)
    configs = b"\x2a\x00" * 65
    _refused("loss_fn_config has more than 64 entries", parse_forward_backward_proto, configs, limits)
    _refused("wire type 3 is not accepted", parse_forward_backward_proto, b"\x0b" + empty_datums, limits)
    _refused("runs past its end", parse_forward_backward_proto, b"\x1a\x05\x00", limits)
    assert len(_decode(_proto([1, 2], [3])).data) == 2
    # The SDK's `append_int` makes a chunk per token: whole datums of one-token chunks are within the count.
    per_token = _proto([1] * 8, [2] * 8)
    for datum in per_token.data:
        tokens = datum.model_input[0].encoded_text.tokens
        del datum.model_input[:]
        for i in range(0, len(tokens), 4):
            datum.model_input.add().encoded_text.tokens = tokens[i : i + 4]
    assert [d.tokens for d in _decode(per_token).data] == [[1] * 8, [2] * 8]


def test_a_body_of_empty_datums_never_swells_the_process() -> None:
    """The 28-fold swell, measured where it shows: the peak memory of a process decoding 4 million empty
    datums at a large model's limits."""
    code = (
        "from tx.api.limits import Limits; from tx.api.wire_decode import *\n"
        "try: parse_forward_backward_proto(b'\\x1a\\x00' * 4_000_000, Limits(32768, 1000))\n"
        "except WireError as e: print(e)\n"
        "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"  # kB; ru_maxrss counts the parent's
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert "more than 1024 datums" in out[0] and int(out[1]) < 150 << 10, out  # 270 MiB when parsed first


def test_proto_tensors_of_every_dtype() -> None:
    message = _proto()
    bf16 = np.array([1.5, -2.0, 0.25], np.float32).view(np.uint32) >> 16  # exact in bfloat16
    _proto_datum(
        message, [1, 2, 3],
        weights=_tensor(bf16, wire_proto.DTYPE_BFLOAT16, [3], "<u2"),
        target_tokens=_tensor([4, 5, 6], wire_proto.DTYPE_INT32, [3], "<i4"),
        advantages=_tensor([0.5, 1, 2], wire_proto.DTYPE_FLOAT32, []),
        logprobs=_tensor([-1, -2, -3], wire_proto.DTYPE_INT64, [3], "<i8"),
    )  # fmt: skip
    inputs = _decode(message).data[0].loss_fn_inputs
    np.testing.assert_array_equal(inputs["weights"], [1.5, -2.0, 0.25])
    assert inputs["weights"].dtype == np.float32 and inputs["target_tokens"].dtype == np.int64
    np.testing.assert_array_equal(inputs["target_tokens"], [4, 5, 6])
    np.testing.assert_array_equal(inputs["advantages"], [0.5, 1, 2])
    np.testing.assert_array_equal(inputs["logprobs"], [-1, -2, -3])
    for tensor, fragment in [
        (_tensor([1], 9, [1]), "unsupported dtype enum 9"),
        (_tensor([1, 2, 3], wire_proto.DTYPE_FLOAT32, [2, 2]), "3 values do not fit shape"),
        (_short(), "byte length 3 is not a multiple of 4"),
    ]:
        bad = _proto()
        _proto_datum(bad, [1, 2, 3], weights=tensor)
        _refused(fragment, _decode, bad)


def _short() -> Any:
    tensor = _tensor([1.0], wire_proto.DTYPE_FLOAT32, [1])
    tensor.dense = tensor.dense[:3]
    return tensor


def _sparse(values: list[float], crow: list[int], cols: list[int], shape: list[int]) -> Any:
    tensor = wire_proto.MESSAGES["Tensor"](dtype=wire_proto.DTYPE_FLOAT32)
    tensor.sparse_csr.values = np.asarray(values, "<f4").tobytes()
    tensor.sparse_csr.crow_indices = np.asarray(crow, "<i8").tobytes()
    tensor.sparse_csr.col_indices = np.asarray(cols, "<i8").tobytes()
    tensor.shape.extend(shape)
    return tensor


def _sparse_request(tensor: Any) -> Any:
    message = _proto()
    _proto_datum(message, [1, 2], weights=tensor)
    return message


def test_proto_sparse_tensors() -> None:
    dense = _decode(_sparse_request(_sparse([2.0, 3.0], [0, 1, 2], [1, 0], [2, 2]))).data[0].loss_fn_inputs
    np.testing.assert_array_equal(dense["weights"], [[0, 2], [3, 0]])
    empty = _decode(_sparse_request(_sparse([], [0, 0, 0], [], [2, 0]))).data[0].loss_fn_inputs["weights"]
    assert empty.shape == (2, 0)
    for tensor, fragment in [
        (_sparse([1], [0, 1], [0], [1, 1, 1]), r"shape \[1, 1, 1\] must have 1 or 2 non-negative"),
        (_sparse([1], [0, 1], [0], [-1, 1]), r"shape \[-1, 1\] has a size below 0"),
        (_sparse([1], [0, 1], [0], [1, -1]), r"shape \[1, -1\] has a size below 0"),
        (_sparse([1], [0, 1], [0], [8, 3]), "has 24 elements, more than the limit 16"),
        (_sparse([1], [0, 1], [0], [2]), "sparse tensors must be 2-D"),
    ]:
        _refused(fragment, _decode, _sparse_request(tensor))
    assert _decode(_sparse_request(_sparse([1], [0, 1, 1], [0], [2, 8]))).data[0].loss_fn_inputs["weights"].size == 16


def test_inputs_no_loss_reads_are_dropped_before_they_are_decoded() -> None:
    """Made-up input names cost nothing: 39 bytes of CSR indices per name had each become a dense
    [1, 262144] array that passed validation and was stored (8 MiB bodies: about 420 GiB)."""
    message = _proto()
    zeros = _sparse([], [0] * 9, [], [8, 2])
    datum = _proto_datum(message, [1, 2], weights=_sparse([1.0], [0, 1, 1], [0], [2, 1]))
    for i in range(20):  # entries within the count (`max_datum_entries`): a body of more is refused unread
        datum.loss_fn_inputs[f"junk{i}"].CopyFrom(zeros)
    assert list(_decode(message).data[0].loss_fn_inputs) == ["weights"]
    as_json = {"forward_backward_input": {"loss_fn": "cross_entropy", "data": [{
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
        "loss_fn_inputs": {"mask": {"data": [], "dtype": "float32", "shape": [8, 2], "sparse_crow_indices": [0] * 9}},
    }]}}  # fmt: skip
    assert parse_forward_backward_json(as_json, "forward_backward_input", LIMITS).data[0].loss_fn_inputs == {}


def test_sparse_tensors_of_a_request_expand_to_no_more_than_its_body_could_hold() -> None:
    """Server-sized limits (32k tokens, K = 64): each sparse input may be a whole [N, K] of 2M zeros from
    a few hundred KiB of row offsets, and all of them together at most the body limit in float32 values."""
    limits = Limits(max_seq_len=32768, vocab_size=151936)
    budget = limits.max_body_bytes // 4
    assert limits.max_tensor_elements == 1 << 21 and budget < 10 * limits.max_tensor_elements
    message = _proto()
    zeros = _sparse([], [0] * 32769, [], [32768, 64])
    for _ in range(2):
        datum = _proto_datum(message, [1])
        for name in ("target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask"):
            datum.loss_fn_inputs[name].CopyFrom(zeros)
    with pytest.raises(WireError, match=f"expand to more than {budget} elements in all"):
        parse_forward_backward_proto(message.SerializeToString(), limits)
    del message.data[1]
    assert len(parse_forward_backward_proto(message.SerializeToString(), limits)[1].data[0].loss_fn_inputs) == 5


def test_proto_config_legacy_and_v2() -> None:
    legacy = _proto([1], loss_fn_config={"beta": 2})
    assert _decode(legacy).loss_fn_config == {"beta": 2.0}
    both = _proto([1], loss_fn_config={"beta": 2})
    both.loss_fn_config_v2["beta"].number = 3
    both.loss_fn_config_v2["mode"].text = "x"
    assert _decode(both).loss_fn_config == {"beta": 3.0, "mode": "x"}


# ---- CSR consistency (shared by both encodings) -------------------------------------------------


@pytest.mark.parametrize(
    "crow, cols, values, fragment",
    [
        ([0, 1], [0], [1.0], "inconsistent sparse CSR"),  # one row offset short
        ([0, 1, 1, 1], [0], [1.0], "inconsistent sparse CSR"),  # one too many
        ([0, 1, 2], [0], [1.0, 2.0], "inconsistent sparse CSR"),  # fewer columns than values
        ([0, 1, 1], [0], [1.0, 2.0], "inconsistent sparse CSR"),  # last offset short of the values
        ([1, 1, 1], [0], [1.0], "must start at 0"),
        ([1, 1, 2], [0, 1], [1.0, 2.0], "must start at 0"),
        ([0, 2, 1], [0], [1.0], "never decrease"),
        ([0, 2, 1], [0, 1], [1.0, 2.0], "inconsistent sparse CSR"),
        ([0, 0, 2], [0, 3], [1.0, 2.0], "column index out of range"),
        ([0, 0, 2], [-1, 0], [1.0, 2.0], "column index out of range"),
    ],
)
def test_bad_csr_indices(crow: list[int], cols: list[int], values: list[float], fragment: str) -> None:
    tensor = {"data": values, "shape": [2, 3], "sparse_crow_indices": crow, "sparse_col_indices": cols}
    _refused(fragment, json_tensor, tensor, "w", LIMITS)


def test_decreasing_row_offsets() -> None:
    tensor = {"data": [1.0, 2.0], "shape": [3, 3], "sparse_crow_indices": [0, 2, 1, 2], "sparse_col_indices": [0, 1]}
    _refused("never decrease", json_tensor, tensor, "w", LIMITS)
    good = {**tensor, "sparse_crow_indices": [0, 1, 1, 2]}
    np.testing.assert_array_equal(json_tensor(good, "w", LIMITS), [[1, 0, 0], [0, 0, 0], [0, 2, 0]])


# ---- JSON ---------------------------------------------------------------------------------------


def _json_datum(tokens: list[int], **inputs: Any) -> dict[str, Any]:
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]}, "loss_fn_inputs": inputs}


def _json(key: str = "forward_backward_input", **inner: Any) -> Any:
    body = {"data": [_json_datum([1, 2], target_tokens={"data": [2, 3], "dtype": "int64"})], **inner}
    return parse_forward_backward_json({key: body}, key, LIMITS)


def test_json_forward_backward_body() -> None:
    request = _json(loss_fn="cross_entropy")
    assert request.data[0].tokens == [1, 2] and request.loss_fn == "cross_entropy" and not request.forward_only
    np.testing.assert_array_equal(request.data[0].loss_fn_inputs["target_tokens"], [2, 3])
    assert request.loss_fn_config == {}
    assert _json("forward_input", loss_fn_config=None).forward_only
    assert _json(loss_fn_config={"beta": 1.0}).loss_fn_config == {"beta": 1.0}
    bare = parse_forward_backward_json({"k": {"data": [{"model_input": {"chunks": []}}]}}, "k", LIMITS)
    assert bare.data[0].tokens == [] and bare.data[0].loss_fn_inputs == {} and bare.loss_fn == ""
    nulls = {"k": {"data": [{"model_input": {"chunks": []}, "loss_fn_inputs": None}], "loss_fn_config": None}}
    assert parse_forward_backward_json(nulls, "k", LIMITS).loss_fn_config == {}


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({}, "missing object field 'k'"),
        ({"k": []}, "missing object field 'k'"),
        ({"k": {"data": {}}}, "k.data must be a list of datums"),
        ({"k": {"data": [[]]}}, r"data\[0\] must be an object"),
        ({"k": {"data": [{"model_input": {"chunks": []}}] * 3}}, "k.data has 3 datums, more than the limit 2"),
        ({"k": {"data": [], "loss_fn_config": [1]}}, "k.loss_fn_config must be an object"),
        ({"k": {"data": [], "loss_fn": 3}}, "k.loss_fn must be a string"),
        ({"k": {"data": [{"model_input": {"chunks": []}, "loss_fn_inputs": [1]}]}}, "loss_fn_inputs must be an object"),
    ],
)
def test_json_forward_backward_refusals(body: dict[str, Any], fragment: str) -> None:
    _refused(fragment, parse_forward_backward_json, body, "k", LIMITS)


def test_model_input_tokens() -> None:
    text = {"type": "encoded_text", "tokens": [1, 2]}
    assert model_input_tokens({"chunks": [text, {"tokens": [3]}]}, "m", 3) == [1, 2, 3]  # the type defaults
    _refused("m has 4 tokens, more than the maximum length 3", model_input_tokens, {"chunks": [text] * 2}, "m", 3)
    for bad in [None, [], {"chunks": None}, {"chunks": {}}]:
        _refused("m must be an object with a 'chunks' list", model_input_tokens, bad, "m", 3)
    _refused("m: image input is not supported yet", model_input_tokens, {"chunks": [{"type": "image"}]}, "m", 3)
    _refused(
        "m: image input is not supported", model_input_tokens, {"chunks": [{"type": "image_asset_pointer"}]}, "m", 3
    )
    _refused("m: dmel chunks are not supported", model_input_tokens, {"chunks": [{"type": "dmel"}]}, "m", 3)
    _refused("m: empty chunks are not supported", model_input_tokens, {"chunks": [7]}, "m", 3)
    for tokens in [None, "12", [1.0], [True], [1, "2"]]:
        chunk = {"type": "encoded_text", "tokens": tokens}
        _refused("encoded_text.tokens must be a list of integers", model_input_tokens, {"chunks": [chunk]}, "m", 3)


def test_json_tensors() -> None:
    np.testing.assert_array_equal(json_tensor({"data": [1, 2]}, "w", LIMITS), [1.0, 2.0])  # float32 by default
    assert json_tensor({"data": [1, 2]}, "w", LIMITS).dtype == np.float32
    b64 = {"data": "AACAPwAAAEA=", "dtype": "float32", "shape": [1, 2]}  # 1.0, 2.0 little-endian
    np.testing.assert_array_equal(json_tensor(b64, "w", LIMITS), [[1.0, 2.0]])
    assert json_tensor({"data": [], "shape": [0]}, "w", LIMITS).shape == (0,)
    edges = [-(1 << 63), (1 << 63) - 1]
    np.testing.assert_array_equal(json_tensor({"data": edges, "dtype": "int64"}, "w", LIMITS), edges)
    for bad_ints in ([1 << 63], [-(1 << 63) - 1]):
        _refused(
            "w.data must be a list of 64-bit integers", json_tensor, {"data": bad_ints, "dtype": "int64"}, "w", LIMITS
        )
    for tensor, fragment in [
        ([1], "w must be a TensorData object with 'data'"),
        ({"shape": [1]}, "w must be a TensorData object with 'data'"),
        ({"data": [1], "dtype": "int32"}, "dtype must be 'float32' or 'int64', got 'int32'"),
        ({"data": 1}, "data must be a list of numbers or a base64 string"),
        ({"data": ["a"]}, "w.data must be a flat list of numbers"),
        ({"data": ["1e3"]}, "w.data must be a flat list of numbers"),  # numpy read it as 1000
        ({"data": [True]}, "w.data must be a flat list of numbers"),
        ({"data": [None]}, "w.data must be a flat list of numbers"),  # NaN
        ({"data": [[1], [2]], "shape": [2]}, "w.data must be a flat list of numbers"),
        ({"data": "not base64!"}, "data is not numeric"),
        ({"data": [1], "shape": "1"}, "shape must be a list of integers"),
        ({"data": [1], "shape": [1.0]}, "shape must be a list of integers"),
        ({"data": [1, 2], "shape": [-1, -2]}, r"shape \[-1, -2\] has a size below 0"),
        ({"data": [1, 2], "shape": [2, -1]}, r"shape \[2, -1\] has a size below 0"),
        ({"data": [1], "shape": [1, 1, 1, 1, 1]}, "shape has more than 4 dimensions"),
    ]:
        _refused(fragment, json_tensor, tensor, "w", LIMITS)


def test_a_shape_of_many_huge_sizes_is_refused_before_it_is_multiplied() -> None:
    """A list of 60,000 sizes of 2^62 (172 bytes of zstd protobuf) took 8 s of GIL to multiply out, and
    the refusal echoed the whole list back; it is refused by its length, in a message of a few words."""
    huge = [1 << 62] * 20_000
    with pytest.raises(WireError, match="more than 4 dimensions") as json_err:
        json_tensor({"data": [1], "shape": huge}, "w", LIMITS)
    bad = _proto()
    _proto_datum(bad, [1, 2], target_tokens=_tensor([], wire_proto.DTYPE_INT64, huge, "<i8"))
    with pytest.raises(WireError, match="more than 4 dimensions") as proto_err:
        _decode(bad)
    assert len(str(json_err.value)) < 200 and len(str(proto_err.value)) < 200
    _refused("of 2\\^62 and more", json_tensor, {"data": [1], "shape": [1 << 62]}, "w", LIMITS)


# ---- sampling -----------------------------------------------------------------------------------


def test_sampling_params_defaults_and_numbers() -> None:
    params = sampling_params({}, 9)
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p, params.seed) == (9, 1.0, -1, 1.0, None)
    nulls = sampling_params({"max_tokens": None, "temperature": None, "top_k": None, "top_p": None}, 9)
    assert (nulls.max_tokens, nulls.temperature, nulls.top_k, nulls.top_p) == (9, 1.0, -1, 1.0)
    given = sampling_params({"max_tokens": 3.0, "temperature": 0, "top_k": 5, "top_p": 0.5, "seed": 7}, 9)
    assert (given.max_tokens, given.temperature, given.top_k, given.top_p, given.seed) == (3, 0.0, 5, 0.5, 7)
    assert type(given.max_tokens) is int and type(given.temperature) is float
    for field, bad in [("max_tokens", 3.5), ("max_tokens", True), ("temperature", "1"), ("top_p", False),
                       ("seed", 1.5), ("top_k", "5")]:  # fmt: skip
        _refused(f"sampling_params.{field} must be", sampling_params, {field: bad}, 9)
    _refused("sampling_params must be an object", sampling_params, [], 9)
    _refused(r"sampling_params.temperature is too large for a number \(400 digits\)", sampling_params,
             {"temperature": 10**399}, 9)  # fmt: skip
    for stop in [[1, "a"], 3, [None]]:
        _refused("sampling_params.stop must be", sampling_params, {"stop": stop}, 9)
    assert sampling_params({"stop": ["a", "b"]}, 9).stop_strings == ["a", "b"]
