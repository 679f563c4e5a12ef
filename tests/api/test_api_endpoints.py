"""The less central §9.1 endpoints: external-weights export + download URLs, session finish freeing
runs, session project/trace, API-key identity, audit and billing stubs; each scoped to the caller's key."""

from __future__ import annotations

import time
import urllib.request

import httpx
import pytest
import tinker

from api.harness import KEY, MODEL, OTHER_KEY, PROTO, Server, proto_body
from tx.db import owner_of


def test_flag_gated_endpoints_stay_off(http: httpx.Client) -> None:
    config = http.post("/client/config", json={"sdk_version": "0.38.0"}).json()
    for flag in ("sample_use_retrieve_futures", "custom_loss_server_side", "sample_join_sampling_session"):
        assert config[flag] is False
    assert config["pjwt_auth_enabled"] is False  # no /auth/token
    assert http.post("/client/dynamic_config", json={}).status_code == 404  # defaults: no cancel_future


def test_save_weights_external_and_download_urls(training, rest: tinker.RestClient, other: httpx.Client) -> None:
    path = training.save_weights_external("export", ttl_seconds=3600).result().path
    assert path == f"tinker://{training.model_id}/external_weights/export"
    ids = {c.checkpoint_id: c.checkpoint_type for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert ids["external_weights/export"] == "external"
    response = rest.get_external_weights_urls(path).result()
    assert set(response.urls) == {"adapter_config.json"}
    with urllib.request.urlopen(response.urls["adapter_config.json"]) as reply:  # unauthenticated, like the CLI
        assert reply.read() == b'{"r": 8}'
    rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result()
    cid = f"/training_runs/{training.model_id}/checkpoints/external_weights/export/external_weights_urls"
    assert other.get(cid).status_code == 404
    assert httpx.get(response.urls["adapter_config.json"].replace("adapter_config.json", "../../x")).status_code == 404
    rest.delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(path).result()


def test_sdks_before_0_28_are_not_listed_external_checkpoints(training, http: httpx.Client) -> None:
    """Their listing schema knows "training" and "sampler" only: one "external" entry failed the validation of
    the whole list (tinker 0.3-0.27), so once a newer SDK had exported with the same key, no checkpoint of it
    could be listed."""
    training.save_weights_external("for-new-sdks").result()
    training.save_state("for-every-sdk").result()
    for sdk, external in (("0.22.7", False), ("0.27.1", False), ("0.28.0", True), ("0.38.0", True), (None, True)):
        headers = {"X-Stainless-Package-Version": sdk} if sdk else {}
        for route in (f"/training_runs/{training.model_id}/checkpoints", "/checkpoints"):
            listed = http.get(route, headers=headers).json()
            types = {c["checkpoint_type"] for c in listed["checkpoints"]}
            assert "training" in types and ("external" in types) == external, (sdk, route)
            assert listed["cursor"]["total_count"] == len(listed["checkpoints"]) or route == "/checkpoints"


def test_external_weights_urls_rejects_other_kinds(training, http: httpx.Client) -> None:
    training.save_state("not-external").result()
    reply = http.get(f"/training_runs/{training.model_id}/checkpoints/weights/not-external/external_weights_urls")
    assert reply.status_code == 400 and "not an external weights checkpoint" in reply.json()["detail"]


def test_save_weights_external_refuses_encryption(training, http: httpx.Client) -> None:
    body = {"model_id": training.model_id, "path": "enc", "age_encryption_recipients": ["age1xyz"]}
    reply = http.post("/save_weights_external", json=body)
    assert reply.status_code == 400 and "encrypt" in reply.json()["detail"]


def test_finish_session_unloads_its_runs(http: httpx.Client, other: httpx.Client, server: Server) -> None:
    session_id = http.post("/create_session", json={}).json()["session_id"]
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL.base_model, "lora_config": {"rank": 4}}
    future = http.post("/create_model", json=body).json()
    model_id = future["model_id"]
    deadline = time.monotonic() + 10
    while server.db.records.get_run(model_id, owner_of(KEY)).status != "ready":  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    finish = {"reason": {"type": "success"}}
    assert other.post(f"/sessions/{session_id}/finish", json=finish).status_code == 404
    assert http.post(f"/sessions/{session_id}/finish", json=finish).status_code == 200
    while server.db.records.get_run(model_id, owner_of(KEY)).status != "unloaded":  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert len([i for i in server.runner.seen if i.kind == "unload_model" and i.model_id == model_id]) == 1
    reply = http.post("/forward_backward", content=proto_body(model_id, 1, [1, 2]), headers=PROTO)
    assert reply.status_code == 400 and "session finished" in reply.json()["detail"]
    # finishing again is accepted (first reason wins) and queues nothing more
    assert http.post(f"/sessions/{session_id}/finish", json={"reason": {"type": "errored"}}).status_code == 200
    assert len([i for i in server.runner.seen if i.kind == "unload_model" and i.model_id == model_id]) == 1
    assert http.post("/session_heartbeat", json={"session_id": session_id}).status_code == 410


