"""Our protobuf encoders, decoded by the SDK's own decoders; our decoders, fed by the SDK's encoders."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from tx.api.limits import Limits
from tx.api.routes_futures import _render
from tx.api.wire_decode import WireError, json_tensor, parse_forward_backward_proto, sampling_params
from tx.api.wire_encode import clean_metrics, forward_backward_proto, sample_proto
from tx.db.tables import FutureRow
from tx.protocol import ForwardBackwardResult, SampledSequence, SampleResult, TopkLogprobs

LIMITS = Limits(max_seq_len=64, vocab_size=256)


def test_ragged_outputs_become_several_records() -> None:
    outputs = [
        {"logprobs": np.zeros((3, 2), np.float32)},
        {"logprobs": np.ones((4, 2), np.float32)},
        {"logprobs": np.full((2, 5), 2.0, np.float32)},
    ]
    decoded = deserialize_forward_backward_output(
        forward_backward_proto(ForwardBackwardResult(outputs, {"loss:sum": 1}))
    )
    assert [o["logprobs"].shape for o in decoded.loss_fn_outputs] == [[3, 2], [4, 2], [2, 5]]
    assert decoded.loss_fn_outputs[2]["logprobs"].to_numpy()[0, 0] == 2.0


def test_sample_proto_decoded_by_sdk() -> None:
    result = SampleResult(
        [SampledSequence([5, 6], [-0.1, -0.2], "stop"), SampledSequence([7], [-0.3], "length")],
        prompt_logprobs=np.array([np.nan, -1.5, -2.5], np.float32),
        topk_prompt_logprobs=TopkLogprobs(
            np.array([[0, 0], [1, 4], [2, 3]], np.int32), np.array([[0, 0], [-0.5, -1], [-0.25, -0.75]], np.float32)
        ),
    )
    decoded = deserialize_sample_response(sample_proto(result))
    assert [s.tokens for s in decoded.sequences] == [[5, 6], [7]]
    assert [s.stop_reason for s in decoded.sequences] == ["stop", "length"]
    assert decoded.prompt_logprobs[0] is None and decoded.prompt_logprobs[1:] == [-1.5, -2.5]
    assert decoded.topk_prompt_logprobs[0] is None and decoded.topk_prompt_logprobs[2] == [(2, -0.25), (3, -0.75)]


def test_sdk_proto_request_with_sparse_and_v2_config() -> None:
    sparse = types.TensorData(
        data=[0.5], dtype="float32", shape=[3, 4], sparse_crow_indices=[0, 0, 1, 1], sparse_col_indices=[2]
    )
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": np.zeros((3, 4), np.int64), "weights": sparse},
    )
    config = {"clip_low_threshold": 0.7, "mode": "x"}
    fb_input = types.ForwardBackwardInput(data=[datum], loss_fn="ppo", loss_fn_config=config)
    wire = types.ForwardBackwardRequest(forward_backward_input=fb_input, model_id="m:train:0", seq_id=9)
    message, request = parse_forward_backward_proto(forward_backward_request_to_proto(wire).SerializeToString(), LIMITS)
    assert message.seq_id == 9 and request.data[0].tokens == [1, 2, 3] and request.loss_fn_config == config
    expected = np.zeros((3, 4), np.float32)
    expected[1, 2] = 0.5
    np.testing.assert_array_equal(request.data[0].loss_fn_inputs["weights"], expected)


def test_json_tensor_sparse_and_errors() -> None:
    dense = json_tensor({"data": [1.0, 2.0], "dtype": "float32", "shape": [2, 3], "sparse_crow_indices": [0, 1, 2],
                         "sparse_col_indices": [2, 0]}, "w", LIMITS)  # fmt: skip
    np.testing.assert_array_equal(dense, [[0, 0, 1], [2, 0, 0]])
    with pytest.raises(WireError, match="w: 3 values do not fit shape"):
        json_tensor({"data": [1, 2, 3], "dtype": "int64", "shape": [2, 2]}, "w", LIMITS)
    for bad in ([1.5, 2], [True, 2], ["1", 2], [1 << 63, 2]):  # never truncated or coerced into a token id
        with pytest.raises(WireError, match=r"w.data must be a list of 64-bit integers"):
            json_tensor({"data": bad, "dtype": "int64", "shape": [2]}, "w", LIMITS)
    sparse = {"data": [1.0], "dtype": "float32", "shape": [1, 2], "sparse_crow_indices": [0, 1]}
    for key, bad in (("sparse_crow_indices", [0, "a"]), ("sparse_col_indices", [0.5])):
        with pytest.raises(WireError, match=f"w.{key} must be a list of 64-bit integers"):
            json_tensor({**sparse, "sparse_col_indices": [1], key: bad}, "w", LIMITS)


def test_stop_semantics() -> None:
    assert sampling_params({"max_tokens": 3}, 9).stop_at_eos
    empty = sampling_params({"stop": []}, 9)
    assert not empty.stop_at_eos and empty.max_tokens == 9
    strings, ids = sampling_params({"stop": "\n"}, 9), sampling_params({"stop": [7, 8]}, 9)
    assert strings.stop_strings == ["\n"] and strings.stop_at_eos  # a stop list adds to EOS (§8.2: only [] ends it)
    assert ids.stop_token_ids == [7, 8] and ids.stop_at_eos
    assert sampling_params({"stop": ["a", "b"]}, 9).stop_at_eos and sampling_params({"stop": None}, 9).stop_at_eos


def test_metric_keys_repaired() -> None:
    assert clean_metrics({"loss:sum": 1.0, "acc": 2.0, "a:b:max": 3.0}) == {
        "loss:sum": 1.0,
        "acc:mean": 2.0,
        "a_b:max": 3.0,
    }


def test_unencodable_result_is_a_failure_not_a_5xx() -> None:
    response = _render(FutureRow(id=1, kind="x", result=b"garbage"), None)
    assert response.status_code == 200 and b'"category":"server"' in bytes(response.body)
