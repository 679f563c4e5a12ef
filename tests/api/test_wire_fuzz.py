"""Property-based fuzzing of wire decoding and validation: hostile bodies only ever raise our own errors.

Bodies are random bytes, random JSON values, and real SDK-encoded requests mutated (bytes flipped,
cut, inserted), each plain or zstd-compressed. Decoding may succeed or raise `WireError`; whatever
decodes is validated, which may only raise `ValidationError`. Anything else would be an HTTP 500,
which the SDK retries forever.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.harness import proto_body
from tx.api import validate
from tx.api.limits import Limits
from tx.api.wire_decode import (
    WireError,
    decompress,
    model_input_tokens,
    parse_forward_backward_json,
    parse_forward_backward_proto,
    sampling_params,
)
from tx.protocol import ModelInfo

INFO = ModelInfo(base_model="m", vocab_size=300, max_seq_len=32, tokenizer_id="t")
LIMITS = Limits(max_seq_len=INFO.max_seq_len, vocab_size=INFO.vocab_size)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
JSON = {"Content-Type": "application/json"}
REAL = [
    proto_body("m:train:0", 1, [1, 2, 3]),
    proto_body("m:train:0", 2, [5, 6, 7, 8], [6, 7, 8, 9], loss_fn="ppo", clip_low_threshold=0.7),
]


def _decode_and_validate_proto(body: bytes, encoding: str | None) -> None:
    try:
        _, request = parse_forward_backward_proto(decompress(body, encoding, LIMITS.max_body_bytes), LIMITS)
    except WireError:
        return
    try:
        validate.check_forward_backward(request, INFO, LIMITS)
    except validate.ValidationError:
        pass


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    body = bytearray(draw(st.sampled_from(REAL)))
    for _ in range(draw(st.integers(1, 4))):
        op, at = draw(st.sampled_from(["flip", "cut", "insert"])), draw(st.integers(0, max(len(body) - 1, 0)))
        if op == "flip" and body:
            body[at] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del body[at:]
        else:
            body[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(body)


@FUZZ
@given(body=st.one_of(st.binary(max_size=256), mutated()), compress=st.booleans())
def test_protobuf_bodies_raise_only_wire_errors(body: bytes, compress: bool) -> None:
    if compress:
        body = zstandard.ZstdCompressor().compress(body)
    _decode_and_validate_proto(body, "zstd" if compress else None)


@FUZZ
@given(body=st.binary(max_size=128))
def test_garbage_claiming_zstd_raises_only_wire_errors(body: bytes) -> None:
    _decode_and_validate_proto(body, "zstd")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=24,
)


def _datum_like(draw: st.DrawFn) -> dict[str, Any]:
    tokens = draw(st.one_of(st.lists(st.integers(-5, 400), max_size=40), JSON_VALUES))
    target = {"data": draw(JSON_VALUES), "dtype": draw(st.sampled_from(["int64", "float32", "x"]))}
    if draw(st.booleans()):
        target["shape"] = draw(JSON_VALUES)
    if draw(st.booleans()):
        target["sparse_crow_indices"] = draw(JSON_VALUES)
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "loss_fn_inputs": {"target_tokens": target},
    }


@st.composite
def json_bodies(draw: st.DrawFn) -> dict[str, Any]:
    data = draw(st.one_of(st.lists(st.builds(dict), max_size=1), st.just([_datum_like(draw)]), JSON_VALUES))
    inner = {"data": data, "loss_fn": draw(st.one_of(st.just("cross_entropy"), JSON_VALUES))}
    if draw(st.booleans()):
        inner["loss_fn_config"] = draw(JSON_VALUES)
    return {"model_id": "m:train:0", "forward_backward_input": draw(st.one_of(st.just(inner), JSON_VALUES))}


@FUZZ
@given(body=json_bodies())
def test_json_forward_backward_raises_only_our_errors(body: dict[str, Any]) -> None:
    body = json.loads(json.dumps(body))  # what the server sees after parsing the text
    try:
        request = parse_forward_backward_json(body, "forward_backward_input", LIMITS)
    except WireError:
        return
    try:
        validate.check_forward_backward(request, INFO, LIMITS)
    except validate.ValidationError:
        pass


@FUZZ
@given(
    params=st.dictionaries(
        st.sampled_from(["max_tokens", "temperature", "top_k", "top_p", "seed", "stop"]), JSON_VALUES
    )
)
def test_sampling_params_raise_only_our_errors(params: dict[str, Any]) -> None:
    from tx.protocol import SampleRequest

    try:
        parsed = sampling_params(params, 8)
        prompt = model_input_tokens({"chunks": [{"tokens": [1, 2]}]}, "prompt", LIMITS.max_seq_len)
    except WireError:
        return
    request = SampleRequest(prompt=prompt, num_samples=1, params=parsed, base_model="m")
    try:
        validate.check_sample(request, INFO, LIMITS, 4, 4)
    except validate.ValidationError:
        pass


def test_a_real_body_still_decodes() -> None:
    _, request = parse_forward_backward_proto(REAL[1], LIMITS)
    assert request.data[0].tokens == [5, 6, 7, 8] and request.loss_fn == "ppo"
    np.testing.assert_array_equal(request.data[0].loss_fn_inputs["target_tokens"], [6, 7, 8, 9])


@pytest.fixture(scope="module")
def app_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The real app over a real database, no engine: whatever a request queues just waits."""
    from fastapi.testclient import TestClient

    from api.harness import MODEL
    from tx.api.app import create_app
    from tx.api.context import Settings
    from tx.db import open_database

    data_dir = tmp_path_factory.mktemp("fuzz-app")
    db = open_database(None, data_dir)
    app = create_app(Settings(data_dir=data_dir, retrieve_hold_s=0.01), db, MODEL)
    paths = app.openapi()["paths"]
    routes = [(method.upper(), path) for path, ops in paths.items() for method in ops if path.startswith("/api/v1")]
    assert len(routes) > 30
    schemas = app.openapi()["components"]["schemas"].values()
    fields = sorted({name for schema in schemas for name in schema.get("properties", {})})
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, sorted(routes), fields
    db.close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_route_answers_5xx_to_any_json(app_client: Any, data: st.DataObject) -> None:
    client, routes, fields = app_client
    method, path = data.draw(st.sampled_from(routes))
    special = st.sampled_from([math.nan, math.inf, -math.inf, 2**64, 2**70, -(2**70), -1, "", "..", [], {}])
    shaped = st.dictionaries(st.sampled_from(fields), st.one_of(special, JSON_VALUES), max_size=6)
    for param in ("run_id", "kind", "name", "sampler_id", "token", "file_path", "file", "session_id", "model_id"):
        path = path.replace("{" + param + "}", data.draw(st.text("ab.%/-_:", min_size=1, max_size=6)))
        path = path.replace("{" + param + ":path}", data.draw(st.text("ab./", min_size=1, max_size=6)))
    assert "{" not in path, path
    if method == "GET" and data.draw(st.booleans()):
        number = st.sampled_from(["-1", "0", str(2**64), "x", "1e9"])
        path += f"?limit={data.draw(number)}&offset={data.draw(number)}"
    body = json.dumps(data.draw(st.one_of(shaped, special, JSON_VALUES)), allow_nan=True)
    reply = client.request(method, path, content=body, headers={"X-API-Key": "tml-fuzz", **JSON})
    assert reply.status_code < 500, (method, path, body[:200], reply.text[:300])
