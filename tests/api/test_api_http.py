"""Wire-level behaviour with plain httpx: dedupe, long-poll 408, auth, key isolation, encodings."""

from __future__ import annotations

import io
import json
import tarfile
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import zstandard
from sqlmodel import Session, select
from tinker.proto import tinker_public_pb2 as pb

from api.fake_runner import FakeRunner
from api.harness import KEY, MODEL, OTHER_KEY, PROTO, Server, proto_body, running_server
from tx.api.__main__ import recover
from tx.api.app import reap_sessions
from tx.db import open_database, owner_of
from tx.db.tables import SamplingSessionRow, SessionRow, utcnow
from tx.engine.restart import RestartGate
from tx.protocol import RequestError, SaveSamplerRequest


@pytest.fixture(scope="module")
def model_id(http: httpx.Client) -> str:
    session_id = http.post("/create_session", json={"tags": []}).json()["session_id"]
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL.base_model, "lora_config": {"rank": 4}}
    future = http.post("/create_model", json=body).json()
    assert wait(http, future["request_id"])["model_id"] == future["model_id"] == f"{session_id}:train:0"
    return str(future["model_id"])


def wait(http: httpx.Client, request_id: str, accept: str = "application/json") -> Any:
    for _ in range(20):
        reply = http.post("/retrieve_future", json={"request_id": request_id}, headers={"Accept": accept})
        if reply.status_code != 408:
            assert reply.status_code == 200, reply.text
            return reply.content if "protobuf" in reply.headers["content-type"] else reply.json()
    raise AssertionError("future never finished")


def test_client_config_and_health(http: httpx.Client) -> None:
    config = http.post("/client/config", json={"sdk_version": "0.38.0"}).json()
    assert config["proto_write_fwdbwd"] is True and config["create_model_via_load_weights"] is True
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.post("/telemetry", json={"events": []}).json() == {"status": "accepted"}


def test_seq_id_dedupe_returns_same_future(http: httpx.Client, model_id: str) -> None:
    body = proto_body(model_id, 101, [1, 2, 3])
    first = http.post("/forward_backward", content=body, headers=PROTO).json()
    second = http.post("/forward_backward", content=body, headers=PROTO).json()
    assert first["request_id"] == second["request_id"]
    other = http.post("/forward_backward", content=proto_body(model_id, 101, [4, 5, 6]), headers=PROTO)
    assert other.status_code == 400 and "seq_id 101 was already used" in other.json()["detail"]


def test_zstd_body_and_protobuf_result(http: httpx.Client, model_id: str) -> None:
    body = zstandard.ZstdCompressor().compress(proto_body(model_id, 102, [1, 2, 3, 4]))
    future = http.post("/forward_backward", content=body, headers={**PROTO, "Content-Encoding": "zstd"}).json()
    raw = wait(http, future["request_id"], accept="application/x-protobuf")
    output = pb.ForwardBackwardOutput.FromString(raw)
    assert output.loss_fn_outputs[0].num_datums == 1
    assert np.frombuffer(output.loss_fn_outputs[0].fields["logprobs"].offsets, np.int64).tolist() == [0, 16]


def test_json_forward_backward_and_json_result(http: httpx.Client, model_id: str) -> None:
    datum = {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64", "shape": [2]}},
    }
    body = {
        "model_id": model_id,
        "seq_id": 103,
        "forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"},
    }
    result = wait(http, http.post("/forward_backward", json=body).json()["request_id"])
    assert result["loss_fn_outputs"][0]["logprobs"]["shape"] == [2]
    assert result["metrics"]["loss:sum"] == pytest.approx(0.5)


def test_long_poll_408_then_result(http: httpx.Client, model_id: str, server: Server) -> None:
    server.runner.paused.set()
    try:
        future = http.post("/forward_backward", content=proto_body(model_id, 104, [1, 2]), headers=PROTO).json()
        start = time.monotonic()
        reply = http.post("/retrieve_future", json={"request_id": future["request_id"]})
        assert reply.status_code == 408 and reply.json()["queue_state"] == "active"
        assert 0.9 < time.monotonic() - start < 3.0
    finally:
        server.runner.paused.clear()
    assert "loss_fn_outputs" in wait(http, future["request_id"])
    again = http.post("/retrieve_future", json={"request_id": future["request_id"]})
    assert again.status_code == 200 and "loss_fn_outputs" in again.json()


