"""The blob codec round-trips every protocol type and refuses anything else."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from tx.db import codec
from tx.protocol import (
    AdamParams,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoadWeightsRequest,
    LoraConfig,
    OptimStepRequest,
    RequestError,
    SampledSequence,
    SampleRequest,
    SampleResult,
    SamplingParams,
    TopkLogprobs,
    WeightsRef,
)


def test_roundtrip_forward_backward_with_arrays() -> None:
    tokens = list(range(100))
    request = ForwardBackwardRequest(
        [Datum(tokens, {"target_tokens": np.arange(100), "weights": np.ones((100, 2), np.float32)})],
        "ppo",
        {"clip_low_threshold": 0.8, "name": "x"},
        forward_only=True,
    )
    back = codec.decode(codec.encode(request))
    assert back.data[0].tokens == tokens and type(back.data[0].tokens[0]) is int
    assert back.data[0].loss_fn_inputs["weights"].shape == (100, 2)
    assert back.data[0].loss_fn_inputs["target_tokens"].dtype == np.int64
    assert back.loss_fn_config == {"clip_low_threshold": 0.8, "name": "x"} and back.forward_only


@pytest.mark.parametrize(
    "obj",
    [
        OptimStepRequest(AdamParams(learning_rate=3e-4, grad_clip_norm=1.0)),
        LoadWeightsRequest("b", LoraConfig(8, train_unembed=False), "/d", "tinker://r/weights/x", True, {"k": "v"}),
        SampleRequest([1, 2], 2, SamplingParams(5, stop_token_ids=[7], stop_at_eos=False), "b", WeightsRef("s")),
        SampleResult([SampledSequence([1, 2], [-0.5, -0.25], "stop")]),
        RequestError("bad", "user"),
        [1, True, 2.5] + [3] * 40,
        [2**40] + [-1] * 40,
        [0.1 * i - 1e-300 for i in range(40)] + [float("inf"), 5e-324],  # packed as float64: every bit kept
        [0.5] * 40 + [None, 1],
    ],
)
def test_roundtrip(obj: object) -> None:
    assert codec.decode(codec.encode(obj)) == obj


def test_result_arrays_roundtrip() -> None:
    result = ForwardBackwardResult([{"logprobs": np.linspace(0, 1, 7, dtype=np.float32)}], {"loss:sum": 1.5})
    back = codec.decode(codec.encode(result))
    np.testing.assert_array_equal(back.outputs[0]["logprobs"], result.outputs[0]["logprobs"])


def test_prompt_scores_and_long_logprob_lists_travel_as_raw_bytes() -> None:
    """A long prompt's scores and a long sample's logprobs are arrays in the blob, not JSON text: the header
    stays small whatever the length, and every value comes back bit for bit."""
    P, k, T = 4096, 20, 4096
    rng = np.random.default_rng(0)
    prompt = rng.standard_normal(P).astype(np.float32)
    prompt[0] = np.nan
    ids = rng.integers(0, 2**31 - 1, (P, k)).astype(np.int32)
    topk = TopkLogprobs(ids, rng.standard_normal((P, k)).astype(np.float32))
    sequence = SampledSequence(rng.integers(0, 2**17, T).tolist(), rng.standard_normal(T).tolist(), "length")
    blob = codec.encode(SampleResult([sequence], prompt, topk))
    (header_len,) = struct.unpack_from("<I", blob, 4)
    assert header_len < 1000
    back = codec.decode(blob)
    np.testing.assert_array_equal(back.prompt_logprobs, prompt)
    np.testing.assert_array_equal(back.topk_prompt_logprobs.ids, topk.ids)
    np.testing.assert_array_equal(back.topk_prompt_logprobs.logprobs, topk.logprobs)
    assert back.sequences == [sequence]


def _blob(header: object) -> bytes:
    raw = json.dumps(header).encode()
    return codec.MAGIC + struct.pack("<I", len(raw)) + raw


def test_refuses_foreign_types_and_dtypes() -> None:
    with pytest.raises(ValueError, match="unknown type 'Popen'"):
        codec.decode(_blob({"__t": "Popen", "args": ["rm"]}))
    with pytest.raises(ValueError, match="unsupported array dtype"):
        codec.decode(_blob({"__nd": ["object", [1], 0, 8]}))
    with pytest.raises(ValueError, match="not a SmolGym blob"):
        codec.decode(b"\x80\x04pickle")


def test_the_blob_does_not_depend_on_map_order() -> None:
    """A request's blob is its dedupe digest's input: the same forward_backward whose loss_fn_inputs were
    filled in another order (a protobuf map iterates in a per-process order, so two API servers parse one
    retried request differently) must encode to the same bytes, and decode to the same request."""
    targets, weights = np.arange(5, dtype=np.int64), np.ones(5, np.float32)
    one = ForwardBackwardRequest([Datum([1, 2, 3, 4, 5], {"target_tokens": targets, "weights": weights})], "ce")
    other = ForwardBackwardRequest([Datum([1, 2, 3, 4, 5], {"weights": weights, "target_tokens": targets})], "ce")
    assert list(one.data[0].loss_fn_inputs) != list(other.data[0].loss_fn_inputs)
    assert codec.encode(one) == codec.encode(other)
    back = codec.decode(codec.encode(other)).data[0].loss_fn_inputs
    assert back.keys() == other.data[0].loss_fn_inputs.keys()
    np.testing.assert_array_equal(back["weights"], weights)
    assert codec.encode({"b": 1, "a": {"d": 2, "c": 3}}) == codec.encode({"a": {"c": 3, "d": 2}, "b": 1})


@pytest.mark.parametrize("edge", [2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32, 2**63 - 1, -(2**63)])
def test_long_int_lists_at_the_int32_edges_roundtrip_exactly(edge: int) -> None:
    """Token lists are packed as int32 when every value fits, else int64: a value one past int32 must not
    wrap around."""
    for values in ([edge] + [0] * 40, [0] * 40 + [edge]):
        back = codec.decode(codec.encode(values))
        assert back == values and all(type(v) is int for v in back)


def _header(blob: bytes) -> object:
    (length,) = struct.unpack_from("<I", blob, 4)
    return json.loads(blob[8 : 8 + length])


def test_long_token_lists_are_stored_as_four_byte_ints_not_text() -> None:
    """A forward_backward's token ids dominate its blob: a long list of small ints is raw int32 (4 bytes a
    token), not JSON text or int64; a short one stays plain JSON."""
    for tokens in (list(range(100_000, 101_000)), list(range(-1000, 0))):
        blob = codec.encode(tokens)
        assert len(blob) < 4 * len(tokens) + 100
        assert codec.decode(blob) == tokens
    longest_plain = list(range(codec._PACK_MIN))
    assert _header(codec.encode(longest_plain)) == longest_plain
    assert "__li" in _header(codec.encode([*longest_plain, 7]))  # type: ignore[operator]


def test_arrays_keep_dtype_shape_and_order_one_after_another() -> None:
    """Several arrays share the raw section: each spec's offset must point at its own bytes."""
    arrays = {
        "a": np.arange(6, dtype=np.int16).reshape(2, 3),
        "b": np.array([True, False, True]),
        "c": np.linspace(-1, 1, 5, dtype=np.float64),
        "d": np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
        "e": np.zeros((0, 2), np.uint8),
    }
    back = codec.decode(codec.encode(arrays))
    for name, array in arrays.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape, name
        np.testing.assert_array_equal(back[name], array)


