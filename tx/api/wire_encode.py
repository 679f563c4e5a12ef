"""Turn engine results into what `retrieve_future` sends: protobuf bytes or JSON objects.

Forward/forward_backward and sample results are protobuf when the client's `Accept` asks for it
(SDK 0.25+ insists), JSON otherwise (older SDKs); every other result type is always JSON. The
protobuf `ForwardBackwardOutput` carries one `ArrayRecord` whose fields are `BatchedTensor`s: the
datums' flattened values concatenated, with little-endian int64 byte offsets per datum.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from tx.api import wire_proto
from tx.protocol import (
    CheckpointResult,
    CreateModelResult,
    ForwardBackwardResult,
    LoadResult,
    OptimStepResult,
    Result,
    SampleResult,
    TopkLogprobs,
    UnloadResult,
)

log = logging.getLogger("tx.api")

EMPTY_TOPK = (0, -99999.0)


def wants_proto(accept: str | None, result: Result) -> bool:
    return bool(accept and "application/x-protobuf" in accept) and isinstance(
        result, ForwardBackwardResult | SampleResult
    )


def result_proto(result: ForwardBackwardResult | SampleResult) -> bytes:
    if isinstance(result, ForwardBackwardResult):
        return forward_backward_proto(result)
    return sample_proto(result)


def _wire_array(array: np.ndarray) -> tuple[np.ndarray, int]:
    if np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        return np.ascontiguousarray(array, dtype="<i8"), wire_proto.DTYPE_INT64
    return np.ascontiguousarray(array, dtype="<f4"), wire_proto.DTYPE_FLOAT32


def forward_backward_proto(result: ForwardBackwardResult) -> bytes:
    """One ArrayRecord per run of consecutive datums sharing field names, dtypes and trailing shapes."""
    message = wire_proto.ForwardBackwardOutput(loss_fn_output_type=result.output_type)
    for name, value in clean_metrics(result.metrics).items():
        message.metrics[name] = float(value)
    for group in _rectangular_groups(
        [{k: _wire_array(np.asarray(v)) for k, v in out.items()} for out in result.outputs]
    ):
        record = message.loss_fn_outputs.add(type_tag=result.output_type, num_datums=len(group))
        for name, (first, dtype) in group[0].items():
            tensor = record.fields[name]
            tensor.dtype = dtype
            tensor.trailing_shape.extend(first.shape[1:])
            sizes = np.array([0] + [datum[name][0].nbytes for datum in group], dtype="<i8")
            tensor.offsets = np.cumsum(sizes).astype("<i8").tobytes()
            tensor.data = b"".join(datum[name][0].tobytes() for datum in group)
    return bytes(message.SerializeToString())


_Wire = dict[str, tuple[np.ndarray, int]]


def _rectangular_groups(datums: list[_Wire]) -> list[list[_Wire]]:
    groups: list[list[_Wire]] = []
    last_key = None
    for datum in datums:
        key = tuple((name, dtype, array.shape[1:]) for name, (array, dtype) in sorted(datum.items()))
        if key != last_key:
            groups.append([])
            last_key = key
        groups[-1].append(datum)
    return groups


def clean_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Metric keys must contain exactly one ':' (the SDK splits on it); repair and log any that do not."""
    clean: dict[str, float] = {}
    for key, value in metrics.items():
        if key.count(":") != 1:
            fixed = key.replace(":", "_") + ":mean" if ":" not in key else key.replace(":", "_", key.count(":") - 1)
            log.warning("metric key %r is not 'name:reduction'; sending it as %r", key, fixed)
            key = fixed
        clean[key] = float(value)
    return clean