def test_long_poll_wakes_immediately(http: httpx.Client, model_id: str) -> None:
    future = http.post("/forward_backward", content=proto_body(model_id, 105, [1, 2]), headers=PROTO).json()
    start = time.monotonic()
    wait(http, future["request_id"])
    assert time.monotonic() - start < 0.9  # the hold is 1 s: the completion ended the wait, not the hold


def test_failure_is_http_200_error_category(http: httpx.Client, model_id: str) -> None:
    future = http.post("/forward_backward", content=proto_body(model_id, 106, [998, 2]), headers=PROTO).json()
    assert wait(http, future["request_id"]) == {
        "error": "fake runner: token 998 is not allowed here",
        "category": "user",
    }


def test_auth(server: Server) -> None:
    url = server.url + "/api/v1/create_session"
    assert httpx.post(url, json={}).status_code == 401
    assert httpx.post(url, json={}, headers={"X-API-Key": "not-a-tinker-key"}).status_code == 401


def test_key_isolation(http: httpx.Client, model_id: str, server: Server) -> None:
    other = httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": OTHER_KEY})
    assert other.post("/get_info", json={"model_id": model_id}).status_code == 404
    reply = other.post("/forward_backward", content=proto_body(model_id, 1, [1, 2]), headers=PROTO)
    assert reply.status_code == 404 and "unknown model_id" in reply.json()["detail"]
    assert other.get(f"/training_runs/{model_id}").status_code == 404
    assert other.get("/training_runs").json()["training_runs"] == []
    future = http.post("/forward_backward", content=proto_body(model_id, 107, [1, 2]), headers=PROTO).json()
    assert other.post("/retrieve_future", json={"request_id": future["request_id"]}).status_code == 404


def test_unknown_future_is_404(http: httpx.Client) -> None:
    assert http.post("/retrieve_future", json={"request_id": "999999"}).status_code == 404


def test_checkpoint_archive_download(http: httpx.Client, model_id: str, server: Server) -> None:
    future = http.post("/save_weights", json={"model_id": model_id, "path": "arch", "seq_id": 108}).json()
    assert wait(http, future["request_id"])["path"] == f"tinker://{model_id}/weights/arch"
    reply = http.get(f"/training_runs/{model_id}/checkpoints/weights/arch/archive")
    assert reply.status_code == 302
    tar = httpx.get(reply.headers["location"])
    assert tar.status_code == 200 and int(tar.headers["content-length"]) == len(tar.content)
    with tarfile.open(fileobj=io.BytesIO(tar.content)) as archive:
        assert "adapter_config.json" in archive.getnames()
    dup = http.post("/save_weights", json={"model_id": model_id, "path": "arch", "seq_id": 109})
    assert dup.status_code == 400 and "already exists" in dup.json()["detail"]
    import shutil

    shutil.rmtree(server.data_dir / "checkpoints" / model_id.replace(":", "_") / "weights" / "arch")
    gone = httpx.get(reply.headers["location"])  # its files removed behind the server's back: a 404, not a 500
    assert gone.status_code == 404 and "files are gone" in gone.json()["detail"], gone.text


