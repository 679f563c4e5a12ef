"""Hostile and careless requests against the real engine: each one fails alone, and the server keeps serving.

Every test here reproduces a defect found by probing the server (names that escape the run's
directory, inputs that failed other callers' work, non-finite numbers, tiny bodies that allocated
hundreds of MiB, 500s for malformed input) and checks the behaviour that replaced it.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from api.harness import PROTO, proto_body, running_server
from tx.api.body_limit import BodyLimit, BodyTooLarge

pytestmark = [pytest.mark.e2e]
KEY = "tml-hardening"


@pytest.fixture(scope="module")
def real(hf_models, tmp_path_factory) -> Iterator[dict[str, Any]]:  # type: ignore[no-untyped-def]
    from tx.engine import AdapterConfig, EngineConfig, build_runner
    from tx.engine.sampler import SamplerConfig

    data_dir = tmp_path_factory.mktemp("hardening")
    model_dir, _ = hf_models()
    runner, info = build_runner(
        EngineConfig(base_model=str(model_dir), data_dir=data_dir, dtype="float32",
            adapters=AdapterConfig(6, 8), sampler=SamplerConfig(max_rows=4, max_seq_len=64))
    )  # fmt: skip
    with running_server(runner, info, data_dir) as (url, db):
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = service.create_lora_training_client(base_model=info.base_model, rank=4, seed=0)
        http = httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": KEY}, timeout=60)
        services = [service]  # closed before the server stops, so no heartbeat outlives it
        yield {"url": url, "info": info, "data_dir": data_dir, "db": db, "training": training, "http": http,
               "services": services}  # fmt: skip
        http.close()
        for client in services:
            client.close("success").result(timeout=30)


def _datum(tokens: list[int], **inputs: np.ndarray) -> types.Datum:
    loss_inputs = {"target_tokens": np.array(tokens[1:] + [0], np.int64), **inputs}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=loss_inputs)


def _still_serves(training: tinker.TrainingClient) -> None:
    out = training.forward([_datum([1, 2, 3, 4])], "cross_entropy").result(timeout=60)
    assert out.loss_fn_outputs[0]["logprobs"].shape == [4]


BAD_NAMES = ["..", ".", "x" * 250, ".hidden", "a/b", "a b", "ünïcode"]


@pytest.mark.parametrize("route", ["save_weights", "save_weights_for_sampler", "save_weights_external"])
def test_bad_checkpoint_names_are_refused_before_queueing(real: dict[str, Any], route: str) -> None:
    model_id = real["training"].model_id
    for name in BAD_NAMES:
        reply = real["http"].post(f"/{route}", json={"model_id": model_id, "path": name})
        assert reply.status_code == 400, (name, reply.text)
        assert "not a valid name" in reply.json()["detail"] and "path" in reply.json()["detail"]
    _still_serves(real["training"])


def test_dot_names_cannot_reach_sibling_checkpoints(real: dict[str, Any]) -> None:
    training = real["training"]
    kept = training.save_state("kept").result(timeout=60).path
    run_dir = Path(real["data_dir"]) / "checkpoints" / training.model_id.replace(":", "_")
    for name in (".", ".", ".."):  # saving "." twice with overwrite once replaced the whole weights/ tree
        reply = real["http"].post(
            "/save_weights", json={"model_id": training.model_id, "path": name, "overwrite": True}
        )
        assert reply.status_code == 400, reply.text
    for name in ("%2E%2E", "%2E", ".hidden"):
        reply = real["http"].delete(f"/training_runs/{training.model_id}/checkpoints/weights/{name}")
        assert reply.status_code in (400, 404), reply.text
    assert (run_dir / "weights" / "kept" / "run.json").is_file()
    listed = real["http"].get(f"/training_runs/{training.model_id}/checkpoints").json()["checkpoints"]
    assert kept in [c["tinker_path"] for c in listed]


@pytest.mark.parametrize(
    "inputs, fragment",
    [
        ({"weights": np.ones((4, 2), np.float32)}, "weights has shape"),  # 2-D weights, 1-D targets
        ({"advantages": np.ones((4, 3), np.float32)}, "advantages has shape"),  # 2-D input CE never reads as 2-D
        ({"target_tokens": np.zeros((4, 0), np.int64)}, "K = 0"),
        ({"target_tokens": np.zeros(4, np.float32)}, "integer token ids"),
    ],
)
def test_bad_loss_inputs_are_refused(real: dict[str, Any], inputs: dict[str, np.ndarray], fragment: str) -> None:
    bad = _datum([1, 2, 3, 4], **inputs)
    with pytest.raises(tinker.BadRequestError, match=fragment):
        real["training"].forward_backward([bad], "cross_entropy").result(timeout=60)
    _still_serves(real["training"])


def _sample(real: dict[str, Any], params: str) -> httpx.Response:
    http = real["http"]
    session = http.post("/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": real["info"].base_model}
    sampler = http.post("/create_sampling_session", json=body).json()["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    raw = f'{{"sampling_session_id": "{sampler}", "prompt": {json.dumps(prompt)}, "sampling_params": {params}}}'
    return http.post("/asample", content=raw, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(
    "params, fragment",
    [
        ('{"max_tokens": 4, "top_k": 1099511627776}', "top_k"),
        ('{"max_tokens": 4, "temperature": NaN}', "temperature"),
        ('{"max_tokens": 4, "top_p": Infinity}', "top_p"),
        ('{"max_tokens": 4, "seed": 1180591620717411303424}', "seed"),
        ('{"max_tokens": "abc"}', "max_tokens"),
        ('{"max_tokens": 4, "stop": [{"a": 1}]}', "stop"),
    ],
)
def test_bad_sampling_params_are_400(real: dict[str, Any], params: str, fragment: str) -> None:
    reply = _sample(real, params)
    assert reply.status_code == 400, reply.text
    assert fragment in reply.json()["detail"]


def test_null_sampling_fields_take_their_defaults(real: dict[str, Any]) -> None:
    reply = _sample(real, '{"max_tokens": 3, "temperature": null, "top_k": null}')
    assert reply.status_code == 200, reply.text


def _retrieve_json(real: dict[str, Any], request_id: str) -> dict[str, Any]:
    for _ in range(60):
        reply = real["http"].post("/retrieve_future", json={"request_id": request_id})
        if reply.status_code != 408:
            parsed: dict[str, Any] = json.loads(reply.text)  # Python's json reads NaN / Infinity back
            return parsed
    raise AssertionError("the future never finished")


def test_non_finite_losses_and_metrics_survive(real: dict[str, Any]) -> None:
    training = real["training"]
    service = tinker.ServiceClient(base_url=real["url"], api_key=KEY)
    real["services"].append(service)
    run = service.create_lora_training_client(base_model=real["info"].base_model, rank=4, seed=0)
    # Weights of 3e38 (finite, so valid) overflow the loss and the gradient's norm in float32.
    datum = _datum([5, 6, 7, 8], weights=np.full(4, 3e38, np.float32))
    fb = run.forward_backward([datum], "cross_entropy").result(timeout=60)
    assert math.isinf(fb.metrics["loss:sum"])
    step = real["http"].post("/optim_step", json={"model_id": run.model_id, "adam_params": {"learning_rate": 1e-3}})
    refused = _retrieve_json(real, step.json()["request_id"])
    assert refused["category"] == "user" and "not finite" in refused["error"], refused
    # The step was not applied: the run keeps its weights and trains on.
    out = run.forward([_datum([1, 2, 3])], "cross_entropy").result(timeout=60)
    assert np.isfinite(out.loss_fn_outputs[0]["logprobs"].tolist()).all()
    run.forward_backward([_datum([1, 2, 3])], "cross_entropy").result(timeout=60)
    applied = run.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
    assert math.isfinite(applied.metrics["grad_norm:mean"])
    reply = real["http"].post("/optim_step", json={"model_id": run.model_id, "adam_params": {"learning_rate": "NaN"}})
    assert reply.status_code in (400, 422), reply.text
    raw = json.dumps({"model_id": training.model_id, "adam_params": {"learning_rate": math.nan}})
    reply = real["http"].post("/optim_step", content=raw, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and "learning_rate" in reply.json()["detail"], reply.text


def _peak_growth_mib(action: Callable[[], Any]) -> float:
    """How far the process's peak RSS rose above its RSS during `action` (Linux: reset by clear_refs)."""

    def status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
        raise KeyError(field)

    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("peak RSS cannot be reset on this system")
    before = status("VmRSS:")
    action()
    return (status("VmHWM:") - before) / 1024


