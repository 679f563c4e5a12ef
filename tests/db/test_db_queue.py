"""The work queue: dedupe, claim order, event-driven waits, completion bookkeeping, recovery."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from sqlmodel import Session, SQLModel, select

from tx.db import Database, DuplicateRequestError, open_database, owner_of
from tx.db.queue import SqlQueue
from tx.db.tables import CheckpointRow, FutureRow, SamplerSnapshotRow, TrainingRunRow
from tx.protocol import (
    AdamParams,
    CheckpointResult,
    CreateModelRequest,
    CreateModelResult,
    Datum,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoraConfig,
    OptimStepRequest,
    OptimStepResult,
    Payload,
    RequestError,
    SaveSamplerRequest,
    SaveStateRequest,
    UnloadModelRequest,
    UnloadResult,
    WorkItem,
)

OWNER = owner_of("tml-test")


def _fb(tokens: list[int]) -> ForwardBackwardRequest:
    return ForwardBackwardRequest([Datum(tokens, {"target_tokens": np.asarray(tokens, np.int64)})], "cross_entropy")


def _submit(db: Database, seq_id: int, tokens: list[int] | None = None) -> str:
    payload = _fb(tokens or [1, 2, 3])
    key = f"m#{seq_id}"
    return db.queue.submit(
        kind="forward_backward", payload=payload, owner=OWNER, model_id="m", seq_id=seq_id, dedupe_key=key
    ).future_id


def _submit_as(db: Database, owner: str, seq_id: int) -> str:
    model = f"m-{owner}"
    return db.queue.submit(
        kind="forward_backward", payload=_fb([1, 2]), owner=owner, model_id=model, seq_id=seq_id,
        dedupe_key=f"{model}#{seq_id}",
    ).future_id  # fmt: skip


def test_dedupe_same_payload_same_future(db: Database) -> None:
    first = _submit(db, 1)
    assert _submit(db, 1) == first
    with pytest.raises(DuplicateRequestError, match="m seq_id 1 was already used"):
        _submit(db, 1, [4, 5, 6])


def test_claim_in_creation_order_and_marks_running(db: Database) -> None:
    ids = [_submit(db, i) for i in range(1, 6)]
    items = db.queue.claim(3)
    assert [item.future_id for item in items] == ids[:3]
    assert items[0].payload.data[0].tokens == [1, 2, 3] and items[0].seq_id == 1 and items[0].kind == "forward_backward"
    assert [item.future_id for item in db.queue.claim(10)] == ids[3:]
    assert db.queue.claim(10) == []
    assert {db.queue.get(i).status for i in ids} == {"running"}  # type: ignore[union-attr]


def test_one_owners_backlog_does_not_hold_back_another_owners_request(db: Database) -> None:
    """Owner A queues a backlog before owner B's one request: B's comes in the first claim, and again in the
    next claim when A already holds requests running; each owner's own requests keep their order."""

    def submit(owner: str, model: str, seq: int) -> str:
        return db.queue.submit(
            kind="forward_backward", payload=_fb([1, 2]), owner=owner, model_id=model, seq_id=seq,
            dedupe_key=f"{model}#{seq}",
        ).future_id  # fmt: skip

    backlog = [submit("a", "ma", i) for i in range(1, 9)]
    first_b = submit("b", "mb", 1)
    claimed = [item.future_id for item in db.queue.claim(3)]
    assert claimed == [backlog[0], backlog[1], first_b]  # turns 1 and 2 of a, turn 1 of b; in id order
    second_b = submit("b", "mb", 2)
    assert [item.future_id for item in db.queue.claim(1)] == [second_b]  # a holds 2 running, b none
    assert [item.future_id for item in db.queue.claim(10)] == backlog[2:]


def test_no_owner_is_claimed_past_its_share(db: Database) -> None:
    """`per_owner` bounds each owner's unfinished (running and claimed) requests: a's third waits while it
    holds two, b's first is claimed; a's next comes once one of its two finished."""
    ids = {o: [_submit_as(db, o, seq) for seq in range(1, 5)] for o in ("a", "b")}
    claimed = [item.future_id for item in db.queue.claim(10, per_owner=2)]
    assert claimed == [*ids["a"][:2], *ids["b"][:2]]
    assert db.queue.claim(10, per_owner=2) == []
    db.queue.complete(ids["a"][0], OptimStepResult())
    assert [item.future_id for item in db.queue.claim(10, per_owner=2)] == [ids["a"][2]]


def test_only_a_finish_of_an_owner_left_at_its_share_makes_the_engine_look_again(db: Database) -> None:
    """Each look ranks every queued request (~0.1 s under a 100k backlog, with SQLite's write lock held). A
    finish of any request made the engine look again while one owner had a backlog past its share; now only
    a finish of that owner's requests does."""
    backlog = [_submit_as(db, "a", seq) for seq in range(1, 5)]
    other = _submit_as(db, "b", 1)
    assert {item.future_id for item in db.queue.claim(10, per_owner=2)} == {*backlog[:2], other}
    db.queue.notifier.take_work_flag()
    db.queue.complete(other, OptimStepResult())
    assert not db.queue.notifier.take_work_flag()  # b had nothing left: no look
    db.queue.complete(backlog[0], OptimStepResult())
    assert db.queue.notifier.take_work_flag()
    db.queue.wake()  # the flag, as the engine would find it
    assert [item.future_id for item in db.queue.claim(10, per_owner=2)] == [backlog[2]]


def test_concurrent_submits_group_commit(db: Database) -> None:
    results: list[str] = []
    lock = threading.Lock()

    def worker(seq: int) -> None:
        future_id = _submit(db, seq % 25 + 1)  # every key submitted twice, concurrently
        with lock:
            results.append(future_id)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 25
    assert len(db.queue.claim(100)) == 25