def test_the_reaper_drops_results_past_their_retention(
    http: httpx.Client, server: Server, model_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A day after a request finished its stored result goes (the database kept every result for good); a
    poll then reads a failure saying so, through the SDK's own error path."""
    from sqlalchemy import update

    from tx.api import app
    from tx.db.queue import RESULT_RETENTION_S
    from tx.db.tables import FutureRow

    ids = [http.post("/save_weights", json={"model_id": model_id, "path": f"kept-a-day-{i}"}).json()["request_id"]
           for i in range(3)]  # fmt: skip
    for request_id in ids:
        wait(http, request_id)
    with server.db.queue.write_lock.held(), server.db.engine.begin() as conn:
        long_ago = time.time() - RESULT_RETENTION_S - 60
        conn.execute(update(FutureRow).where(FutureRow.id.in_([int(i) for i in ids])).values(completed_at=long_ago))
    monkeypatch.setattr(app, "DROP_BATCH", 1)  # a busy server: more old results than one batch, all dropped
    reap_sessions(SimpleNamespace(db=server.db))  # type: ignore[arg-type]
    for request_id in ids:
        reply = http.post("/retrieve_future", json={"request_id": request_id}).json()
        assert reply["category"] == "user" and "is gone" in reply["error"], reply


def test_expired_session_unloads_runs_and_heartbeat_410(http: httpx.Client, server: Server) -> None:
    session_id = http.post("/create_session", json={}).json()["session_id"]
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL.base_model, "lora_config": {"rank": 4}}
    wait(http, http.post("/create_model", json=body).json()["request_id"])
    server.db.records._update(SessionRow, session_id, last_heartbeat_at=utcnow() - timedelta(hours=1))
    assert reap_sessions(SimpleNamespace(db=server.db)) == 1  # type: ignore[arg-type]
    assert http.post("/session_heartbeat", json={"session_id": session_id}).status_code == 410
    deadline = time.monotonic() + 5
    model_id = f"{session_id}:train:0"
    while server.db.records.get_run(model_id, owner_of(KEY)).status != "unloaded":  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    reply = http.post("/forward_backward", content=proto_body(model_id, 1, [1, 2]), headers=PROTO)
    assert reply.status_code == 400 and "unloaded" in reply.json()["detail"]


def test_a_run_of_an_expired_session_takes_no_new_work_before_the_reaper_unloads_it(
    http: httpx.Client, server: Server
) -> None:
    """Between a session's expiry (its heartbeats stopped) and the reaper's unload of its runs, new work on
    them was accepted and ran (600 queued forward_backwards of a dead client). It is refused, naming the
    session; a live session's run takes work."""
    session_id = http.post("/create_session", json={}).json()["session_id"]
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL.base_model, "lora_config": {"rank": 4}}
    model_id = wait(http, http.post("/create_model", json=body).json()["request_id"])["model_id"]
    fine = http.post("/forward_backward", content=proto_body(model_id, 1, [1, 2]), headers=PROTO)
    assert fine.status_code == 200, fine.text
    server.db.records._update(SessionRow, session_id, last_heartbeat_at=utcnow() - timedelta(hours=1))
    reply = http.post("/forward_backward", content=proto_body(model_id, 2, [1, 2]), headers=PROTO)
    assert reply.status_code == 400 and "has expired" in reply.json()["detail"], reply.text
    assert server.db.records.get_run(model_id, owner_of(KEY)).status == "ready"  # type: ignore[union-attr]
    assert reap_sessions(SimpleNamespace(db=server.db)) == 1  # type: ignore[arg-type]  # the reaper's turn