def _zstd_of_zeros(size: int) -> bytes:
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False) as writer:
        for _ in range(size // (1 << 20)):
            writer.write(bytes(1 << 20))
    return out.getvalue()


def test_small_bodies_cannot_allocate_much(real: dict[str, Any]) -> None:
    http, model_id = real["http"], real["training"].model_id
    bomb = _zstd_of_zeros(128 << 20)
    sparse = pb.ForwardBackwardRequest(model_id=model_id, seq_id=0, loss_fn="cross_entropy")
    datum = sparse.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(8, dtype=np.int32).tobytes()
    target = datum.loss_fn_inputs["target_tokens"]
    target.dtype, target.sparse_csr.crow_indices = pb.DTYPE_INT64, np.zeros(9, np.int64).tobytes()
    target.shape.extend([8, 131072])
    attacks = [
        ({**PROTO, "Content-Encoding": "zstd"}, bomb, 400),
        (PROTO, sparse.SerializeToString(), 400),
        (PROTO, proto_body(model_id, 0, [1] * 5000), 400),  # 5000 tokens over a 64-token context
    ]
    for headers, body, status in attacks:
        assert len(body) <= 64 << 10
        replies: list[httpx.Response] = []
        growth = _peak_growth_mib(lambda: replies.append(http.post("/forward_backward", content=body, headers=headers)))  # noqa: B023
        assert replies[0].status_code == status, replies[0].text
        assert growth < 64, f"peak memory rose {growth:.0f} MiB for a {len(body)}-byte body"
    huge = http.post("/forward_backward", content=bytes(80 << 20), headers=PROTO)
    assert huge.status_code == 413 and "limit" in huge.json()["detail"]


def test_bodies_of_many_empty_messages_are_refused_before_they_are_parsed(real: dict[str, Any]) -> None:
    """Parsing makes an object of each message: 6 MB of empty protobuf datums or of JSON `{}` took about
    200 MB before any limit saw them, and a 64 MiB body would take 1.8 GB. Both are counted first."""
    http, model_id = real["http"], real["training"].model_id
    datums = b"\x1a\x00" * 3_000_000
    objects = b"{}," * 2_000_000
    legacy = b'{"model_id": "%s", "forward_backward_input": {"data": [' % model_id.encode() + objects + b"{}]}}"
    attacks = [
        ("/forward_backward", PROTO, datums, 400, "more than"),
        ("/forward_backward", {**PROTO, "Content-Encoding": "zstd"}, zstandard.compress(datums), 400, "more than"),
        ("/create_session", {"Content-Type": "application/json"}, b"[" + objects + b"{}]", 413, "JSON objects"),
        ("/forward_backward", {"Content-Type": "application/json"}, legacy, 413, "JSON objects"),
        ("/forward_backward", {"Content-Type": "text/plain"}, legacy, 413, "JSON objects"),
    ]
    for route, headers, body, status, said in attacks:
        replies: list[httpx.Response] = []
        growth = _peak_growth_mib(lambda: replies.append(http.post(route, content=body, headers=headers)))  # noqa: B023
        assert replies[0].status_code == status and said in replies[0].text, (route, replies[0].text)
        assert growth < 64, f"peak memory rose {growth:.0f} MiB for {route}"
    _still_serves(real["training"])


def test_an_upload_chunk_of_brackets_is_data_not_json() -> None:
    """An upload's chunk is streamed to disk as bytes: its `{` and `[` (a safetensors header, or 1 byte in
    64 of random weights) are not counted; any other body's are."""

    async def app(scope: Any, receive: Any, send: Any) -> None:  # reads the body; any error is its 500
        status = 200
        try:
            while (await receive()).get("more_body"):
                pass
        except BodyTooLarge:
            status = 500
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    def status_of(method: str, path: str) -> int:
        sent: list[dict[str, Any]] = []
        bodies = iter([{"type": "http.request", "body": b"{" * 5000, "more_body": True}] * 3)

        async def receive() -> dict[str, Any]:
            return next(bodies, {"type": "http.request", "body": b"", "more_body": False})

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": method, "path": path, "headers": []}
        asyncio.run(BodyLimit(app, max_bytes=1 << 20, max_containers=10_000)(scope, receive, send))
        return int(sent[0]["status"])

    assert status_of("PUT", "/api/v1/uploads/m/files/model.safetensors") == 200
    assert status_of("POST", "/api/v1/create_session") == 413
    assert status_of("PUT", "/api/v1/training_runs/r/checkpoints/weights/c/ttl") == 413


def test_a_chunked_body_over_the_limit_is_413_on_every_route(real: dict[str, Any]) -> None:
    """A body without Content-Length is counted as it streams; past the limit, a route whose body FastAPI
    parses (create_session) answered 400 "There was an error parsing the body", naming no limit."""
    http = real["http"]

    def chunks() -> Iterator[bytes]:
        yield b'{"tags": ["'
        for _ in range(80):
            yield b"x" * (1 << 20)
        yield b'"]}'

    for route in ("/create_session", "/forward_backward"):
        reply = http.post(route, content=chunks(), headers={"Content-Type": "application/json"})
        assert reply.status_code == 413 and "larger than this server's limit" in reply.json()["detail"], route
    _still_serves(real["training"])


def test_many_bad_items_in_one_body_make_a_short_answer(real: dict[str, Any]) -> None:
    """Each bad item of an unbounded list or map was one error: a 600 KB body made a 37 MB 422, encoded on
    the event loop for 15 s while every other request waited. Lists and maps are bounded before their items
    are checked, and an answer shows ten errors at most."""
    http, model_id = real["http"], real["training"].model_id
    items = 100_000
    cases = [
        ("/save_weights_external", {"model_id": model_id, "path": "p", "age_encryption_recipients": [1] * items}),
        ("/create_model", {"base_model": real["info"].base_model, "user_metadata": {str(i): i for i in range(items)}}),
        ("/sessions/search", {"project_ids": [1] * items}),
        ("/sessions/search", {"user_metadata": {str(i): i for i in range(items)}}),
    ]
    for route, body in cases:
        reply = http.post(route, json=body)
        assert 400 <= reply.status_code < 500 and len(reply.content) < 8000, (
            route,
            reply.status_code,
            len(reply.content),
        )
    tags = http.post("/create_session", json={"tags": [1] * 60}).json()["detail"]  # 60 errors within the bound
    assert len(tags) == 11 and tags[-1]["msg"] == "and 50 more errors"
    _still_serves(real["training"])


def test_malformed_bodies_are_4xx_never_5xx(real: dict[str, Any]) -> None:
    http, model_id = real["http"], real["training"].model_id
    good = proto_body(model_id, 0, [1, 2, 3])
    cases = [
        (PROTO, b"\x0a\xff\xff\xff\xff\x0f"),  # a field length past the end
        ({"Content-Type": "application/json"}, good),  # protobuf sent as JSON
        (PROTO, json.dumps({"model_id": model_id}).encode()),  # JSON sent as protobuf
        ({**PROTO, "Content-Encoding": "zstd"}, b"not zstd"),
        ({**PROTO, "Content-Encoding": "br"}, good),
    ]
    bad_sparse = pb.ForwardBackwardRequest(model_id=model_id, seq_id=0, loss_fn="cross_entropy")
    datum = bad_sparse.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(3, dtype=np.int32).tobytes()
    weights = datum.loss_fn_inputs["weights"]
    weights.dtype, weights.sparse_csr.crow_indices = pb.DTYPE_FLOAT32, np.array([0, 5, 1, 2], np.int64).tobytes()
    weights.sparse_csr.col_indices = np.array([0, 1], np.int64).tobytes()
    weights.sparse_csr.values = np.ones(2, np.float32).tobytes()
    weights.shape.extend([3, 2])
    cases.append((PROTO, bad_sparse.SerializeToString()))
    for headers, body in cases:
        reply = http.post("/forward_backward", content=body, headers=headers)
        assert 400 <= reply.status_code < 500, (headers, body[:40], reply.status_code, reply.text)
    _still_serves(real["training"])


def test_engine_errors_do_not_show_server_paths(real: dict[str, Any]) -> None:
    import shutil

    training = real["training"]
    path = training.save_state("gone").result(timeout=60).path
    run_dir = Path(real["data_dir"]) / "checkpoints" / training.model_id.replace(":", "_")
    shutil.rmtree(run_dir / "weights" / "gone")
    service = tinker.ServiceClient(base_url=real["url"], api_key=KEY)
    real["services"].append(service)
    with pytest.raises(Exception) as failure:
        service.create_training_client_from_state(path).get_info()
    assert str(Path(real["data_dir"]).resolve()) not in str(failure.value)
    _still_serves(training)


def test_stored_session_text_is_strict_json_and_bounded(real: dict[str, Any]) -> None:
    """A NaN in user_metadata was stored, and every later read of the session failed to encode it (a 500 the
    SDK retried for good); a finish reason's text was stored at any length."""
    http = real["http"]
    nan = http.post(
        "/create_session", content=b'{"user_metadata": {"x": NaN}}', headers={"Content-Type": "application/json"}
    )
    assert nan.status_code == 422 and "NaN or an infinity" in nan.text and "user_metadata" in nan.text
    session = http.post("/create_session", json={"user_metadata": {"x": 1.5}}).json()["session_id"]
    assert http.get(f"/sessions/{session}").status_code == 200
    long = http.post(f"/sessions/{session}/finish", json={"reason": {"type": "x" * 257}})
    assert long.status_code == 422 and "reason" in long.text
    assert http.post(f"/sessions/{session}/finish", json={"reason": {"type": "x" * 256}}).status_code == 200


def test_a_download_path_with_a_nul_byte_is_not_found(real: dict[str, Any]) -> None:
    """`file_downloads/<token>/a%00b` reached `Path.resolve`, which raised on the NUL byte: a 500."""
    http, training = real["http"], real["training"]
    training.save_state("nul-probe").result(timeout=60)
    archive = http.get(f"/training_runs/{training.model_id}/checkpoints/weights/nul-probe/archive")
    token = archive.headers["location"].rstrip("/").split("/")[-1]
    assert archive.status_code == 302 and http.get(f"/file_downloads/{token}/run.json").status_code == 200
    for path in ("a%00b", "run.json%00", "state%2F..%2F..%2Frun.json"):
        reply = http.get(f"/file_downloads/{token}/{path}")
        assert reply.status_code == 404, (path, reply.status_code, reply.text)


def test_load_state_of_another_shape_is_refused_before_queueing(real: dict[str, Any]) -> None:
    """A rank-4 checkpoint into a rank-8 run failed only once the engine ran it; into a run that trains other
    modules the restore failed as a "damaged checkpoint", a server error. Both are the caller's mismatch."""
    training, service = real["training"], real["services"][0]
    path = training.save_state("shape-probe").result(timeout=60).path
    wider = service.create_lora_training_client(base_model=real["info"].base_model, rank=8, seed=0)
    with pytest.raises(tinker.BadRequestError, match="holds a rank-4 LoRA run .* is a rank-8 LoRA run"):
        wider.load_state(path).result(timeout=60)
    no_mlp = service.create_lora_training_client(base_model=real["info"].base_model, rank=4, train_mlp=False, seed=0)
    with pytest.raises(tinker.BadRequestError, match=r"is a rank-4 LoRA run \(train attn, unembed\)"):
        no_mlp.load_state(path).result(timeout=60)
    _still_serves(training)


def test_a_save_the_database_refuses_to_queue_leaves_the_old_checkpoint_listed(
    real: dict[str, Any], monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """overwrite: the old checkpoint is set aside, then the save is queued; the database refusing the
    queueing (a 503 the SDK retries) had left the old one unlisted and unloadable for good."""
    from sqlalchemy.exc import OperationalError

    training, http, db = real["training"], real["http"], real["db"]
    training.save_state("queued-over").result(timeout=60)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("INSERT", {}, Exception("database or disk is full"))

    monkeypatch.setattr(db.queue, "submit", refused)
    body = {"model_id": training.model_id, "path": "queued-over", "overwrite": True, "type": "save_weights"}
    assert http.post("/save_weights", json=body).status_code == 503
    monkeypatch.undo()
    listed = http.get(f"/training_runs/{training.model_id}/checkpoints").json()["checkpoints"]
    assert [c["checkpoint_id"] for c in listed].count("weights/queued-over") == 1
    training.load_state(f"tinker://{training.model_id}/weights/queued-over").result(timeout=60)


def test_a_named_sampler_save_the_database_refuses_to_queue_keeps_the_old_weights_sampling(
    real: dict[str, Any], monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A sampler save under a taken name sets the old checkpoint aside and replaces its snapshot row in the
    queueing transaction; the database refusing the queueing must leave the old weights sampling and the name
    free for the next save."""
    from sqlalchemy.exc import OperationalError

    training, http, db = real["training"], real["http"], real["db"]
    sampler = training.save_weights_and_get_sampling_client("sampled-over")
    prompt = tinker.ModelInput.from_ints([1, 2, 3])
    params = tinker.SamplingParams(max_tokens=2, temperature=0.0)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("INSERT", {}, Exception("database or disk is full"))

    monkeypatch.setattr(db.queue, "submit", refused)
    body = {"model_id": training.model_id, "path": "sampled-over", "type": "save_weights_for_sampler"}
    assert http.post("/save_weights_for_sampler", json=body).status_code == 503
    monkeypatch.undo()
    assert len(sampler.sample(prompt, 1, params).result(timeout=60).sequences[0].tokens) == 2
    again = training.save_weights_and_get_sampling_client("sampled-over")  # and the name still takes a save
    assert len(again.sample(prompt, 1, params).result(timeout=60).sequences[0].tokens) == 2