def test_arrays_of_other_dtypes_are_refused_at_encode() -> None:
    with pytest.raises(TypeError, match="cannot store arrays of dtype complex64"):
        codec.encode({"x": np.zeros(2, np.complex64)})
    with pytest.raises(TypeError, match="dtype object"):
        codec.encode(np.array([{}], dtype=object))


def test_nested_tuples_dicts_and_numpy_scalars() -> None:
    obj = {"t": (1, (2.5, "x"), []), "s": np.float32(0.5), "n": None, "i": np.int64(3)}
    back = codec.decode(codec.encode(obj))
    assert back == {"t": (1, (2.5, "x"), []), "s": 0.5, "n": None, "i": 3}
    assert type(back["i"]) is int and type(back["t"][1]) is tuple


@pytest.mark.parametrize("tag", ["__t", "__tu", "__nd", "__li", "__lf", "__d"])
def test_a_users_map_keyed_like_the_codecs_tags_comes_back_as_that_map(tag: str) -> None:
    """`user_metadata` is the user's own map: {"__t": "SaveStateRequest"} made the stored create_model
    unreadable (a server error, the run failed) and {"__tu": "ab"} came back as the tuple ('a', 'b')."""
    metadata = {tag: "SaveStateRequest" if tag == "__t" else "ab", "plain": "x"}
    request = CreateModelRequest("m", LoraConfig(rank=4), metadata)
    back = codec.decode(codec.encode(request))
    assert back == request and back.user_metadata == metadata
    assert codec.decode(codec.encode({"a": {tag: [1, 2]}})) == {"a": {tag: [1, 2]}}