def test_reaper_unloads_runs_a_failed_finish_left_loaded(http: httpx.Client, server: Server) -> None:
    """The finish route marks the session finished, then queues unloads; when that queueing fails (the database
    went away), the retry finds the session finished and the reaper queues what is missing, once."""
    session_id = http.post("/create_session", json={}).json()["session_id"]
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL.base_model, "lora_config": {"rank": 4}}
    model_id = wait(http, http.post("/create_model", json=body).json()["request_id"])["model_id"]
    assert server.db.records.finish_session(session_id, owner_of(KEY), "x") is not None  # the unloads never queued
    assert http.post(f"/sessions/{session_id}/finish", json={"reason": {"type": "errored"}}).status_code == 200
    ctx = SimpleNamespace(db=server.db)
    assert reap_sessions(ctx) == 1  # type: ignore[arg-type]
    assert reap_sessions(ctx) == 0  # type: ignore[arg-type]  # queued once, however often it looks
    deadline = time.monotonic() + 5
    while server.db.records.get_run(model_id, owner_of(KEY)).status != "unloaded":  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_sdks_before_sessions_train_and_sample_without_ids(http: httpx.Client, server: Server) -> None:
    """tinker 0.1-0.2 send create_model without a session_id and asample with the weights' path instead of a
    sampling session: the run gets an `open` session that no missing heartbeat expires."""
    sessions = len(server.db.records.owner_sessions(owner_of(KEY)))
    for bad in ({"base_model": "no-such-model"}, {"base_model": MODEL.base_model, "lora_config": {"rank": -1}}):
        assert http.post("/create_model", json=bad).status_code in (400, 404)
    assert len(server.db.records.owner_sessions(owner_of(KEY))) == sessions  # refused before a session is made
    body = {"base_model": MODEL.base_model, "lora_config": {"rank": 4}}
    model_id = wait(http, http.post("/create_model", json=body).json()["request_id"])["model_id"]
    session_id = model_id.split(":train:")[0]
    server.db.records._update(SessionRow, session_id, last_heartbeat_at=utcnow() - timedelta(hours=1))
    assert reap_sessions(SimpleNamespace(db=server.db)) == 0  # type: ignore[arg-type]
    assert server.db.records.get_run(model_id, owner_of(KEY)).status == "ready"  # type: ignore[union-attr]
    assert "loss_fn_outputs" in wait(http, http.post("/forward_backward", content=proto_body(model_id, 0, [1, 2]),
                                                     headers=PROTO).json()["request_id"])  # fmt: skip
    path = wait(
        http, http.post("/save_weights_for_sampler", json={"model_id": model_id, "path": "s"}).json()["request_id"]
    )
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
    for weights in ({"model_path": path["path"]}, {"base_model": MODEL.base_model}, {"model_path": path["path"]}):
        sample = {"prompt": prompt, "sampling_params": {"max_tokens": 2}, **weights}
        assert len(wait(http, http.post("/asample", json=sample).json()["request_id"])["sequences"]) == 1
    samplers = {row.id for row in _samplers(server) if row.id.startswith("sessionless-")}
    assert len(samplers) == 2  # one per (owner, weights), reused
    reply = http.post("/asample", json={"prompt": prompt})
    assert reply.status_code == 400 and "model_path or base_model" in reply.json()["detail"]
    assert http.post(f"/sessions/{session_id}/finish", json={}).status_code == 200  # finishing it frees the run
    deadline = time.monotonic() + 5
    while server.db.records.get_run(model_id, owner_of(KEY)).status != "unloaded":  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _samplers(server: Server) -> list[SamplingSessionRow]:
    with Session(server.db.records.engine) as session:
        return list(session.exec(select(SamplingSessionRow)).all())


def test_another_keys_pending_future_is_404_at_once(
    http: httpx.Client, other: httpx.Client, model_id: str, server: Server
) -> None:
    """The owner check comes before the long poll: a stranger must not hold a connection (or learn that
    the future exists) by waiting on someone else's request."""
    server.runner.paused.set()
    try:
        future = http.post("/forward_backward", content=proto_body(model_id, 110, [1, 2]), headers=PROTO).json()
        start = time.monotonic()
        reply = other.post("/retrieve_future", json={"request_id": future["request_id"]})
        assert reply.status_code == 404
        assert time.monotonic() - start < 0.9  # the hold is 1 s: the 404 did not wait for it
        assert server.db.queue.get(future["request_id"]).status in ("pending", "running")
    finally:
        server.runner.paused.clear()
    assert "loss_fn_outputs" in wait(http, future["request_id"])


def test_max_runs_bounds_the_servers_live_runs_and_a_retry_is_not_a_new_run(tmp_path) -> None:
    from api.fake_runner import FakeRunner
    from api.harness import running_server

    with running_server(FakeRunner(), MODEL, tmp_path, max_runs=2) as (url, _db):
        client = httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": KEY}, timeout=30)
        other = httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": OTHER_KEY}, timeout=30)

        def create(http: httpx.Client, session_id: str, seq: int) -> httpx.Response:
            body = {"session_id": session_id, "model_seq_id": seq, "base_model": MODEL.base_model,
                    "lora_config": {"rank": 4}}  # fmt: skip
            return http.post("/create_model", json=body)

        mine = client.post("/create_session", json={"tags": []}).json()["session_id"]
        theirs = other.post("/create_session", json={"tags": []}).json()["session_id"]
        first = create(client, mine, 0).json()
        wait(client, first["request_id"])
        second = create(other, theirs, 0).json()  # another owner's run counts against the same server
        assert create(other, theirs, 0).json()["request_id"] == second["request_id"]  # a retry, not a third run
        refused = create(client, mine, 1)
        assert refused.status_code == 400 and "--max-runs 2" in refused.json()["detail"]
        wait(client, client.post("/unload_model", json={"model_id": first["model_id"]}).json()["request_id"])
        assert create(client, mine, 1).status_code == 200  # an unloaded run gives its place back


