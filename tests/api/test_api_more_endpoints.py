"""copy_weights (checkpoint copy into a new, untrainable run) and sessions/search (filters, cursor pages),
each scoped to the caller's key; real SDK calls where it has a method, raw httpx for error cases."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from api.harness import KEY, OTHER_KEY, Server
from tx.db import owner_of
from tx.db.tables import TrainingRunRow


@pytest.fixture(scope="module")
def source(training) -> str:
    return training.save_state("copy-src").result().path


def _assert_400(reply: httpx.Response, *fragments: str) -> None:
    assert reply.status_code == 400, reply.text
    for fragment in fragments:
        assert fragment in reply.json()["detail"], reply.text


# ---- copy_weights --------------------------------------------------------------------------------


def test_copy_weights_with_the_sdk(source: str, rest: tinker.RestClient, server: Server, training) -> None:
    copied = rest.copy_weights(source, "proj-archive").result()
    assert copied.startswith("tinker://copy-") and copied.endswith(":train:0/weights/copy-src")
    run_id = copied.removeprefix("tinker://").split("/")[0]
    [checkpoint] = rest.list_checkpoints(run_id).result().checkpoints
    assert (checkpoint.checkpoint_id, checkpoint.checkpoint_type, checkpoint.tinker_path) == (
        "weights/copy-src",
        "training",
        copied,
    )
    info = rest.get_weights_info_by_tinker_path(copied).result()
    assert info.is_lora and info.lora_rank == 8
    files = list((server.data_dir / "checkpoints" / run_id.replace(":", "_") / "weights" / "copy-src").iterdir())
    assert [f.name for f in files] == ["adapter_config.json"]
    assert not [p for p in Path(files[0].parent.parent).iterdir() if p.name.startswith(".")]  # no temp dir left
    assert rest.get_training_run(run_id).result().base_model == info.base_model
    # The source is untouched and a second copy is a different run.
    assert rest.copy_weights(source, "proj-archive").result() != copied
    assert {c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints} >= {source}


def test_copy_is_untrainable_but_loadable(source: str, http: httpx.Client, service) -> None:
    copied = http.post("/copy_weights", json={"source_path": source, "destination_project_id": "p"}).json()
    run_id = copied["tinker_path"].removeprefix("tinker://").split("/")[0]
    _assert_400(http.post("/save_weights", json={"model_id": run_id, "path": "x"}), "unloaded")
    client = service.create_training_client_from_state(copied["tinker_path"]).result()
    assert client.save_state("from-copy").result().path == f"tinker://{client.model_id}/weights/from-copy"


def test_copy_retries_with_one_idempotency_key_make_one_copy(source: str, http: httpx.Client) -> None:
    body = {"source_path": source, "destination_project_id": "p", "ttl_seconds": 7200}
    headers = {"X-Idempotency-Key": str(uuid.uuid4())}
    first = http.post("/copy_weights", json=body, headers=headers)
    again = http.post("/copy_weights", json=body, headers=headers)
    assert first.status_code == again.status_code == 200, again.text
    assert first.json() == again.json()
    other_key = http.post("/copy_weights", json=body, headers={"X-Idempotency-Key": str(uuid.uuid4())})
    assert other_key.json()["tinker_path"] != first.json()["tinker_path"]
    run_id = first.json()["tinker_path"].removeprefix("tinker://").split("/")[0]
    [checkpoint] = http.get(f"/training_runs/{run_id}/checkpoints").json()["checkpoints"]
    assert checkpoint["expires_at"] is not None


def test_copy_into_a_session_slot(source: str, http: httpx.Client, training) -> None:
    session_id = http.post("/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    body = {"source_path": source, "session_id": session_id, "model_seq_id": 7}
    reply = http.post("/copy_weights", json=body)
    assert reply.json() == {"tinker_path": f"tinker://{session_id}:train:7/weights/copy-src"}
    assert http.post("/copy_weights", json=body).json() == reply.json()  # a retry finds the copy
    assert f"{session_id}:train:7" in http.get(f"/sessions/{session_id}").json()["training_run_ids"]
    other_source = training.save_state("copy-src-2").result().path
    _assert_400(http.post("/copy_weights", json={**body, "source_path": other_source}), "already exists")
    _assert_400(http.post("/copy_weights", json={"source_path": source, "session_id": session_id}), "model_seq_id")
    missing = http.post("/copy_weights", json={**body, "session_id": "no-such-session"})
    assert missing.status_code == 404


def test_a_copy_into_a_trained_runs_slot_is_refused_after_a_restart(
    source: str, http: httpx.Client, server: Server, training
) -> None:
    """After a restart every run is `unloaded`, as a copy's run is: a copy into the slot of the run that saved
    `copy-src` answered with that run's own checkpoint as if it had copied the source there."""
    run = server.db.records.get_run(training.model_id, owner_of(KEY))
    assert run is not None
    session_id, seq = training.model_id.rsplit(":train:", 1)
    body = {"source_path": source, "session_id": session_id, "model_seq_id": int(seq)}
    server.db.records._update(TrainingRunRow, run.id, status="unloaded")
    try:
        _assert_400(http.post("/copy_weights", json=body), "already exists")
    finally:
        server.db.records._update(TrainingRunRow, run.id, status=run.status)