def test_a_request_that_breaks_a_shared_commit_fails_alone(db: Database) -> None:
    """Two requests written in one group-commit transaction, one of them a run id that already exists:
    the transaction fails, each is retried in its own, and only the duplicate run fails."""

    def create(run_id: str) -> str:
        run = TrainingRunRow(id=run_id, session_id="g", owner=OWNER, base_model="b", lora_rank=4)
        return db.queue.submit(kind="create_model", payload=CreateModelRequest("b", LoraConfig(4)), owner=OWNER,
                               model_id=run_id, rows=[run]).future_id  # fmt: skip

    existing = create("g:train:0")
    group = db.queue._group
    commit, writing, release = group.before_commit, threading.Event(), threading.Event()

    def slow_first_commit(session) -> None:  # type: ignore[no-untyped-def]
        if not writing.is_set():
            writing.set()
            release.wait(5)
        commit(session)

    group.before_commit = slow_first_commit
    outcomes: dict[str, str | Exception] = {}

    def submit(name: str, fn) -> threading.Thread:  # type: ignore[no-untyped-def]
        def target() -> None:
            try:
                outcomes[name] = fn()
            except Exception as exc:
                outcomes[name] = exc

        thread = threading.Thread(target=target)
        thread.start()
        return thread

    threads = [submit("first", lambda: _submit(db, 1))]
    assert writing.wait(5)  # the first batch is being written; the next two wait for it and go together
    threads += [submit("duplicate", lambda: create("g:train:0")), submit("fine", lambda: create("g:train:1"))]
    deadline = time.monotonic() + 5
    while len(group._pending) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(group._pending) == 2
    release.set()
    for thread in threads:
        thread.join(5)
    assert isinstance(outcomes["duplicate"], Exception) and "g:train:0" in str(outcomes["duplicate"])
    fine = outcomes["fine"]
    assert isinstance(fine, str) and db.queue.get(fine).status == "pending"  # type: ignore[union-attr]
    assert db.records.get_run("g:train:1", OWNER) is not None
    claimed = [item.future_id for item in db.queue.claim(10)]
    assert claimed == sorted([existing, outcomes["first"], fine], key=int)  # type: ignore[list-item]


def test_wait_for_work_wakes_on_submit(db: Database) -> None:
    db.queue.claim(10)  # clear the flag
    threading.Timer(0.05, lambda: _submit(db, 1)).start()
    start = time.monotonic()
    db.queue.wait_for_work(5.0)
    assert time.monotonic() - start < 2.5  # woken, not timed out after 5 s
    assert len(db.queue.claim(10)) == 1


def test_wait_finished_is_event_driven(db: Database) -> None:
    future_id = _submit(db, 1)
    db.queue.claim(10)
    result = ForwardBackwardResult([{"logprobs": np.zeros(3, np.float32)}], {"loss:sum": 0.0})
    threading.Timer(0.1, lambda: db.queue.complete(future_id, result)).start()

    async def wait() -> tuple[str, float]:
        start = time.monotonic()
        row = await db.queue.wait_finished(future_id, 10.0)
        assert row is not None
        return row.status, time.monotonic() - start

    status, seconds = asyncio.run(wait())
    assert status == "done" and seconds < 5.0  # woken, not timed out after 10 s
    row = asyncio.run(db.queue.wait_finished(future_id, 10.0))  # results stay retrievable
    assert row is not None and row.status == "done" and row.result is not None
    with Session(db.queue.engine) as session:  # the request's payload went with its completion
        assert session.get(FutureRow, int(future_id)).payload is None  # type: ignore[union-attr]


def test_a_poll_of_a_queued_request_does_not_read_its_payload(db: Database) -> None:
    """Each retrieve_future poll of a queued request read its whole payload and held it for the 25 s wait
    (20 polls of 8 MB requests: 191 MiB in the API process); now a poll reads the row without it."""
    import tracemalloc

    future_id = _submit(db, 1, list(range(1_000_000)))  # about 12 MB encoded
    tracemalloc.start()
    try:
        row = asyncio.run(db.queue.wait_finished(future_id, 0.05))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert row is not None and row.status == "pending"
    assert peak < 2**20, peak


def test_wait_finished_times_out_pending(db: Database) -> None:
    """A wake that finds the future unfinished (another schema's future of that id, on a shared Postgres)
    waits on instead of returning early."""
    future_id = _submit(db, 1)
    start = time.monotonic()
    threading.Timer(0.02, lambda: db.queue.notifier.result_ready(future_id)).start()
    row = asyncio.run(db.queue.wait_finished(future_id, 0.2))
    assert row is not None and row.status == "pending" and 0.15 < time.monotonic() - start < 2.0
    assert asyncio.run(db.queue.wait_finished("12345", 0.1)) is None