def test_one_key_holds_at_most_its_share_of_the_runs_with_or_without_a_session(tmp_path) -> None:
    """One key creating runs (through sessions, or without one: those never expire) took every --max-runs
    place, and every other key's create_model was refused until it unloaded. Its share is now
    --max-runs-per-key; a retry is not a new run, and another key still gets its runs."""
    from api.fake_runner import FakeRunner
    from api.harness import running_server

    with running_server(FakeRunner(), MODEL, tmp_path, max_runs=4, max_runs_per_key=2) as (url, _db):
        client = httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": KEY}, timeout=30)
        other = httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": OTHER_KEY}, timeout=30)
        body = {"base_model": MODEL.base_model, "lora_config": {"rank": 4}}
        mine = client.post("/create_session", json={"tags": []}).json()["session_id"]
        first = client.post("/create_model", json={**body, "session_id": mine, "model_seq_id": 0}).json()
        assert client.post("/create_model", json=body).status_code == 200  # sessionless: a second run
        again = client.post("/create_model", json={**body, "session_id": mine, "model_seq_id": 0}).json()
        assert again["request_id"] == first["request_id"]  # a retry of an accepted run
        for extra in ({**body, "session_id": mine, "model_seq_id": 1}, body):
            refused = client.post("/create_model", json=extra)
            assert refused.status_code == 400 and "--max-runs-per-key 2" in refused.json()["detail"], refused.text
        theirs = other.post("/create_session", json={"tags": []}).json()["session_id"]
        for seq in range(2):
            assert (
                other.post("/create_model", json={**body, "session_id": theirs, "model_seq_id": seq}).status_code == 200
            )
        wait(client, first["request_id"])
        wait(client, client.post("/unload_model", json={"model_id": first["model_id"]}).json()["request_id"])
        assert client.post("/create_model", json={**body, "session_id": mine, "model_seq_id": 1}).status_code == 200


def test_a_lora_sampler_save_on_a_one_slot_server_is_refused_before_queueing(tmp_path) -> None:
    """With --max-lora-adapters 1 a LoRA run's sampler copy can never have its own slot: the save is a
    400 naming the flag (it waited for a slot for good, and the run's later requests behind it), while an
    export, which takes no slot, is queued."""
    import dataclasses

    from api.fake_runner import FakeRunner
    from api.harness import running_server

    one_slot = dataclasses.replace(MODEL, max_lora_adapters=1)
    with running_server(FakeRunner(), one_slot, tmp_path) as (url, _db):
        client = httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": KEY}, timeout=30)
        session = client.post("/create_session", json={"tags": []}).json()["session_id"]
        body = {"session_id": session, "model_seq_id": 0, "base_model": MODEL.base_model, "lora_config": {"rank": 4}}
        made = client.post("/create_model", json=body).json()
        wait(client, made["request_id"])
        refused = client.post("/save_weights_for_sampler", json={"model_id": made["model_id"], "path": "s"})
        assert refused.status_code == 400 and "--max-lora-adapters 1" in refused.json()["detail"], refused.text
        seq = {"model_id": made["model_id"], "sampling_session_seq_id": 0}
        assert client.post("/save_weights_for_sampler", json=seq).status_code == 400
        export = client.post("/save_weights_external", json={"model_id": made["model_id"], "path": "e"})
        assert export.status_code == 200, export.text