def sample_proto(result: SampleResult) -> bytes:
    message = wire_proto.SampleResponse()
    for seq in result.sequences:
        out = message.sequences.add()
        out.stop_reason = wire_proto.STOP_REASON_LENGTH if seq.stop_reason == "length" else wire_proto.STOP_REASON_STOP
        out.tokens = np.asarray(seq.tokens, dtype="<i4").tobytes()
        out.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
    if result.prompt_logprobs is not None:
        values = np.array(result.prompt_logprobs, dtype="<f4")
        values[: result.scored_from] = math.nan  # the wire's None: nothing precedes the first token
        message.prompt_logprobs = values.tobytes()
    if result.topk_prompt_logprobs is not None:
        _fill_topk(message.topk_prompt_logprobs, result.topk_prompt_logprobs, result.scored_from)
    return bytes(message.SerializeToString())


def _fill_topk(message: Any, topk: TopkLogprobs, scored_from: int) -> None:
    """Dense [P, k] matrices; the rows before `scored_from` hold the sentinel the SDK reads as None."""
    ids, logprobs = np.array(topk.ids, dtype="<i4"), np.array(topk.logprobs, dtype="<f4")
    ids[:scored_from], logprobs[:scored_from] = EMPTY_TOPK
    message.token_ids, message.logprobs = ids.tobytes(), logprobs.tobytes()
    message.length, message.k = ids.shape


def _tensor_json(array: np.ndarray) -> dict[str, Any]:
    wire, dtype = _wire_array(np.asarray(array))
    return {
        "data": wire.reshape(-1).tolist(),
        "dtype": "int64" if dtype == wire_proto.DTYPE_INT64 else "float32",
        "shape": list(wire.shape),
    }


def result_json(result: Result) -> dict[str, Any]:
    """The JSON success payload for any result type (§6.3 of the wire contract)."""
    if isinstance(result, ForwardBackwardResult):
        outputs = [{name: _tensor_json(value) for name, value in out.items()} for out in result.outputs]
        return {
            "loss_fn_output_type": result.output_type,
            "loss_fn_outputs": outputs,
            "metrics": clean_metrics(result.metrics),
        }
    if isinstance(result, SampleResult):
        return _sample_json(result)
    if isinstance(result, CreateModelResult):
        return {"model_id": result.model_id, "type": "create_model"}
    if isinstance(result, OptimStepResult):
        return {"metrics": clean_metrics(result.metrics)}
    if isinstance(result, CheckpointResult):
        return _checkpoint_json(result)
    if isinstance(result, LoadResult):
        return {"model_id": result.model_id, "path": result.path, "type": "load_weights"}
    if isinstance(result, UnloadResult):
        return {"model_id": result.model_id, "type": "unload_model"}
    raise TypeError(f"no JSON encoding for {type(result).__name__}")


def _checkpoint_json(result: CheckpointResult) -> dict[str, Any]:
    out: dict[str, Any] = {"path": result.path}
    if result.sampling_session_id is not None:
        out["sampling_session_id"] = result.sampling_session_id
    if result.size_bytes is not None:
        out["size_bytes"] = result.size_bytes
    return out


def _sample_json(result: SampleResult) -> dict[str, Any]:
    sequences = [
        {"stop_reason": s.stop_reason, "tokens": list(s.tokens), "logprobs": list(s.logprobs)} for s in result.sequences
    ]
    first = result.scored_from
    prompt = None if result.prompt_logprobs is None else [None] * first + result.prompt_logprobs[first:].tolist()
    topk = None if result.topk_prompt_logprobs is None else _topk_json(result.topk_prompt_logprobs, first)
    return {
        "sequences": sequences,
        "prompt_logprobs": prompt,
        "topk_prompt_logprobs": topk,
        "type": "sample",
    }


def _topk_json(topk: TopkLogprobs, first: int) -> list[list[list[int | float]] | None]:
    """Row j lists [token, logprob] pairs; the rows before `first` are None."""
    rows: list[list[list[int | float]] | None] = [None] * first
    for ids, logprobs in zip(topk.ids[first:].tolist(), topk.logprobs[first:].tolist(), strict=True):
        rows.append([[t, lp] for t, lp in zip(ids, logprobs, strict=True)])
    return rows