def test_completion_updates_linked_rows(db: Database) -> None:
    run = TrainingRunRow(id="s:train:0", session_id="s", owner=OWNER, base_model="b", lora_rank=4)
    payload = CreateModelRequest("b", LoraConfig(4))
    created = db.queue.submit(kind="create_model", payload=payload, owner=OWNER, model_id=run.id, rows=[run])
    ckpt = CheckpointRow(run_id=run.id, checkpoint_id="weights/a", checkpoint_type="training",
                         tinker_path="tinker://s:train:0/weights/a", owner=OWNER, directory="/tmp/x")  # fmt: skip
    save = db.queue.submit(kind="save_state", payload=SaveStateRequest("a", "/tmp/x", ckpt.tinker_path), owner=OWNER,
                           model_id=run.id, rows=[ckpt])  # fmt: skip
    assert db.records.get_run(run.id, OWNER).status == "pending"  # type: ignore[union-attr]
    db.queue.claim(10)
    db.queue.complete(created.future_id, CreateModelResult(run.id))
    assert db.records.get_run(run.id, OWNER).status == "ready"  # type: ignore[union-attr]
    assert db.records.get_run(run.id, owner_of("tml-other")) is None
    db.queue.fail(save.future_id, RequestError("disk full", "server"))
    assert db.records.get_checkpoint(run.id, "weights/a", OWNER, ready=False) is None
    failed = db.queue.get(save.future_id)
    assert failed is not None and (failed.error, failed.error_category) == ("disk full", "server")
    first = db.queue.get(created.future_id)
    assert first is not None and first.status == "done" and first.result is not None
    # A late duplicate completion (a retried engine write) leaves a done future done and its run ready.
    db.queue.complete(created.future_id, CreateModelResult(run.id))
    again = db.queue.get(created.future_id)
    assert again is not None and (again.status, again.result) == ("done", first.result)
    assert db.records.get_run(run.id, OWNER).status == "ready"  # type: ignore[union-attr]
    # A finished future keeps its first outcome: a late failure leaves it done and its run ready, a late
    # result leaves a failed save failed (and its checkpoint gone).
    db.queue.fail(created.future_id, RequestError("late", "server"))
    assert db.queue.get(created.future_id).status == "done"  # type: ignore[union-attr]
    assert db.records.get_run(run.id, OWNER).status == "ready"  # type: ignore[union-attr]
    db.queue.complete(save.future_id, CheckpointResult(path="p", size_bytes=3))
    assert db.queue.get(save.future_id).status == "failed"  # type: ignore[union-attr]
    assert db.records.get_checkpoint(run.id, "weights/a", OWNER, ready=False) is None
    # Completing a future that was never submitted is ignored, not an error.
    db.queue.complete("987654", CheckpointResult(path="p"))
    assert db.queue.get("987654") is None


def test_checkpoint_size_unload_and_recovery_reach_the_records(db: Database) -> None:
    run = TrainingRunRow(id="u:train:0", session_id="u", owner=OWNER, base_model="b", lora_rank=4)
    created = db.queue.submit(kind="create_model", payload=CreateModelRequest("b", LoraConfig(4)), owner=OWNER,
                              model_id=run.id, rows=[run], dedupe_key="u:train:0#1")  # fmt: skip
    assert db.queue.get_by_key("u:train:0#1").id == int(created.future_id)  # type: ignore[union-attr]
    assert db.queue.get_by_key("u:train:0#2") is None
    ckpt = CheckpointRow(run_id=run.id, checkpoint_id="weights/s", checkpoint_type="training",
                         tinker_path="tinker://u:train:0/weights/s", owner=OWNER, directory="/tmp/s")  # fmt: skip
    save = db.queue.submit(kind="save_state", payload=SaveStateRequest("s", "/tmp/s", ckpt.tinker_path), owner=OWNER,
                           model_id=run.id, rows=[ckpt])  # fmt: skip
    db.queue.claim(10)
    db.queue.complete(created.future_id, CreateModelResult(run.id))
    size = 5 << 30  # a full fine-tuning state of a 1B model: past a 32-bit column
    db.queue.complete(save.future_id, CheckpointResult(path=ckpt.tinker_path, size_bytes=size))
    assert db.records.get_checkpoint(run.id, "weights/s", OWNER).size_bytes == size  # type: ignore[union-attr]
    unload = db.queue.submit(kind="unload_model", payload=UnloadModelRequest(), owner=OWNER, model_id=run.id)
    db.queue.claim(10)
    db.queue.complete(unload.future_id, UnloadResult(run.id))
    assert db.records.get_run(run.id, OWNER).status == "unloaded"  # type: ignore[union-attr]
    # A restart unloads every run that was ready (its adapter lived in the old process).
    other = TrainingRunRow(id="v:train:0", session_id="v", owner=OWNER, base_model="b", lora_rank=4)
    made = db.queue.submit(kind="create_model", payload=CreateModelRequest("b", LoraConfig(4)), owner=OWNER,
                           model_id=other.id, rows=[other])  # fmt: skip
    db.queue.claim(10)
    db.queue.complete(made.future_id, CreateModelResult(other.id))
    assert db.records.get_run(other.id, OWNER).status == "ready"  # type: ignore[union-attr]
    db.queue.recover()
    assert db.records.get_run(other.id, OWNER).status == "unloaded"  # type: ignore[union-attr]


def test_metrics_and_last_request_time_are_recorded_for_the_run(db: Database) -> None:
    run = TrainingRunRow(id="w:train:0", session_id="w", owner=OWNER, base_model="b", lora_rank=4)
    created = db.queue.submit(kind="create_model", payload=CreateModelRequest("b", LoraConfig(4)), owner=OWNER,
                              model_id=run.id, rows=[run])  # fmt: skip
    fb = db.queue.submit(kind="forward_backward", payload=_fb([1, 2]), owner=OWNER, model_id=run.id)
    step = db.queue.submit(kind="optim_step", payload=OptimStepRequest(AdamParams()), owner=OWNER, model_id=run.id)
    db.queue.claim(10)
    db.queue.complete(created.future_id, CreateModelResult(run.id))
    created_at = db.records.get_run(run.id, OWNER).last_request_at  # type: ignore[union-attr]
    time.sleep(0.01)
    db.queue.complete(fb.future_id, ForwardBackwardResult([], {"loss:sum": 2.5}))
    # forward_backward completions (many per step) leave the run row alone; the step's optim_step writes it.
    assert db.records.get_run(run.id, OWNER).last_request_at == created_at  # type: ignore[union-attr]
    db.queue.complete(step.future_id, OptimStepResult({"grad_norm:mean": 0.75}))
    metrics = {(m.kind, m.name, m.value) for m in db.records.latest_metrics(run.id)}
    assert metrics == {("forward_backward", "loss:sum", 2.5), ("optim_step", "grad_norm:mean", 0.75)}
    assert db.records.get_run(run.id, OWNER).last_request_at > created_at  # type: ignore[union-attr,operator]


