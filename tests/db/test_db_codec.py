"""The blob codec round-trips every protocol type and refuses anything else."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from tx.db import codec
from tx.protocol import (
    AdamParams,
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
        SampleResult([SampledSequence([1, 2], [-0.5, -0.25], "stop")], [None, -1.5], [None, [(3, -0.1), (4, -0.2)]]),
        RequestError("bad", "user"),
        [1, True, 2.5] + [3] * 40,
        [2**40] + [-1] * 40,
    ],
)
def test_roundtrip(obj: object) -> None:
    assert codec.decode(codec.encode(obj)) == obj


def test_result_arrays_roundtrip() -> None:
    result = ForwardBackwardResult([{"logprobs": np.linspace(0, 1, 7, dtype=np.float32)}], {"loss:sum": 1.5})
    back = codec.decode(codec.encode(result))
    np.testing.assert_array_equal(back.outputs[0]["logprobs"], result.outputs[0]["logprobs"])


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
