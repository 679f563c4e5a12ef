"""What `retrieve_future` sends for each result: protobuf read back by the SDK's own decoders, and JSON."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from tx.api import wire_proto
from tx.api.wire_encode import clean_metrics, result_json, result_proto, wants_proto
from tx.protocol import (
    CheckpointResult,
    CreateModelResult,
    ForwardBackwardResult,
    LoadResult,
    OptimStepResult,
    SampledSequence,
    SampleResult,
    TopkLogprobs,
    UnloadResult,
)

PROTO = "application/x-protobuf"


def _sample(**kw: object) -> SampleResult:
    return SampleResult([SampledSequence([5, 6], [-0.5, -0.25], "stop")], **kw)  # type: ignore[arg-type]


def test_protobuf_only_when_asked_and_only_for_array_results() -> None:
    forward, sampled = ForwardBackwardResult([], {}), _sample()
    assert wants_proto(f"{PROTO}, application/json", forward) and wants_proto(PROTO, sampled)
    assert not wants_proto(None, forward) and not wants_proto("", sampled)
    assert not wants_proto("application/json", forward)
    for other in (OptimStepResult(), CheckpointResult("p"), CreateModelResult("m"), UnloadResult("m")):
        assert not wants_proto(PROTO, other)


def test_integer_and_boolean_outputs_travel_as_int64_floats_as_float32() -> None:
    outputs = [{"ids": np.array([3, -4], np.int32), "mask": np.array([True, False]), "lp": np.array([0.1, 2.5])}]
    decoded = deserialize_forward_backward_output(result_proto(ForwardBackwardResult(outputs, {})))
    (out,) = decoded.loss_fn_outputs
    assert out["ids"].dtype == "int64" and out["ids"].to_numpy().tolist() == [3, -4]
    assert out["mask"].dtype == "int64" and out["mask"].to_numpy().tolist() == [1, 0]
    assert out["lp"].dtype == "float32"
    np.testing.assert_array_equal(out["lp"].to_numpy(), np.array([0.1, 2.5], np.float32))


def test_forward_backward_keeps_every_datum_type_and_metric() -> None:
    """Consecutive datums of one dtype and trailing shape share a record (the SDK reads field names from
    every record alike: one result's datums always carry the same fields)."""
    outputs = [
        {"logprobs": np.arange(3, dtype=np.float32), "elementwise_loss": np.ones(3, np.float32)},
        {"logprobs": np.arange(5, dtype=np.float32) + 10, "elementwise_loss": np.zeros(5, np.float32)},
        {"logprobs": np.array([7], np.int64), "elementwise_loss": np.ones(1, np.float32)},  # another dtype
        {"logprobs": np.arange(2, dtype=np.float32), "elementwise_loss": np.ones(2, np.float32)},
    ]
    result = ForwardBackwardResult(outputs, {"loss:sum": np.float32(2.5), "n:sum": 4}, output_type="ArrayRecord")
    message = wire_proto.ForwardBackwardOutput.FromString(result_proto(result))
    assert [record.num_datums for record in message.loss_fn_outputs] == [2, 1, 1]
    offsets = np.frombuffer(message.loss_fn_outputs[0].fields["logprobs"].offsets, "<i8")
    assert offsets.tolist() == [0, 12, 32]  # bytes: 3 then 5 float32 values
    decoded = deserialize_forward_backward_output(result_proto(result))
    assert decoded.loss_fn_output_type == "ArrayRecord" and decoded.metrics == {"loss:sum": 2.5, "n:sum": 4.0}
    assert len(decoded.loss_fn_outputs) == len(outputs)
    for sent, got in zip(outputs, decoded.loss_fn_outputs, strict=True):
        assert set(got) == set(sent)
        for name, array in sent.items():
            np.testing.assert_array_equal(got[name].to_numpy(), array)


def test_trailing_shapes_split_records_and_survive() -> None:
    outputs = [{"x": np.zeros((2, 3), np.float32)}, {"x": np.ones((4, 3), np.float32)}, {"x": np.ones((1, 2))}]
    message = wire_proto.ForwardBackwardOutput.FromString(result_proto(ForwardBackwardResult(outputs, {})))
    assert [(r.num_datums, list(r.fields["x"].trailing_shape)) for r in message.loss_fn_outputs] == [(2, [3]), (1, [2])]
    decoded = deserialize_forward_backward_output(result_proto(ForwardBackwardResult(outputs, {})))
    assert [out["x"].shape for out in decoded.loss_fn_outputs] == [[2, 3], [4, 3], [1, 2]]


def test_sample_protobuf_stop_reasons_and_absent_prompt_logprobs() -> None:
    result = SampleResult([SampledSequence([1], [-1.0], "length"), SampledSequence([2, 3], [-0.5, -2.0], "stop")])
    decoded = deserialize_sample_response(result_proto(result))
    assert [(s.stop_reason, s.tokens, s.logprobs) for s in decoded.sequences] == [
        ("length", [1], [-1.0]), ("stop", [2, 3], [-0.5, -2.0])
    ]  # fmt: skip
    assert decoded.prompt_logprobs is None and decoded.topk_prompt_logprobs is None


def _topk(ids: list[list[int]], logprobs: list[list[float]]) -> TopkLogprobs:
    return TopkLogprobs(np.array(ids, np.int32), np.array(logprobs, np.float32))


def test_top_k_rows_are_sent_dense_with_the_first_as_none() -> None:
    topk = _topk([[9, 9], [4, 1], [1, 2]], [[np.nan, np.nan], [-0.5, -1.5], [-0.25, -1.0]])
    message = wire_proto.SampleResponse.FromString(result_proto(_sample(topk_prompt_logprobs=topk)))
    assert (message.topk_prompt_logprobs.k, message.topk_prompt_logprobs.length) == (2, 3)
    ids = np.frombuffer(message.topk_prompt_logprobs.token_ids, "<i4").reshape(3, 2)
    assert ids.tolist() == [[0, 0], [4, 1], [1, 2]]  # row 0: the sentinel, whatever the result held
    decoded = deserialize_sample_response(result_proto(_sample(topk_prompt_logprobs=topk)))
    assert decoded.topk_prompt_logprobs == [None, [(4, -0.5), (1, -1.5)], [(1, -0.25), (2, -1.0)]]
    one = deserialize_sample_response(result_proto(_sample(topk_prompt_logprobs=_topk([[0, 0]], [[0.0, 0.0]]))))
    assert one.topk_prompt_logprobs == [None]  # a one-token prompt: its only row is the undefined first one
    assert topk.ids[0].tolist() == [9, 9]  # the result itself is left as it was


def test_prompt_logprobs_send_entry_zero_as_none() -> None:
    prompt = np.array([-7.0, -1.5, -2.25], np.float32)
    decoded = deserialize_sample_response(result_proto(_sample(prompt_logprobs=prompt)))
    assert decoded.prompt_logprobs == [None, -1.5, -2.25]
    assert result_json(_sample(prompt_logprobs=prompt))["prompt_logprobs"] == [None, -1.5, -2.25]
    assert prompt[0] == -7.0


def test_only_the_last_n_prompt_positions_carry_scores_on_both_wires() -> None:
    prompt = np.array([-7.0, -1.5, -2.25, -3.0], np.float32)
    topk = _topk([[9, 9], [4, 1], [1, 2], [3, 5]], [[0.0, 0.0], [-0.5, -1.5], [-0.25, -1.0], [-1.0, -2.0]])
    last_two = _sample(prompt_logprobs=prompt, topk_prompt_logprobs=topk, scored_from=2)
    decoded = deserialize_sample_response(result_proto(last_two))
    assert decoded.prompt_logprobs == [None, None, -2.25, -3.0]
    assert decoded.topk_prompt_logprobs == [None, None, [(1, -0.25), (2, -1.0)], [(3, -1.0), (5, -2.0)]]
    sent = result_json(last_two)
    assert sent["prompt_logprobs"] == [None, None, -2.25, -3.0]
    assert sent["topk_prompt_logprobs"] == [None, None, [[1, -0.25], [2, -1.0]], [[3, -1.0], [5, -2.0]]]


def test_json_forward_backward_tensors_name_their_dtype_and_shape() -> None:
    outputs = [{"lp": np.arange(6, dtype=np.float64).reshape(2, 3), "ids": np.array([1, 2], np.uint8)}]
    body = result_json(ForwardBackwardResult(outputs, {"acc": 1}))
    assert body["loss_fn_output_type"] == "ArrayRecord" and body["metrics"] == {"acc:mean": 1.0}
    (out,) = body["loss_fn_outputs"]
    assert out["lp"] == {"data": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "dtype": "float32", "shape": [2, 3]}
    assert out["ids"] == {"data": [1, 2], "dtype": "int64", "shape": [2]}
    assert all(type(v) is int for v in out["ids"]["data"])


def test_json_for_every_other_result_type() -> None:
    assert result_json(CreateModelResult("m:train:0")) == {"model_id": "m:train:0", "type": "create_model"}
    assert result_json(OptimStepResult({"grad_norm:mean": 2})) == {"metrics": {"grad_norm:mean": 2.0}}
    assert result_json(CheckpointResult()) == {"path": None}
    full = CheckpointResult("tinker://r/weights/a", "s-1", 0)
    assert result_json(full) == {"path": "tinker://r/weights/a", "sampling_session_id": "s-1", "size_bytes": 0}
    assert result_json(LoadResult("m", "p")) == {"model_id": "m", "path": "p", "type": "load_weights"}
    assert result_json(UnloadResult("m")) == {"model_id": "m", "type": "unload_model"}
    with pytest.raises(TypeError, match="no JSON encoding for str"):
        result_json("x")  # type: ignore[arg-type]


def test_json_sample_keeps_prompt_logprobs_and_top_k_rows() -> None:
    topk = _topk([[0], [4]], [[np.nan], [-0.5]])
    body = result_json(_sample(prompt_logprobs=np.array([np.nan, -1.5], np.float32), topk_prompt_logprobs=topk))
    assert body == {
        "sequences": [{"stop_reason": "stop", "tokens": [5, 6], "logprobs": [-0.5, -0.25]}],
        "prompt_logprobs": [None, -1.5],
        "topk_prompt_logprobs": [None, [[4, -0.5]]],
        "type": "sample",
    }
    assert type(body["topk_prompt_logprobs"][1][0][0]) is int and type(body["prompt_logprobs"][1]) is float
    assert result_json(_sample())["topk_prompt_logprobs"] is None


def test_metric_keys_are_repaired_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tx.api"):
        clean = clean_metrics({"ok:sum": np.float32(1), "a:b:c:max": 2, "plain": 3})
    assert clean == {"ok:sum": 1.0, "a_b_c:max": 2.0, "plain:mean": 3.0}
    assert all(type(v) is float for v in clean.values())
    assert [r.getMessage() for r in caplog.records] == [
        "metric key 'a:b:c:max' is not 'name:reduction'; sending it as 'a_b_c:max'",
        "metric key 'plain' is not 'name:reduction'; sending it as 'plain:mean'",
    ]