def test_one_finish_many_records_every_outcome_and_its_linked_rows(db: Database) -> None:
    """A step's completions land in one call: each future done or failed, runs ready, a saved checkpoint sized,
    a failed save's checkpoint gone, metrics kept, and a run created then unloaded in one call left unloaded."""
    runs = [TrainingRunRow(id=f"m{i}:train:0", session_id=f"m{i}", owner=OWNER, base_model="b") for i in range(3)]
    made = [db.queue.submit(kind="create_model", payload=CreateModelRequest("b", LoraConfig(4)), owner=OWNER,
                            model_id=run.id, rows=[run]).future_id for run in runs]  # fmt: skip
    saves = [CheckpointRow(run_id=runs[0].id, checkpoint_id=f"weights/{n}", checkpoint_type="training", owner=OWNER,
                           tinker_path=f"tinker://m0/{n}", directory=f"/tmp/{n}") for n in "ab"]  # fmt: skip
    saved = [db.queue.submit(kind="save_state", payload=SaveStateRequest(c.checkpoint_id, c.directory, c.tinker_path),
                             owner=OWNER, model_id=runs[0].id, rows=[c]).future_id for c in saves]  # fmt: skip
    step = db.queue.submit(kind="optim_step", payload=OptimStepRequest(AdamParams()), owner=OWNER, model_id=runs[0].id)
    unload = db.queue.submit(kind="unload_model", payload=UnloadModelRequest(), owner=OWNER, model_id=runs[2].id)
    db.queue.claim(20)
    db.queue.finish_many([
        (made[0], CreateModelResult(runs[0].id)), (made[1], RequestError("no slot", "user")),
        (made[2], CreateModelResult(runs[2].id)), (saved[0], CheckpointResult(path="p", size_bytes=7)),
        (saved[1], RequestError("disk full", "server")), (step.future_id, OptimStepResult({"grad_norm:mean": 0.5})),
        (unload.future_id, UnloadResult(runs[2].id)), ("987654", CreateModelResult("nobody")),
    ])  # fmt: skip
    statuses = {f: db.queue.get(f).status for f in [*made, *saved, step.future_id, unload.future_id]}  # type: ignore[union-attr]
    assert list(statuses.values()) == ["done", "failed", "done", "done", "failed", "done", "done"]
    assert [db.records.get_run(run.id, OWNER).status for run in runs] == ["ready", "failed", "unloaded"]  # type: ignore[union-attr]
    assert db.records.get_checkpoint(runs[0].id, "weights/a", OWNER).size_bytes == 7  # type: ignore[union-attr]
    assert db.records.get_checkpoint(runs[0].id, "weights/b", OWNER, ready=False) is None
    assert {(m.kind, m.value) for m in db.records.latest_metrics(runs[0].id)} == {("optim_step", 0.5)}
    # A step's many requests are finished without looking for linked rows, so they may bring none.
    extra = TrainingRunRow(id="m9:train:0", session_id="m9", owner=OWNER, base_model="b")
    with pytest.raises(ValueError, match="a forward_backward request brings no rows"):
        db.queue.submit(kind="forward_backward", payload=_fb([1, 2]), owner=OWNER, model_id=runs[0].id, rows=[extra])


def test_recover_fails_running_work_and_keeps_pending_work_queued(db: Database) -> None:
    running, pending = _submit(db, 1), _submit(db, 2)
    db.queue.claim(1)
    found = db.queue.recover()
    assert (found.failed, found.pending) == (1, 1)
    row = db.queue.get(running)
    assert row is not None and row.status == "failed" and "effect is unknown" in (row.error or "")
    assert db.queue.get(pending).status == "pending"  # type: ignore[union-attr]
    assert [item.future_id for item in db.queue.claim(10)] == [pending]  # and the new engine claims it


def _ready_run(db: Database, run_id: str) -> TrainingRunRow:
    run = TrainingRunRow(id=run_id, session_id=run_id, owner=OWNER, base_model="b", lora_rank=4)
    made = db.queue.submit(kind="create_model", payload=CreateModelRequest("b", LoraConfig(4)), owner=OWNER,
                           model_id=run.id, rows=[run])  # fmt: skip
    db.queue.claim(10)
    db.queue.complete(made.future_id, CreateModelResult(run.id))
    return run


def _saved(db: Database, run_id: str, name: str, kind: str = "training", path: str | None = "") -> str:
    """A finished save of `run_id` (a training checkpoint, or a sampler snapshot when `kind` is sampler)."""
    if kind == "sampler":
        row: SQLModel = SamplerSnapshotRow(id=name, model_id=run_id, owner=OWNER, tinker_path=path)
        payload: Payload = SaveSamplerRequest(name, tinker_path=path)
    else:
        tinker_path = f"tinker://{run_id}/weights/{name}"
        row = CheckpointRow(run_id=run_id, checkpoint_id=f"weights/{name}", checkpoint_type="training", owner=OWNER,
                            tinker_path=tinker_path, directory=f"/tmp/{name}")  # fmt: skip
        payload = SaveStateRequest(name, f"/tmp/{name}", tinker_path)
    save = db.queue.submit(kind=f"save_{'weights_for_sampler' if kind == 'sampler' else 'state'}", payload=payload,
                           owner=OWNER, model_id=run_id, rows=[row])  # fmt: skip
    db.queue.claim(10)
    db.queue.complete(save.future_id, CheckpointResult(path=path or None))
    return name


def test_recover_reports_each_lost_run_with_its_newest_checkpoint_and_memory_only_snapshots(db: Database) -> None:
    saved, bare = _ready_run(db, "s:train:0"), _ready_run(db, "n:train:0")
    _saved(db, saved.id, "first")
    time.sleep(0.01)
    _saved(db, saved.id, "second")
    ephemeral = _saved(db, saved.id, "s:sample:0", "sampler", None)
    _saved(db, saved.id, "named", "sampler", "tinker://s:train:0/sampler_weights/named")
    queued = TrainingRunRow(id="q:train:0", session_id="q", owner=OWNER, base_model="b", lora_rank=4)
    db.queue.submit(kind="create_model", payload=CreateModelRequest("b", LoraConfig(4)), owner=OWNER,
                    model_id=queued.id, rows=[queued])  # fmt: skip
    lost = db.queue.recover().lost
    assert lost.runs == {saved.id: "tinker://s:train:0/weights/second", bare.id: None}
    assert lost.snapshots == {ephemeral}
    assert db.records.get_run(queued.id, OWNER).status == "pending"  # type: ignore[union-attr]
    assert db.queue.recover().lost.runs == {}  # unloaded now: a second restart loses nothing more