def test_a_finish_reason_cannot_forge_log_lines(http: httpx.Client, server: Server, caplog) -> None:  # type: ignore[no-untyped-def]
    """The reason is the caller's text, logged with the unload it causes: a newline in it wrote a line of
    its own into the server's log."""
    session_id = http.post("/create_session", json={}).json()["session_id"]
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL.base_model, "lora_config": {"rank": 4}}
    model_id = http.post("/create_model", json=body).json()["model_id"]
    deadline = time.monotonic() + 10
    while server.db.records.get_run(model_id, owner_of(KEY)).status != "ready":  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    forged = {"reason": {"type": "done\nINFO tx.api: forged"}}
    with caplog.at_level("INFO", logger="tx.api"):
        assert http.post(f"/sessions/{session_id}/finish", json=forged).status_code == 200
    unloads = [r.getMessage() for r in caplog.records if "unloading" in r.getMessage()]
    assert unloads and all("\n" not in line for line in unloads), unloads


def test_with_block_frees_the_adapter(server: Server) -> None:
    with tinker.ServiceClient(base_url=server.url, api_key=KEY) as client:
        model_id = client.create_lora_training_client(base_model=MODEL.base_model, rank=4, seed=0).result().model_id
    deadline = time.monotonic() + 10
    while server.db.records.get_run(model_id, owner_of(KEY)).status != "unloaded":  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_session_project_and_trace(service: tinker.ServiceClient, rest: tinker.RestClient, other: httpx.Client) -> None:
    session_id = service.holder.get_session_id()
    rest.assign_session_project(session_id, "proj-1").result()
    assert other.put(f"/sessions/{session_id}/project", json={"project_id": "p"}).status_code == 404
    with pytest.raises(Exception, match="does not record session traces"):
        rest.export_session_trace(session_id).result()
    assert other.get(f"/sessions/{session_id}/trace_export").status_code == 404


def test_apikey_me(http: httpx.Client, server: Server) -> None:
    from tinker.cli.auth_api import TinkerAuthApi

    with httpx.Client() as client:
        api = TinkerAuthApi(client, base_url=server.url)
        me = api.get_self_api_key(KEY)
        assert me.key_id > 0 and me.name
        assert api.get_self_api_key(OTHER_KEY).key_id != me.key_id
        api.delete_self_api_key(KEY)
    assert httpx.get(server.url + "/api/v1/auth/apikey/me", headers={"X-API-Key": "nope"}).status_code == 401


def test_audit_and_billing(server: Server, training) -> None:
    rest = tinker.AdminClient(base_url=server.url, api_key=KEY)
    assert rest.get_audit_log().result().entries == []
    training.save_state("billed").result(timeout=30)  # whatever ran before in this process, one is listed
    usage = rest.get_current_checkpoint_storage_usage().result()
    assert usage.data[0].checkpoint_count >= 1
    from datetime import UTC, datetime, timedelta

    now = datetime.now(UTC)
    assert rest.get_billing_usage(now - timedelta(days=1), now).result().data == []