def test_a_save_retried_while_its_first_attempt_was_queued_keeps_its_checkpoint(
    http: httpx.Client, server: Server, training, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The SDK resends a save with the same seq_id; the retry looked for the first attempt before it was
    committed, then found its pending row under the name and deleted it ("the newest wins"). The save
    then succeeded with a path that was neither listed nor loadable. A retry now leaves its own row."""
    body = {"model_id": training.model_id, "path": "retried", "seq_id": 90001, "overwrite": True}
    server.runner.paused.set()  # the first attempt stays queued
    try:
        first = http.post("/save_weights", json=body).json()["request_id"]
        real = server.db.queue.get_by_key
        monkeypatch.setattr(server.db.queue, "get_by_key", lambda key: None)  # its read raced the first commit
        retry = http.post("/save_weights", json=body).json()["request_id"]
        monkeypatch.setattr(server.db.queue, "get_by_key", real)
    finally:
        server.runner.paused.clear()
    assert retry == first
    saved = wait(http, first)["path"]
    listed = http.get(f"/training_runs/{training.model_id}/checkpoints").json()["checkpoints"]
    assert [c["tinker_path"] for c in listed].count(saved) == 1


def test_a_failed_save_over_a_taken_name_keeps_the_old_checkpoint(http: httpx.Client, training, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """save_weights with overwrite=True that fails (a full disk) leaves the checkpoint it would have replaced
    listed and loadable as before (its row was dropped when the save was accepted); one that succeeds
    replaces it, one entry for the name."""
    from api import fake_runner

    kept = training.save_state("overwritten").result(timeout=30).path
    save = fake_runner._save
    monkeypatch.setattr(fake_runner, "_save", lambda dest, path: RequestError("disk full", "server"))
    body = {"model_id": training.model_id, "path": "overwritten", "overwrite": True}
    failed = wait(http, http.post("/save_weights", json=body).json()["request_id"])
    assert "disk full" in json.dumps(failed)

    def listed() -> list[str]:
        checkpoints = http.get(f"/training_runs/{training.model_id}/checkpoints").json()["checkpoints"]
        return [c["tinker_path"] for c in checkpoints]

    assert listed().count(kept) == 1
    monkeypatch.setattr(fake_runner, "_save", save)
    assert wait(http, http.post("/save_weights", json=body).json()["request_id"])["path"] == kept
    assert listed().count(kept) == 1


def test_a_database_that_takes_no_writes_is_a_503_and_a_full_disk_a_507(
    http: httpx.Client, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk or a lost database is the server's state, not a bug: the SDK gets a status it retries and
    a detail saying why, never a 500 with a traceback; the server answers normally again afterwards."""
    import sqlite3

    from sqlalchemy.exc import OperationalError

    session_id = http.post("/create_session", json={}).json()["session_id"]
    heartbeat = server.db.records.heartbeat

    def full(*args: Any) -> str:
        raise OperationalError("UPDATE sessions ...", {}, sqlite3.OperationalError("database or disk is full"))

    monkeypatch.setattr(server.db.records, "heartbeat", full)
    reply = http.post("/session_heartbeat", json={"session_id": session_id})
    assert reply.status_code == 503 and "disk is full" in reply.json()["detail"] and "UPDATE" not in reply.text
    assert reply.headers["retry-after"] == "1"

    def no_space(*args: Any) -> str:
        raise OSError(28, "No space left on device", "/srv/data/smolgym.db")

    monkeypatch.setattr(server.db.records, "heartbeat", no_space)
    reply = http.post("/session_heartbeat", json={"session_id": session_id})
    assert reply.status_code == 507 and "disk is full" in reply.json()["detail"] and "/srv" not in reply.text
    monkeypatch.setattr(server.db.records, "heartbeat", heartbeat)
    assert http.post("/session_heartbeat", json={"session_id": session_id}).status_code == 200


def test_a_checkpoints_sampler_samples_only_while_the_checkpoint_exists(http: httpx.Client, model_id: str) -> None:
    """Deleted (or expired) checkpoint: its sampling session and a pre-session SDK's model_path sampler both
    answer 404 naming it, instead of sampling weights still cached in the engine (or failing there once
    evicted). A sampler seq id holds one sampler: reusing it for other weights is a 400, a retry is not."""
    saved = wait(http, http.post("/save_weights_for_sampler", json={"model_id": model_id, "path": "gone"}).json()[
        "request_id"])["path"]  # fmt: skip
    session_id = http.post("/create_session", json={}).json()["session_id"]
    create = {"session_id": session_id, "sampling_session_seq_id": 0, "model_path": saved}
    sampler = http.post("/create_sampling_session", json=create).json()["sampling_session_id"]
    assert http.post("/create_sampling_session", json=create).json()["sampling_session_id"] == sampler  # a retry
    reused = http.post("/create_sampling_session", json={**create, "model_path": None, "base_model": MODEL.base_model})
    assert reused.status_code == 400 and "sampling_session_seq_id 0 of this session already names" in reused.text
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
    requests = [{"sampling_session_id": sampler}, {"model_path": saved}]
    for weights in requests:
        sample = {"prompt": prompt, "sampling_params": {"max_tokens": 2}, **weights}
        assert len(wait(http, http.post("/asample", json=sample).json()["request_id"])["sequences"]) == 1
    run_id, checkpoint_id = saved.removeprefix("tinker://").split("/", 1)
    assert http.delete(f"/training_runs/{run_id}/checkpoints/{checkpoint_id}").status_code == 204
    for weights in requests:
        reply = http.post("/asample", json={"prompt": prompt, "sampling_params": {"max_tokens": 2}, **weights})
        assert reply.status_code == 404 and "was deleted or has expired" in reply.json()["detail"], reply.text


def test_a_checkpoint_being_overwritten_stays_readable_until_the_save_replaces_it(
    http: httpx.Client, server: Server, model_id: str
) -> None:
    """A save over a taken name sets the old checkpoint aside while it is queued and running. Every reader of
    the name then answered 404 (samplers pinned to `…/sampler_weights/latest` failed for good, the SDK does
    not retry a 404), though the old files were in place until the save swapped them. They read the old
    checkpoint until then."""
    body = {"model_id": model_id, "path": "latest"}
    saved = wait(http, http.post("/save_weights_for_sampler", json=body).json()["request_id"])["path"]
    run_id, checkpoint_id = saved.removeprefix("tinker://").split("/", 1)
    session_id = http.post("/create_session", json={}).json()["session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
    server.runner.paused.set()
    try:
        again = http.post("/save_weights_for_sampler", json=body).json()["request_id"]  # queued, not run
        create = {"session_id": session_id, "sampling_session_seq_id": 0, "model_path": saved}
        made = http.post("/create_sampling_session", json=create)
        assert made.status_code == 200, made.text
        samples = [
            http.post("/asample", json={"prompt": prompt, "sampling_params": {"max_tokens": 2}, **weights})
            for weights in ({"model_path": saved}, {"sampling_session_id": made.json()["sampling_session_id"]})
        ]
        assert [reply.status_code for reply in samples] == [200, 200], [reply.text for reply in samples]
        assert http.post("/weights_info", json={"tinker_path": saved}).status_code == 200
        archive = http.get(f"/training_runs/{run_id}/checkpoints/{checkpoint_id}/archive", follow_redirects=False)
        assert archive.status_code == 302, archive.text
    finally:
        server.runner.paused.clear()
    assert wait(http, again)["path"] == saved
    for reply in samples:
        assert len(wait(http, reply.json()["request_id"])["sequences"]) == 1


def test_a_training_state_is_not_a_sampler(http: httpx.Client, model_id: str) -> None:
    """A `weights/` path holds a training state the engine cannot sample from: refused when the sampler is
    made (each sample failed later, saying the weights were "not saved, or evicted")."""
    state = wait(http, http.post("/save_weights", json={"model_id": model_id, "path": "state-only"}).json()[
        "request_id"])["path"]  # fmt: skip
    session_id = http.post("/create_session", json={}).json()["session_id"]
    create = {"session_id": session_id, "sampling_session_seq_id": 0, "model_path": state}
    reply = http.post("/create_sampling_session", json=create)
    assert reply.status_code == 400 and "is a training state" in reply.json()["detail"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
    reply = http.post("/asample", json={"prompt": prompt, "sampling_params": {"max_tokens": 2}, "model_path": state})
    assert reply.status_code == 400 and "save_weights_for_sampler" in reply.json()["detail"]


def test_creates_racing_each_other_stay_within_the_share(tmp_path) -> None:
    """Each create counted the live runs, then inserted its own in another transaction: eight at once all
    found room, and one key held six runs on a share of two. Counting and inserting are one step now."""
    from concurrent.futures import ThreadPoolExecutor

    from api.fake_runner import FakeRunner
    from api.harness import running_server

    with running_server(FakeRunner(), MODEL, tmp_path, max_runs=16, max_runs_per_key=2) as (url, _db):
        client = httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": KEY}, timeout=30)
        session = client.post("/create_session", json={"tags": []}).json()["session_id"]
        body = {"base_model": MODEL.base_model, "lora_config": {"rank": 4}, "session_id": session}

        def create(seq: int) -> int:
            return client.post("/create_model", json={**body, "model_seq_id": seq}).status_code

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(create, range(8)))
        assert sorted(codes) == [200, 200] + [400] * 6, codes


class _FailingInflightSaves(FakeRunner):
    """Fails the inflight saves of the sampling sessions it is told (as a device out of memory would)."""

    def __init__(self, failing: set[str]) -> None:
        super().__init__()
        self.failing = failing

    def _run(self, item):  # type: ignore[no-untyped-def]
        p = item.payload
        if isinstance(p, SaveSamplerRequest) and p.kind == "inflight" and p.answer_session in self.failing:
            return RequestError("out of memory for the copy", "server")
        return super()._run(item)


def test_each_inflight_client_is_refused_only_for_its_own_failed_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Inflight saves 1 and 3 of a run fail, 2 succeeds: the shared snapshot row, linked to each save in turn,
    had been marked failed by save 3 (refusing client 2), and linked to the first save alone it refused
    client 2 from the start. Each client now answers for its own save."""
    runner = _FailingInflightSaves(set())
    with running_server(runner, MODEL, tmp_path) as (url, _):
        http = httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": KEY}, timeout=30)
        session_id = http.post("/create_session", json={}).json()["session_id"]
        body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL.base_model, "lora_config": {"rank": 4}}
        model_id = wait(http, http.post("/create_model", json=body).json()["request_id"])["model_id"]
        runner.failing = {f"{session_id}:sample:1", f"{session_id}:sample:3"}
        runner.paused.set()  # all three queued before the first runs
        saves = [
            http.post("/save_weights_for_sampler", json={"model_id": model_id, "sampling_session_seq_id": n,
                                                         "kind": "inflight"}).json()["request_id"]
            for n in (1, 2, 3)
        ]  # fmt: skip
        runner.paused.clear()
        assert ["error" in wait(http, request_id) for request_id in saves] == [True, False, True]

        def sample(n: int) -> httpx.Response:
            prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
            return http.post("/asample", json={"sampling_session_id": f"{session_id}:sample:{n}", "prompt": prompt,
                                               "num_samples": 1, "sampling_params": {"max_tokens": 2}})  # fmt: skip

        assert sample(2).status_code == 200, sample(2).text
        for failed in (1, 3):
            assert sample(failed).status_code == 400 and "failed" in sample(failed).json()["detail"]


def test_an_ended_sessions_run_can_still_be_unloaded(http: httpx.Client, server: Server) -> None:
    """New work on a run of an expired session is refused, but an unload is what the reaper would queue: it is
    taken (it had been refused along with the work)."""
    session_id = http.post("/create_session", json={}).json()["session_id"]
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL.base_model, "lora_config": {"rank": 4}}
    model_id = wait(http, http.post("/create_model", json=body).json()["request_id"])["model_id"]
    server.db.records._update(SessionRow, session_id, last_heartbeat_at=utcnow() - timedelta(hours=1))
    assert http.post("/unload_model", json={"model_id": model_id}).status_code == 200
    assert reap_sessions(SimpleNamespace(db=server.db)) == 0  # type: ignore[arg-type]  # its unload is queued


def test_an_inflight_client_after_a_restart_is_told_its_weights_were_lost(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A restart loses ephemeral snapshots, and their samples are failed saying so. An inflight client reads
    the run's shared snapshot, which the restart's list had lost track of: its sample went on to the engine and
    failed as "not available (not saved, or evicted)", loading the model first if need be."""
    with running_server(FakeRunner(), MODEL, tmp_path) as (url, _):
        http = httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": KEY}, timeout=30)
        session_id = http.post("/create_session", json={}).json()["session_id"]
        body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL.base_model, "lora_config": {"rank": 4}}
        model_id = wait(http, http.post("/create_model", json=body).json()["request_id"])["model_id"]
        for n, kind in ((1, "snapshot"), (2, "inflight")):
            body = {"model_id": model_id, "sampling_session_seq_id": n, "kind": kind}
            assert "error" not in wait(http, http.post("/save_weights_for_sampler", json=body).json()["request_id"])
    lost = recover(open_database(None, tmp_path), tmp_path)
    with running_server(RestartGate(FakeRunner(), lost), MODEL, tmp_path) as (url, _):
        http = httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": KEY}, timeout=30)
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
        for n in (1, 2):
            reply = http.post("/asample", json={"sampling_session_id": f"{session_id}:sample:{n}", "prompt": prompt,
                                                "num_samples": 1, "sampling_params": {"max_tokens": 2}})  # fmt: skip
            outcome = wait(http, reply.json()["request_id"]) if reply.status_code == 200 else reply.text
            assert "lived in memory only" in str(outcome), (n, outcome)