def test_recover_fails_what_an_unfinished_request_would_have_created(db: Database) -> None:
    """A create_model and a save_state running when the server died: the run is failed (never listed), the
    checkpoint row is gone (its name is free again), and a request that finished stays as it was."""
    run = TrainingRunRow(id="r:train:0", session_id="r", owner=OWNER, base_model="b", lora_rank=4)
    created = db.queue.submit(kind="create_model", payload=CreateModelRequest("b", LoraConfig(4)), owner=OWNER,
                              model_id=run.id, rows=[run])  # fmt: skip
    ckpt = CheckpointRow(run_id="q:train:0", checkpoint_id="weights/c", checkpoint_type="training",
                         tinker_path="tinker://q:train:0/weights/c", owner=OWNER, directory="/tmp/c")  # fmt: skip
    save = db.queue.submit(kind="save_state", payload=SaveStateRequest("c", "/tmp/c", ckpt.tinker_path), owner=OWNER,
                           model_id="q:train:0", rows=[ckpt])  # fmt: skip
    finished = _submit(db, 1)
    db.queue.claim(10)
    db.queue.complete(finished, ForwardBackwardResult([], {"loss:sum": 1.0}))
    assert db.queue.recover().failed == 2
    assert db.records.get_run(run.id, OWNER).status == "failed"  # type: ignore[union-attr]
    assert db.records.get_checkpoint("q:train:0", "weights/c", OWNER, ready=False) is None
    assert {db.queue.get(f).status for f in (created.future_id, save.future_id)} == {"failed"}  # type: ignore[union-attr]
    assert db.queue.get(finished).status == "done"  # type: ignore[union-attr]
    assert db.queue.recover().failed == 0


def test_an_unreadable_stored_request_fails_alone_at_claim(db: Database) -> None:
    from sqlalchemy import update

    from tx.db.tables import FutureRow

    good, broken, later = _submit(db, 1), _submit(db, 2), _submit(db, 3)
    with db.queue.write_lock.held(), db.engine.begin() as conn:
        conn.execute(update(FutureRow).where(FutureRow.id == int(broken)).values(payload=b"\x00 not a payload"))
    assert [item.future_id for item in db.queue.claim(10)] == [good, later]
    row = db.queue.get(broken)
    assert row is not None and row.status == "failed" and row.error_category == "server"
    assert (row.error or "").startswith("stored request is unreadable")
    assert db.queue.get("not-a-number") is None and db.queue.get("") is None