def test_copies_run_two_at_a_time_on_threads_of_their_own(
    source: str, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy is a whole checkpoint directory (GBs). It ran on the threads every sync route shares (forty):
    a tenant's forty copies at once held heartbeats and saves back until sessions expired. Copies now run on
    two threads of their own, and wait there for one another."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tx.api import routes_copy

    running, seen, lock = [0], [], threading.Lock()
    copy_tree = routes_copy._copy_tree

    def slow_copy(*args: object) -> None:
        with lock:
            running[0] += 1
            seen.append((threading.current_thread().name, running[0]))
        time.sleep(0.1)
        with lock:
            running[0] -= 1
        copy_tree(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(routes_copy, "_copy_tree", slow_copy)
    body = {"source_path": source, "destination_project_id": "p"}

    def copy(_: int) -> int:
        return http.post("/copy_weights", json=body, headers={"X-Idempotency-Key": str(uuid.uuid4())}).status_code

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(copy, range(6))) == [200] * 6
    assert len(seen) == 6 and all(name.startswith("tx-copy") for name, _ in seen), seen
    assert max(count for _, count in seen) <= 2


def test_copy_errors(source: str, http: httpx.Client, other: httpx.Client, rest: tinker.RestClient) -> None:
    project = {"destination_project_id": "p"}
    assert other.post("/copy_weights", json={"source_path": source, **project}).status_code == 404
    unknown = source.replace("copy-src", "never-saved")
    assert http.post("/copy_weights", json={"source_path": unknown, **project}).status_code == 404
    with pytest.raises(tinker.NotFoundError):
        rest.copy_weights(unknown, "p").result()
    _assert_400(http.post("/copy_weights", json=project), "source_path", "Field required")
    _assert_400(http.post("/copy_weights", json={"source_path": 5, **project}), "source_path")
    _assert_400(http.post("/copy_weights", json={"source_path": "tinker://x", **project}), "not a checkpoint path")
    _assert_400(http.post("/copy_weights", json={"source_path": source}), "destination_project_id")
    _assert_400(http.post("/copy_weights", json={"source_path": source, **project, "ttl_seconds": 5}), "ttl_seconds")
    token = {"X-Tinker-Weights-Access-Token": "secret"}
    _assert_400(http.post("/copy_weights", json={"source_path": source, **project}, headers=token), "access_token")
    _assert_400(http.post("/copy_weights", json=[1]), "JSON object")


# ---- sessions/search ---------------------------------------------------------------------------


def _create(http: httpx.Client, meta: dict[str, str]) -> str:
    reply = http.post("/create_session", json={"tags": [], "user_metadata": meta, "sdk_version": "0.38.0"})
    return str(reply.json()["session_id"])


@pytest.mark.filterwarnings("ignore::tinker.lib.public_interfaces.rest_client.ExperimentalWarning")
def test_search_sessions_with_the_sdk(http: httpx.Client, rest: tinker.RestClient, training, source: str) -> None:
    tag = uuid.uuid4().hex
    ids = [_create(http, {"search": tag, "n": str(n)}) for n in range(3)]
    http.post(f"/sessions/{ids[0]}/finish", json={"reason": {"type": "errored"}})
    request = types.SessionSearchRequest(user_metadata={"search": tag}, limit=2)
    first = rest.search_sessions(request).result()
    assert [s.session_id for s in first.sessions] == ids[::-1][:2]  # newest first
    assert first.next_cursor is not None
    second = rest.search_sessions(request.model_copy(update={"cursor": first.next_cursor})).result()
    assert [s.session_id for s in second.sessions] == [ids[0]] and second.next_cursor is None
    finished = second.sessions[0]
    assert finished.status is not None and finished.status.type == "client_finished"
    assert finished.owner == owner_of(KEY) and finished.user_metadata == {"search": tag, "n": "0"}
    assert first.sessions[0].status is not None and first.sessions[0].status.type == "active"

    active = types.SessionSearchRequest(user_metadata={"search": tag}, statuses=[types.ActiveSessionStatusQuery()])
    assert [s.session_id for s in rest.search_sessions(active).result().sessions] == ids[::-1][:2]
    errored = types.ClientFinishedSessionStatusQuery(reasons=["errored"])
    success = types.ClientFinishedSessionStatusQuery(reasons=["success"])
    for query, expected in ((errored, [ids[0]]), (success, []), (types.FailedSessionStatusQuery(), [])):
        found = rest.search_sessions(types.SessionSearchRequest(user_metadata={"search": tag}, statuses=[query]))
        assert [s.session_id for s in found.result().sessions] == expected

    session_id = training.model_id.split(":train:")[0]
    [mine] = rest.search_sessions(types.SessionSearchRequest(session_id=session_id)).result().sessions
    assert mine.checkpoints_count >= 1 and (mine.checkpoint_storage_bytes or 0) >= 8


def test_search_pages_through_sessions_read_a_batch_at_a_time(
    http: httpx.Client, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database is read 4 sessions at a time (the route's batch, made small), never the owner's whole
    history: a filter matching every third of 30 sessions, paged 3 at a time, returns each match once,
    newest first, across the batches, and the last page has no cursor."""
    from tx.api import routes_search

    monkeypatch.setattr(routes_search, "SCAN_BATCH", 4)
    read, owner_sessions = [], server.db.records.owner_sessions

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        rows = owner_sessions(*args, **kwargs)
        read.append(len(rows))
        return rows

    monkeypatch.setattr(server.db.records, "owner_sessions", counted)
    tag = uuid.uuid4().hex
    ids = [_create(http, {"batch": tag if n % 3 == 0 else "other"}) for n in range(30)]
    found, body = [], {"user_metadata": {"batch": tag}, "limit": 3}
    for _ in range(10):
        reply = http.post("/sessions/search", json=body).json()
        found += [s["session_id"] for s in reply["sessions"]]
        if reply["next_cursor"] is None:
            break
        body = {**body, "cursor": reply["next_cursor"]}
    assert found == [ids[n] for n in range(27, -1, -3)]
    assert max(read) == 4 and sum(read) < 2 * len(ids) + 8 * len(read), read
    assert reply["next_cursor"] is None
    one = http.post("/sessions/search", json={"session_id": ids[5], "limit": 1}).json()
    assert [s["session_id"] for s in one["sessions"]] == [ids[5]] and one["next_cursor"] is None


def test_search_sessions_scope_and_errors(http: httpx.Client, other: httpx.Client) -> None:
    tag = uuid.uuid4().hex
    session_id = _create(http, {"scope": tag})
    body = {"user_metadata": {"scope": tag}}
    assert other.post("/sessions/search", json=body).json()["sessions"] == []
    assert other.post("/sessions/search", json={"session_id": session_id}).json()["sessions"] == []
    found = http.post("/sessions/search", json={**body, "owner": {"type": "accessible"}}).json()
    assert [s["session_id"] for s in found["sessions"]] == [session_id]
    as_user = {**body, "owner": {"type": "user", "owner_urns": [owner_of(KEY)]}}
    assert len(http.post("/sessions/search", json=as_user).json()["sessions"]) == 1
    as_other = {**body, "owner": {"type": "user", "owner_urns": [owner_of(OTHER_KEY)]}}
    assert http.post("/sessions/search", json=as_other).json() == {"sessions": [], "next_cursor": None}
    _assert_400(http.post("/sessions/search", json={"project_ids": ["p"]}), "project_ids", "no projects")
    _assert_400(http.post("/sessions/search", json={"display_name": "x"}), "display_name")
    _assert_400(http.post("/sessions/search", json={"limit": 0}), "limit")
    _assert_400(http.post("/sessions/search", json={"statuses": [{"type": "paused"}]}), "statuses.0")
    naive = {"cursor": {"last_created_at": "2026-01-01T00:00:00", "last_session_id": "x"}}
    _assert_400(http.post("/sessions/search", json=naive), "cursor.last_created_at")
    for edge in ("0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00"):  # outside datetime's range in UTC
        cursor = {"cursor": {"last_created_at": edge, "last_session_id": "x"}}
        _assert_400(http.post("/sessions/search", json=cursor), "cursor.last_created_at", "outside the datetime range")


# ---- bodies that once answered 500 ---------------------------------------------------------------


def test_a_checkpoint_ttl_is_one_hour_to_ten_years_or_none(source: str, http: httpx.Client) -> None:
    run_id, checkpoint_id = source.removeprefix("tinker://").split("/", 1)
    url = f"/training_runs/{run_id}/checkpoints/{checkpoint_id}/ttl"
    for bad in (10**14, -1, 0, 3599, 10 * 365 * 86400 + 1):  # 10^14 overflowed datetime; -1 expired it at once
        _assert_400(http.put(url, json={"ttl_seconds": bad}), f"ttl_seconds {bad} is outside [3600, 315360000]")
    for good in (3600, 10 * 365 * 86400, None):
        assert http.put(url, json={"ttl_seconds": good}).status_code == 204
    listed = http.get(f"/training_runs/{run_id}/checkpoints").json()["checkpoints"]
    assert [c["expires_at"] for c in listed if c["tinker_path"] == source] == [None]


def test_json_forward_bodies_out_of_range_are_400s(training, http: httpx.Client) -> None:
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
             "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64", "shape": [2]}}}  # fmt: skip
    body = {"model_id": training.model_id, "forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"}}
    huge_int = b'{"model_id": "m", "seq_id": 1' + b"0" * 5000 + b"}"  # past Python's 4300-digit int parsing
    deep = b"[" * 100_000 + b"]" * 100_000
    for raw in (huge_int, deep):
        reply = http.post("/forward_backward", content=raw, headers={"content-type": "application/json"})
        _assert_400(reply, "body is not valid JSON")
    for seq_id in (1 << 64, -(1 << 63) - 1, "7", True, 1.5):
        _assert_400(http.post("/forward_backward", json={**body, "seq_id": seq_id}), "seq_id must be a 64-bit integer")
    ppo = {**body["forward_backward_input"], "loss_fn": "ppo", "loss_fn_config": {"clip_low_threshold": 10**400}}
    datum_ppo = {**datum, "loss_fn_inputs": {**datum["loss_fn_inputs"],
                 "logprobs": {"data": [0.0, 0.0], "dtype": "float32", "shape": [2]},
                 "advantages": {"data": [1.0, 1.0], "dtype": "float32", "shape": [2]}}}  # fmt: skip
    reply = http.post("/forward_backward", json={**body, "forward_backward_input": {**ppo, "data": [datum_ppo]}})
    _assert_400(reply, "clip_low_threshold", "too large for a float")
    assert http.post("/forward_backward", json={**body, "seq_id": (1 << 63) - 1}).status_code == 200


def test_an_upload_config_with_zero_heads_or_a_huge_number_is_refused(http: httpx.Client) -> None:
    config = {"architectures": ["Qwen3ForCausalLM"], "intermediate_size": 16, "vocab_size": 32, "hidden_size": 8,
              "num_hidden_layers": 1, "num_attention_heads": 0}  # fmt: skip
    _assert_400(http.post("/uploads/zero-heads", json={"files": [], "config": config}), "num_attention_heads")
    huge = {**config, "num_attention_heads": 2, "rope_theta": 10**400}
    _assert_400(http.post("/uploads/huge-theta", json={"files": [], "config": huge}), "too large")


def test_ids_taken_by_another_route_are_400s_naming_them(source: str, http: httpx.Client, training) -> None:
    """A run id made by copy_weights, then asked for by create_model or create-from-state; a sampler seq id
    used twice by save_weights_for_sampler: each insert hit a unique key and answered 500."""
    session_id = http.post("/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    assert http.post("/copy_weights", json={"source_path": source, "session_id": session_id, "model_seq_id": 3})
    create = {"session_id": session_id, "model_seq_id": 3, "base_model": training.get_info().model_data.model_name,
              "lora_config": {"rank": 8}}  # fmt: skip
    taken = f"training run '{session_id}:train:3' already exists"
    _assert_400(http.post("/create_model", json=create), taken)
    load = {"path": source, "session_id": session_id, "model_seq_id": 3, "optimizer": False}
    _assert_400(http.post("/load_weights", json=load), taken)
    sampler = {"model_id": training.model_id, "sampling_session_seq_id": 41}
    assert http.post("/save_weights_for_sampler", json=sampler).status_code == 200
    _assert_400(http.post("/save_weights_for_sampler", json=sampler), "sampler", ":sample:41' already exists")
    assert http.post("/create_model", json={**create, "model_seq_id": 4}).status_code == 200  # a free id works


def test_a_finished_session_takes_no_new_run_from_a_checkpoint(source: str, http: httpx.Client) -> None:
    session_id = http.post("/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    assert http.post("/session_heartbeat", json={"session_id": session_id}).status_code == 200
    assert http.post(f"/sessions/{session_id}/finish", json={}).status_code == 200
    load = {"path": source, "session_id": session_id, "model_seq_id": 0, "optimizer": False}
    _assert_400(http.post("/load_weights", json=load), f"session {session_id!r} is finished")


def test_stored_metadata_and_tags_are_bounded(http: httpx.Client, training) -> None:
    """What a client stores with a session, run or checkpoint is read back by every listing and search: a
    body-sized (8 MiB+) user_metadata per session made each search read gigabytes."""
    big = {"k": "x" * (64 << 10)}
    for reply in (
        http.post("/create_session", json={"user_metadata": big}),
        http.post("/create_session", json={"tags": ["t"] * 65}),
        http.post("/create_session", json={"tags": ["x" * 257]}),
        http.post("/create_session", json={"sdk_version": "9" * 65}),
        http.post("/save_weights", json={"model_id": training.model_id, "path": "meta", "user_metadata": big}),
    ):
        assert reply.status_code == 422, reply.text
        assert any(field in reply.text for field in ("user_metadata", "tags", "sdk_version")), reply.text
    fits = {"k": "x" * ((64 << 10) - 20)}
    ok = http.post("/create_session", json={"user_metadata": fits, "tags": ["t"] * 64, "sdk_version": "0.38.0"})
    assert ok.status_code == 200, ok.text


def test_a_source_deleted_or_swapped_mid_copy_is_404_or_503_not_500(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint deleted while `copy_weights` copied it made `shutil.copytree` raise, answered as a 500
    (the SDK retried it, then got a 404): half of 20 copies racing a delete."""
    import errno
    import shutil

    from fastapi import HTTPException

    from tx.api import routes_copy

    source = tmp_path / "src"
    source.mkdir()
    for name in ("a", "b"):
        (source / name).write_text(name)
    real_copy = shutil.copyfile  # what copytree's copy2 calls for each file
    for swap, status in ((False, 404), (True, 503)):

        def copy_then_vanish(src: str, dst: str, *, follow_symlinks: bool = True, swap: bool = swap) -> object:
            shutil.rmtree(source)  # the delete (or the overwrite's swap) lands mid-copy
            if swap:
                source.mkdir()
            return real_copy(src, dst, follow_symlinks=follow_symlinks)

        monkeypatch.setattr(shutil, "copyfile", copy_then_vanish)
        with pytest.raises(HTTPException) as err:
            routes_copy._copy_tree(source, tmp_path / f"dest-{swap}", "tinker://r/weights/src")
        assert err.value.status_code == status
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dest")]  # no temporary left behind
        monkeypatch.setattr(shutil, "copyfile", real_copy)
        source.mkdir(exist_ok=True)
        for name in ("a", "b"):
            (source / name).write_text(name)

    def disk_full(src: str, dst: str, *, follow_symlinks: bool = True) -> object:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", disk_full)  # a full disk is the app's 507, not "changed; retry"
    with pytest.raises(OSError) as full:
        routes_copy._copy_tree(source, tmp_path / "dest-full", "tinker://r/weights/src")
    assert full.value.errno == errno.ENOSPC and not isinstance(full.value, shutil.Error)


def test_a_copy_racing_its_retry_keeps_the_recorded_copy_and_replaces_only_leftovers(tmp_path) -> None:
    """Two processes serving the same idempotent copy: the loser removed the winner's recorded directory
    up front and its rename could then raise (a 500). A recorded copy in place stays; a dead copy's
    leftovers are replaced; no temporary remains either way."""
    from tx.api import routes_copy

    source = tmp_path / "src"
    source.mkdir()
    (source / "adapter.safetensors").write_text("new")
    for owned, kept in ((True, "winner"), (False, "new")):
        dest = tmp_path / f"dest-{owned}"
        dest.mkdir()
        (dest / "adapter.safetensors").write_text("winner" if owned else "leftover")
        routes_copy._copy_tree(source, dest, "tinker://r/weights/src", lambda owned=owned: owned)
        assert (dest / "adapter.safetensors").read_text() == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest-False", "dest-True", "src"]