def test_a_claim_whose_unreadable_request_cannot_be_failed_still_runs_the_others(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failing an unreadable request is a write; when the database refused it, the claim raised and its other
    rows, already marked running, reached no engine. They are returned, and the unreadable one is failed on
    a later claim."""
    from sqlalchemy import update

    from tx.db.queue import QueueUnavailable
    from tx.db.tables import FutureRow

    good, broken = _submit(db, 1), _submit(db, 2)
    with db.queue.write_lock.held(), db.engine.begin() as conn:
        conn.execute(update(FutureRow).where(FutureRow.id == int(broken)).values(payload=b"\x00 not a payload"))
    finish = db.queue.finish_many

    def refused(outcomes):  # type: ignore[no-untyped-def]
        raise QueueUnavailable("database is locked")

    monkeypatch.setattr(db.queue, "finish_many", refused)
    assert [item.future_id for item in db.queue.claim(10)] == [good]
    monkeypatch.setattr(db.queue, "finish_many", finish)
    assert db.queue.claim(10) == []
    assert db.queue.get(broken).status == "failed"  # type: ignore[union-attr]


def test_without_a_signal_claim_looks_at_the_table_every_rescan_s(db: Database) -> None:
    """Work written by another process whose signal was lost (or that sent none) is found by the rescan."""
    if db.listener is not None:
        pytest.skip("Postgres delivers this process's own NOTIFY later, which would set the flag again")
    db.queue.claim(10)  # a scan just now
    future_id = _submit(db, 1)
    assert db.queue.notifier.take_work_flag()  # the signal is consumed elsewhere
    db.queue.rescan_s = 30.0
    assert db.queue.claim(10) == []  # scanned less than rescan_s ago and not signalled: no query
    db.queue.rescan_s = 0.0
    assert [item.future_id for item in db.queue.claim(10)] == [future_id]


def test_a_lost_signal_costs_at_most_two_seconds(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default rescan: unsignalled work is found 2 s after the last scan, and not queried for before."""
    if db.listener is not None:
        pytest.skip("Postgres delivers this process's own NOTIFY later, which would set the flag again")
    clock = [100.0]
    monkeypatch.setattr("tx.db.queue.time.monotonic", lambda: clock[0])
    db.queue.rescan_s = SqlQueue(db.engine, db.queue.notifier, db.queue.write_lock).rescan_s  # the default
    db.queue.claim(10)  # a scan at t = 100
    future_id = _submit(db, 1)
    assert db.queue.notifier.take_work_flag()  # the signal is lost
    clock[0] = 101.999
    assert db.queue.claim(10) == []
    clock[0] = 102.0
    assert [item.future_id for item in db.queue.claim(10)] == [future_id]


def test_wait_finished_answers_only_the_owner(db: Database) -> None:
    future_id = _submit(db, 1)
    db.queue.claim(10)
    db.queue.complete(future_id, ForwardBackwardResult([], {"loss:sum": 1.0}))
    start = time.monotonic()
    assert asyncio.run(db.queue.wait_finished(future_id, 5.0, owner=owner_of("tml-other"))) is None
    mine = asyncio.run(db.queue.wait_finished(future_id, 5.0, owner=OWNER))
    assert mine is not None and mine.status == "done" and time.monotonic() - start < 2.0


def test_any_64_bit_seq_id_is_stored(db: Database) -> None:
    """The API admits any int64 seq_id; the column holds it (a 32-bit one made 2^31 a 500 on Postgres)."""
    for seq_id in ((1 << 63) - 1, -(1 << 63), 1 << 40):
        future_id = _submit(db, seq_id)
        row = db.queue.get(future_id)
        assert row is not None and row.seq_id == seq_id


def test_a_postgres_database_from_before_is_widened_at_open(db: Database) -> None:
    if db.engine.dialect.name != "postgresql":
        pytest.skip("SQLite's integer columns hold 64 bits whatever they were declared")
    with db.engine.begin() as conn:  # the columns as earlier versions made them
        conn.exec_driver_sql("ALTER TABLE futures ALTER COLUMN seq_id TYPE INTEGER")
        conn.exec_driver_sql("ALTER TABLE checkpoints ALTER COLUMN size_bytes TYPE INTEGER")
    again = open_database(db.engine.url.render_as_string(hide_password=False), ".")
    try:
        row = again.queue.get(_submit(again, 1 << 40))
        assert row is not None and row.seq_id == 1 << 40
        with again.engine.connect() as conn:
            types = conn.exec_driver_sql(
                "SELECT column_name, data_type FROM information_schema.columns WHERE table_schema = current_schema()"
                " AND column_name IN ('seq_id', 'size_bytes')"
            ).fetchall()
        assert sorted(types) == [("seq_id", "bigint"), ("size_bytes", "bigint")]
    finally:
        again.close()


def test_a_future_id_we_never_issued_is_unknown_not_an_error(db: Database) -> None:
    """retrieve_future passes the client's string straight in: 5000 digits once raised past `int`'s limit
    (a 500, and the connection dropped), and 2^31 does not fit Postgres' id column."""
    _submit(db, 1)
    huge = ("9" * 5000, str(1 << 63), "9" * 19, "9" * 12, str(1 << 31))
    for future_id in (*huge, "\u00b2", "\u0663", "-1", "", " 1", "1e3", "0x1"):
        assert db.queue.get(future_id) is None, future_id
        assert asyncio.run(db.queue.wait_finished(future_id, 5.0, owner=OWNER)) is None, future_id
    assert db.queue.get("1") is not None


def test_postgres_notify_reaches_another_server(db: Database) -> None:
    """Two Database objects on one Postgres stand in for two processes: NOTIFY must wake the other."""
    if db.listener is None:
        pytest.skip("LISTEN/NOTIFY only applies to Postgres")
    from tx.db import open_database

    other = open_database(db.engine.url.render_as_string(hide_password=False), ".")
    try:
        time.sleep(0.3)  # let both listeners connect
        db.queue.claim(10)
        threading.Timer(0.05, lambda: _submit(other, 1)).start()
        start = time.monotonic()
        items: list = []
        while not items and time.monotonic() - start < 2.0:  # another test's NOTIFY (another schema) may wake it
            db.queue.wait_for_work(5.0)
            items = db.queue.claim(10)
        assert time.monotonic() - start < 2.0
        (item,) = items
        threading.Timer(0.1, lambda: other.queue.fail(item.future_id, RequestError("x", "user"))).start()
        row = asyncio.run(db.queue.wait_finished(item.future_id, 10.0))
        assert row is not None and row.status == "failed" and time.monotonic() - start < 3.0
    finally:
        other.close()


@pytest.fixture
def other(db: Database) -> Iterator[Database]:
    """A second server (process) on the same Postgres schema, its listener connected."""
    if db.listener is None:
        pytest.skip("LISTEN/NOTIFY only applies to Postgres")
    second = open_database(db.engine.url.render_as_string(hide_password=False), ".")
    time.sleep(0.3)  # let its listener connect
    yield second
    second.close()


def test_a_restart_wakes_the_long_polls_of_the_requests_it_fails(db: Database, other: Database) -> None:
    """`recover` failed the claimed requests without a NOTIFY: another API process's long poll on one
    answered only at its deadline (25 s), though the request had failed seconds before."""
    claimed = _submit(db, 1)
    _claim_one(db)
    threading.Timer(0.2, db.queue.recover).start()
    _assert_failed_soon(other, claimed)


def _claim_one(db: Database) -> WorkItem:
    items: list[WorkItem] = []
    while not items:  # a claim looks at the table on a signal, or every rescan_s
        items = db.queue.claim(10)
    (item,) = items
    return item


def _assert_failed_soon(server: Database, future_id: str) -> None:
    """A long poll on `server` answers well before its 20 s deadline, with the request failed."""
    start = time.monotonic()
    row = asyncio.run(server.queue.wait_finished(future_id, 20.0))
    assert row is not None and row.status == "failed" and time.monotonic() - start < 10.0


def test_a_listener_that_reconnects_wakes_the_long_polls_it_may_have_missed(db: Database, other: Database) -> None:
    """Notifications sent while the LISTEN connection was down are gone: a long poll on a request that
    finished then waited out its deadline. The reconnected listener wakes every waiter to look again."""
    from sqlalchemy import text

    future = _submit(db, 1)
    item = _claim_one(db)

    def finish_unheard() -> None:
        assert other.listener is not None and other.listener.backend_pid is not None
        with other.engine.begin() as conn:  # its listener's connection ends; the finish sends no NOTIFY
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": other.listener.backend_pid})
            conn.execute(text("UPDATE futures SET status = 'failed', error = 'x' WHERE id = :id"),
                         {"id": int(item.future_id)})  # fmt: skip

    threading.Timer(0.3, finish_unheard).start()
    _assert_failed_soon(other, future)


def test_opening_an_up_to_date_postgres_database_takes_no_table_locks(db: Database) -> None:
    """A server starting beside live ones (an API server restarted mid-run) must not queue for an exclusive
    lock on the tables they read: its no-op ALTER TABLEs once deadlocked against their queries."""
    if db.engine.dialect.name != "postgresql":
        pytest.skip("the migrations are Postgres ALTER TABLEs")
    _submit(db, 1)
    opened: list[Database] = []
    with db.engine.connect() as reader:
        reader.exec_driver_sql("BEGIN")
        for table in ("futures", "checkpoints", "metrics"):  # a live server's open transaction
            reader.exec_driver_sql(f"SELECT count(*) FROM {table}")
        opener = threading.Thread(
            target=lambda: opened.append(open_database(db.engine.url.render_as_string(hide_password=False), "."))
        )
        opener.start()
        opener.join(20.0)
        finished_under_the_reader = not opener.is_alive()
        reader.exec_driver_sql("ROLLBACK")
    opener.join()
    opened[0].close()
    assert finished_under_the_reader


def test_a_save_over_a_taken_name_that_fails_puts_the_old_checkpoint_back(db: Database) -> None:
    """overwrite=True sets the old checkpoint's row aside (its name free, unlisted); the save failing puts it
    back as it was (its files were never touched), the save succeeding replaces it: one row for the name."""
    run = TrainingRunRow(id="s:train:0", session_id="s", owner=OWNER, base_model="b", status="ready")

    def checkpoint(version: int, status: str = "pending") -> CheckpointRow:
        return CheckpointRow(run_id=run.id, checkpoint_id="weights/a", checkpoint_type="training", owner=OWNER,
                             tinker_path="tinker://s:train:0/weights/a", directory="/tmp/a", status=status,
                             user_metadata_json=f'{{"v": {version}}}')  # fmt: skip

    db.records.add_rows([run, checkpoint(1, "ready")])
    for version, outcome in ((2, RequestError("disk full", "server")), (3, CheckpointResult(path="p", size_bytes=5))):
        existing = db.records.get_checkpoint(run.id, "weights/a", OWNER, ready=False, expired=True)
        assert existing is not None
        db.records.set_aside(existing)
        assert db.records.get_checkpoint(run.id, "weights/a", OWNER, ready=False) is None  # the name is free
        assert db.records.list_checkpoints(OWNER, run.id, 10, 0) == ([], 0)
        payload = SaveStateRequest("a", "/tmp/a", "tinker://s:train:0/weights/a")
        save = db.queue.submit(kind="save_state", payload=payload, owner=OWNER, model_id=run.id,
                               rows=[checkpoint(version)])  # fmt: skip
        db.queue.claim(10)
        db.queue.finish_many([(save.future_id, outcome)])
        listed, total = db.records.list_checkpoints(OWNER, run.id, 10, 0)
        assert total == 1 and listed[0].checkpoint_id == "weights/a"
        assert listed[0].user_metadata_json == ('{"v": 1}' if version == 2 else '{"v": 3}')


def test_a_checkpoint_set_aside_for_a_save_never_queued_is_put_back(db: Database) -> None:
    """The API sets the old checkpoint aside, then queues the save; when the queueing fails (a database
    error, the process killed in between) no save settles it: the route puts it back, and so does the next
    engine's recovery. One set aside for a save that is queued stays aside until that save finishes."""
    run = TrainingRunRow(id="s:train:0", session_id="s", owner=OWNER, base_model="b", status="ready")

    def checkpoint(name: str, status: str) -> CheckpointRow:
        return CheckpointRow(run_id=run.id, checkpoint_id=f"weights/{name}", checkpoint_type="training",
                             owner=OWNER, tinker_path=f"tinker://s:train:0/weights/{name}", directory=f"/tmp/{name}",
                             status=status)  # fmt: skip

    db.records.add_rows([run, checkpoint("a", "ready"), checkpoint("b", "ready"), checkpoint("c", "ready")])
    aside = {n: db.records.get_checkpoint(run.id, f"weights/{n}", OWNER) for n in "abc"}
    for row in aside.values():
        db.records.set_aside(row)  # type: ignore[arg-type]
    db.records.put_back(aside["a"])  # type: ignore[arg-type]  # the route, when its submit raises
    payload = SaveStateRequest("c", "/tmp/c", "tinker://s:train:0/weights/c")
    db.queue.submit(kind="save_state", payload=payload, owner=OWNER, model_id=run.id, rows=[checkpoint("c", "pending")])
    db.queue.recover()  # b: its save was never queued; c: its save is queued and will settle it
    listed = {row.checkpoint_id: row.status for row in db.records.list_checkpoints(OWNER, run.id, 10, 0)[0]}
    assert listed == {"weights/a": "ready", "weights/b": "ready"}
    assert db.records.get_checkpoint(run.id, "weights/c", OWNER, ready=False).status == "pending"  # type: ignore[union-attr]


def test_a_claim_whose_commit_landed_but_raised_runs_next_time(db: Database, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The connection is lost after the server committed the claim: the engine sees an error, the rows read
    `running`. Before, nothing ever ran or failed them until the next engine start."""
    from sqlalchemy.exc import OperationalError
    from sqlmodel import Session

    ids = [_submit(db, i) for i in range(1, 4)]
    real_commit = Session.commit

    def commit_then_lose_the_reply(self: Session) -> None:
        real_commit(self)
        monkeypatch.setattr(Session, "commit", real_commit)
        raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))

    monkeypatch.setattr(Session, "commit", commit_then_lose_the_reply)
    with pytest.raises(OperationalError):
        db.queue.claim(2)
    assert [db.queue.get(i).status for i in ids] == ["running", "running", "pending"]  # type: ignore[union-attr]
    assert [item.future_id for item in db.queue.claim(10)] == ids[:2]  # its own, once
    assert [item.future_id for item in db.queue.claim(10)] == ids[2:]
    assert db.queue.claim(10) == []


def test_a_claim_whose_commit_failed_leaves_its_rows_pending(db: Database, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy.exc import OperationalError
    from sqlmodel import Session

    ids = [_submit(db, i) for i in range(1, 3)]

    def refused(self: Session) -> None:
        raise OperationalError("COMMIT", {}, Exception("database or disk is full"))

    monkeypatch.setattr(Session, "commit", refused)
    with pytest.raises(OperationalError):
        db.queue.claim(10)
    monkeypatch.undo()
    assert [item.future_id for item in db.queue.claim(10)] == ids


def test_a_claims_turns_read_no_request_payload_and_older_databases_get_the_index(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The turns are ranked over every live request. Without an index covering (status, owner, id), SQLite read
    each one's whole payload (150 queued 4 MB requests: ~0.4 s a claim, under the write lock every tenant's
    submits wait on); a database made before the index gets it when opened."""
    from sqlalchemy import text
    from sqlmodel import Session

    from tx.db.turns import turns as _turns

    made = open_database(None, tmp_path)
    with made.queue.engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_futures_live"))
    db = open_database(None, tmp_path)
    with Session(db.queue.engine) as session:
        compiled = _turns(8).compile(db.queue.engine, compile_kwargs={"literal_binds": True})
        plan = " ".join(str(row) for row in session.execute(text(f"EXPLAIN QUERY PLAN {compiled}")))
    assert "COVERING INDEX ix_futures_live" in plan, plan


def test_results_older_than_the_retention_are_dropped_and_say_so(db: Database) -> None:
    """Every sample's tokens and every forward's outputs stayed in the database for good. A result is kept a
    day after its request finished; then a poll reads a failure saying it is gone. Newer ones stay."""
    from sqlalchemy import update

    from tx.db.queue import RESULT_RETENTION_S

    old, new = _submit(db, 1), _submit(db, 2)
    db.queue.claim(10)
    result = ForwardBackwardResult([{"logprobs": np.zeros(3, np.float32)}], {"loss:sum": 0.0})
    db.queue.finish_many([(old, result), (new, result)])
    with db.queue.write_lock.held(), db.engine.begin() as conn:
        long_ago = time.time() - RESULT_RETENTION_S - 60
        conn.execute(update(FutureRow).where(FutureRow.id == int(old)).values(completed_at=long_ago))
    assert db.queue.drop_old_results() == 1 and db.queue.drop_old_results() == 0
    gone = asyncio.run(db.queue.wait_finished(old, 1.0))
    assert gone is not None and gone.status == "failed" and "is gone" in (gone.error or "")
    with Session(db.queue.engine) as session:
        assert session.get(FutureRow, int(old)).result is None  # type: ignore[union-attr]
    kept = asyncio.run(db.queue.wait_finished(new, 1.0))
    assert kept is not None and kept.status == "done" and kept.result is not None


def test_an_older_database_gets_the_new_indexes_when_opened(db: Database) -> None:
    """On Postgres the index is built CONCURRENTLY, outside the schema transaction: a plain CREATE INDEX in it
    blocked every write to a large futures table while it built, beside live API servers."""
    from sqlalchemy import inspect, text

    from tx.db.connect import open_engine

    with db.queue.write_lock.held(), db.engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_futures_live"))
    assert "ix_futures_live" not in {i["name"] for i in inspect(db.engine).get_indexes("futures")}
    reopened = open_engine(db.engine.url.render_as_string(hide_password=False))
    try:
        assert "ix_futures_live" in {i["name"] for i in inspect(reopened).get_indexes("futures")}
    finally:
        reopened.dispose()


def test_a_commit_that_landed_and_then_raised_writes_a_keyless_request_once(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection lost after the server committed: the batch is written again, entry by entry. A request
    with a key found its row; one without (unload_model, a sample without seq_id) was written twice and ran
    twice. Each gets a key of its own for its retries."""
    from sqlalchemy import func as sql_func

    from tx.db import submit

    landed_then_lost = [True]

    class Flaky(submit.Session):  # type: ignore[misc, name-defined]
        def commit(self) -> None:
            super().commit()
            if landed_then_lost[0]:
                landed_then_lost[0] = False
                raise ConnectionError("server closed the connection unexpectedly")

    monkeypatch.setattr(submit, "Session", Flaky)
    submitted = db.queue.submit(kind="unload_model", payload=UnloadModelRequest(), owner=OWNER, model_id="m")
    with Session(db.queue.engine) as session:
        rows = session.exec(select(sql_func.count()).select_from(FutureRow).where(FutureRow.kind == "unload_model"))
        assert rows.one() == 1
    assert db.queue.get(submitted.future_id) is not None


def test_a_listener_without_its_database_logs_one_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """It reconnects every second and logged a traceback each time, in every process, for the whole outage."""
    import logging
    import socket

    from tx.db.notify import Notifier, PgListener

    with socket.socket() as sock:  # a port nothing listens on: the database is away
        sock.bind(("127.0.0.1", 0))
        conninfo = f"postgresql://postgres@127.0.0.1:{sock.getsockname()[1]}/x"
    listener = PgListener(conninfo, Notifier())
    with caplog.at_level(logging.INFO, logger="tx.db"):
        listener.start()
        time.sleep(2.5)  # three tries
        listener.stop()
    own = [r for r in caplog.records if r.thread == listener._thread.ident]  # other tests' listeners log too
    assert [r.getMessage() for r in own if r.exc_info] == ["postgres LISTEN connection failed"]


def test_a_claim_whose_scan_failed_scans_again_at_once(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed scan still counted as one: the next claims skipped the table for `rescan_s` (pending work
    waited; during an outage each skipped claim passed for the database working again)."""
    import tx.db.queue as queue_module

    future = _submit(db, 1)
    scans: list[int] = []

    def failing_once(limit: int) -> Any:
        scans.append(limit)
        if len(scans) == 1:
            raise RuntimeError("connection to server failed")
        return real(limit)

    real = queue_module.turns
    monkeypatch.setattr(queue_module, "turns", failing_once)
    with pytest.raises(RuntimeError):
        db.queue.claim(8)
    assert [item.future_id for item in db.queue.claim(8)] == [future]
