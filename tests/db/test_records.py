"""The metadata records on a real database: every read scoped to its owner, session liveness, listings."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from sqlalchemy.exc import IntegrityError

from tx.db import Database, owner_of
from tx.db.records import Records
from tx.db.tables import CheckpointRow, MetricRow, SamplingSessionRow, SessionRow, TrainingRunRow, utcnow
from tx.protocol import UnloadModelRequest

ME, OTHER = owner_of("tml-me"), owner_of("tml-other")


def _run(session_id: str, seq: int, owner: str = ME, status: str = "ready", **kw: object) -> TrainingRunRow:
    return TrainingRunRow(id=f"{session_id}:train:{seq}", session_id=session_id, owner=owner, base_model="b",
                          status=status, **kw)  # fmt: skip


def _checkpoint(
    run_id: str, name: str, owner: str = ME, status: str = "ready", checkpoint_type: str = "training", **kw: object
) -> CheckpointRow:
    return CheckpointRow(run_id=run_id, checkpoint_id=f"weights/{name}", checkpoint_type=checkpoint_type,
                         tinker_path=f"tinker://{run_id}/weights/{name}", owner=owner, directory="/d", status=status,
                         **kw)  # fmt: skip


def _age(records: Records, session_id: str, seconds: float) -> None:
    records._update(SessionRow, session_id, last_heartbeat_at=utcnow() - timedelta(seconds=seconds))


def test_owner_ids_are_stable_distinct_and_not_the_key() -> None:
    assert owner_of("tml-me") == ME and ME != OTHER and len(ME) == 24 and "tml" not in ME
    assert int(ME, 16) >= 0  # hex


def test_another_owners_rows_look_like_missing_ones(db: Database) -> None:
    records = db.records
    session_id = records.create_session(ME, ["t"], {"k": "v"}, "0.38.0")
    run = _run(session_id, 0)
    sampler = SamplingSessionRow(id=f"{session_id}:sample:0", session_id=session_id, owner=ME, base_model="b")
    records.add_rows([run, _checkpoint(run.id, "a")])
    records.add_sampling_session(sampler)
    assert records.get_session(session_id, ME) is not None and records.get_session(session_id, OTHER) is None
    assert records.get_run(run.id, ME) is not None and records.get_run(run.id, OTHER) is None
    assert records.get_sampling_session(sampler.id, ME) is not None
    assert records.get_sampling_session(sampler.id, OTHER) is None
    assert records.get_checkpoint(run.id, "weights/a", ME) is not None
    assert records.get_checkpoint(run.id, "weights/a", OTHER) is None
    assert records.heartbeat(session_id, OTHER) == "missing" and records.finish_session(session_id, OTHER, "x") is None
    assert records.list_sessions(OTHER, 10, 0) == [] and records.owner_sessions(OTHER) == []
    assert records.list_runs(OTHER, 10, 0) == ([], 0) and records.list_checkpoints(OTHER, None, 10, 0) == ([], 0)
    assert records.session_checkpoint_stats(OTHER, [session_id]) == {}
    row = records.get_session(session_id, ME)
    assert row is not None and (row.tags_json, row.user_metadata_json, row.sdk_version) == ('["t"]', '{"k": "v"}',
                                                                                           "0.38.0")  # fmt: skip


def test_a_silent_session_expires_and_heartbeats_say_why(db: Database) -> None:
    records = db.records  # 600 s timeout
    session_id = records.create_session(ME, [], {}, None)
    assert records.heartbeat(session_id, ME) == "ok" and records.heartbeat("nope", ME) == "missing"
    _age(records, session_id, 590)
    assert records.get_session(session_id, ME).status == "active"  # type: ignore[union-attr]
    assert records.heartbeat(session_id, ME) == "ok"  # and it renews
    assert records.expire_sessions() == []
    _age(records, session_id, 610)
    assert records.get_session(session_id, ME).status == "expired"  # type: ignore[union-attr]
    assert [row.status for row in records.owner_sessions(ME)] == ["expired"]
    assert records.heartbeat(session_id, ME) == "gone"


def test_a_run_made_without_a_session_is_unloaded_once_idle_for_the_open_timeout(db: Database) -> None:
    """Runs created without a session (SDK 0.1-0.2, or any client that leaves session_id out) get an `open`
    session with no heartbeats, which never expired: a key could hold its runs for good. One none of whose
    runs finished a request within the open timeout (a day by default) now expires like a silent one."""
    records = db.records
    idle, used, young = (records.create_session(ME, [], {}, None, status="open") for _ in range(3))
    day = timedelta(seconds=86400 + 60)
    records.add_rows([_run(idle, 0, last_request_at=utcnow() - day), _run(used, 0, last_request_at=utcnow() - day),
                      _run(used, 1), _run(young, 0, last_request_at=utcnow() - day)])  # fmt: skip
    for session_id in (idle, used):
        records._update(SessionRow, session_id, created_at=utcnow() - day)
    forwarded = records.create_session(ME, [], {}, None, status="open")  # used by forwards alone
    records.add_rows([_run(forwarded, 0, last_request_at=utcnow() - day)])
    records._update(SessionRow, forwarded, created_at=utcnow() - day)
    db.queue.submit(kind="forward", payload=UnloadModelRequest(), owner=ME, model_id=f"{forwarded}:train:0")
    assert [run.id for run in records.expire_sessions()] == [f"{idle}:train:0"]
    statuses = {row.id: row.status for row in records.owner_sessions(ME)}
    assert statuses == {idle: "expired", used: "open", young: "open", forwarded: "open"}


def test_expiry_unloads_only_the_silent_sessions_ready_runs(db: Database) -> None:
    records = db.records
    silent, alive = records.create_session(ME, [], {}, None), records.create_session(ME, [], {}, None)
    records.add_rows([_run(silent, 0), _run(silent, 1, status="failed"), _run(alive, 0)])
    _age(records, silent, 601)
    assert [run.id for run in records.expire_sessions()] == [f"{silent}:train:0"]
    assert records.get_session(silent, ME).status == "expired"  # type: ignore[union-attr]
    assert records.get_session(alive, ME).status == "active"  # type: ignore[union-attr]
    assert records.expire_sessions() == []  # already expired: nothing again
    done = records.create_session(ME, [], {}, None)
    records.finish_session(done, ME, "closed")
    _age(records, done, 700)  # a finished session stays finished however old, a fresh one active
    assert {row.id: row.status for row in records.owner_sessions(ME)} == {
        silent: "expired", alive: "active", done: "finished"
    }  # fmt: skip


def test_finishing_a_session_once_returns_its_loaded_runs(db: Database) -> None:
    records = db.records
    session_id = records.create_session(ME, [], {}, None)
    records.add_rows([_run(session_id, 0), _run(session_id, 1, status="unloaded"), _run(session_id, 2)])
    runs = records.finish_session(session_id, ME, "client closed")
    assert sorted(run.id for run in runs or []) == [f"{session_id}:train:0", f"{session_id}:train:2"]
    assert records.finish_session(session_id, ME, "again") == []
    row = records.get_session(session_id, ME)
    assert row is not None and (row.status, row.finish_reason) == ("finished", "client closed")
    assert records.heartbeat(session_id, ME) == "gone"


def test_runs_an_ended_session_left_loaded_without_an_unload_are_stranded(db: Database) -> None:
    records = db.records
    done, alive, lapsed = (records.create_session(ME, [], {}, None) for _ in range(3))
    records.add_rows([_run(done, 0), _run(done, 1), _run(done, 2, status="unloaded"), _run(alive, 0),
                      _run(lapsed, 0)])  # fmt: skip
    records.finish_session(done, ME, "closed")  # its unload queueing is what failed: none was queued
    _age(records, lapsed, 700)
    mine = (done, alive, lapsed)  # the module's database holds other tests' ended sessions too
    ids = lambda: {run.id for run in records.stranded_runs() if run.session_id in mine}  # noqa: E731
    assert ids() == {f"{done}:train:0", f"{done}:train:1"}  # `lapsed` is past its timeout, not yet expired
    records.expire_sessions()
    assert ids() == {f"{done}:train:0", f"{done}:train:1", f"{lapsed}:train:0"}
    db.queue.submit(kind="unload_model", payload=UnloadModelRequest(), owner=ME, model_id=f"{done}:train:1")
    db.queue.submit(kind="sample", payload=UnloadModelRequest(), owner=ME, model_id=None)  # no model: no NULL trap
    assert ids() == {f"{done}:train:0", f"{lapsed}:train:0"}


def test_finishing_an_expired_or_open_session(db: Database) -> None:
    records = db.records
    lapsed, legacy = records.create_session(ME, [], {}, None), records.create_session(ME, [], {}, None, status="open")
    records.add_rows([_run(lapsed, 0), _run(legacy, 0)])
    _age(records, lapsed, 700)  # past its timeout, not yet reaped: its runs are still loaded
    assert [run.id for run in records.finish_session(lapsed, ME, "x") or []] == [f"{lapsed}:train:0"]
    _age(records, legacy, 10_000)  # an open session never expires
    assert records.get_session(legacy, ME).status == "open"  # type: ignore[union-attr]
    assert [run.id for run in records.finish_session(legacy, ME, "y") or []] == [f"{legacy}:train:0"]
    expired = records.create_session(ME, [], {}, None)
    records.add_rows([_run(expired, 0)])
    _age(records, expired, 700)
    records.expire_sessions()
    assert records.finish_session(expired, ME, "z") == []  # expiry already handed its runs over


def test_listings_show_only_visible_rows_newest_first_with_totals(db: Database) -> None:
    records = db.records
    session_id = records.create_session(ME, [], {}, None)
    start = utcnow()
    runs = [_run(session_id, i, status=s, created_at=start + timedelta(seconds=i))
            for i, s in enumerate(["ready", "pending", "unloaded", "failed", "ready"])]  # fmt: skip
    records.add_rows([*runs, _run("x", 0, owner=OTHER)])
    listed, total = records.list_runs(ME, 10, 0)
    assert [r.id for r in listed] == [runs[4].id, runs[2].id, runs[0].id] and total == 3
    page, total = records.list_runs(ME, 1, 1)
    assert [r.id for r in page] == [runs[2].id] and total == 3
    assert records.live_run_count() == 4  # pending and ready, every owner
    later = records.create_session(ME, [], {}, None)
    records._update(SessionRow, later, created_at=utcnow() + timedelta(seconds=5))
    assert records.list_sessions(ME, 10, 0) == [later, session_id] and records.list_sessions(ME, 1, 1) == [session_id]
    assert [row.id for row in records.owner_sessions(ME)] == [later, session_id]
    # a session lists the runs a reader can open: not those still being created or never created
    assert sorted(records.session_children(session_id)[0]) == sorted(runs[i].id for i in (0, 2, 4))
    # the search's reads: after a (created_at, id) cursor, by id, bounded
    assert [row.id for row in records.owner_sessions(ME, limit=1)] == [later]
    cursor = (records.get_session(later, ME).created_at, later)  # type: ignore[union-attr]
    assert [row.id for row in records.owner_sessions(ME, before=cursor)] == [session_id]
    tie = [row.id for row in records.owner_sessions(ME, before=(cursor[0], "\uffff"))]  # same time, larger id
    assert tie == [later, session_id]
    assert [row.id for row in records.owner_sessions(ME, session_id=later)] == [later]
    assert records.owner_sessions(OTHER, session_id=later) == []


def test_each_runs_newest_checkpoint_of_each_type(db: Database) -> None:
    """What a listing of runs shows as last_checkpoint / last_sampler_checkpoint: per run and type the newest
    listed one (not pending, not expired, not another owner's), in one call for every run."""
    records = db.records
    session_id = records.create_session(ME, [], {}, None)
    runs = [_run(session_id, i) for i in range(3)]
    start = utcnow()

    def at(run: TrainingRunRow, name: str, seconds: int, kind: str = "training", **kw: object) -> CheckpointRow:
        return _checkpoint(run.id, name, created_at=start + timedelta(seconds=seconds), checkpoint_type=kind, **kw)

    rows = [
        at(runs[0], "a", 0), at(runs[0], "b", 2), at(runs[0], "s", 1, "sampler"), at(runs[0], "s2", 3, "sampler"),
        at(runs[0], "later", 9, status="pending"), at(runs[0], "gone", 8, expires_at=start - timedelta(seconds=1)),
        at(runs[1], "only", 5, "sampler"),
    ]  # fmt: skip
    records.add_rows([*runs, *rows])
    latest = {key: row.checkpoint_id for key, row in records.latest_checkpoints(ME, [r.id for r in runs]).items()}
    assert latest == {
        (runs[0].id, "training"): "weights/b",
        (runs[0].id, "sampler"): "weights/s2",
        (runs[1].id, "sampler"): "weights/only",
    }
    assert records.latest_checkpoints(OTHER, [r.id for r in runs]) == {}
    assert records.latest_checkpoints(ME, []) == {}


def test_checkpoint_listing_lookup_expiry_and_stats(db: Database) -> None:
    records = db.records
    session_id = records.create_session(ME, [], {}, None)
    run = _run(session_id, 0)
    start = utcnow()
    rows = [
        _checkpoint(run.id, "a", size_bytes=3 << 30, created_at=start),
        _checkpoint(run.id, "b", size_bytes=None, created_at=start + timedelta(seconds=1)),
        _checkpoint(run.id, "c", status="pending", size_bytes=5),
        _checkpoint(run.id, "old", size_bytes=7, expires_at=utcnow() - timedelta(seconds=1)),
        _checkpoint(run.id, "later", size_bytes=11, expires_at=utcnow() + timedelta(hours=1)),
    ]
    records.add_rows([run, *rows])
    assert records.get_checkpoint(run.id, "weights/c", ME) is None
    assert records.get_checkpoint(run.id, "weights/c", ME, ready=False) is not None
    assert records.get_checkpoint(run.id, "weights/later", ME) is not None
    assert records.get_checkpoint(run.id, "weights/old", ME) is None  # expired: gone to its owner
    assert records.get_checkpoint(run.id, "weights/old", OTHER, expired=True) is None
    assert records.get_checkpoint(run.id, "weights/old", ME, expired=True) is not None  # for freeing its name
    listed, total = records.list_checkpoints(ME, run.id, 10, 0)
    assert total == 3 and {r.checkpoint_id for r in listed} == {"weights/a", "weights/b", "weights/later"}
    assert records.list_checkpoints(ME, "other:train:0", 10, 0) == ([], 0)
    assert records.session_checkpoint_stats(ME, [session_id]) == {session_id: (3, (3 << 30) + 11)}
    assert records.checkpoint_usage(ME) == (3, (3 << 30) + 11) and records.checkpoint_usage(OTHER) == (0, 0)
    assert [r.checkpoint_id for r in records.expired_checkpoints()] == ["weights/old"]
    with pytest.raises(IntegrityError):  # the same name twice in one run
        records.add_rows([_checkpoint(run.id, "a")])
    records.update_checkpoint(listed[0], size_bytes=1)
    records.delete_checkpoint(rows[1])
    records.delete_checkpoint(rows[1])  # gone already: nothing to do
    assert records.get_checkpoint(run.id, "weights/b", ME) is None


def test_metrics_newest_first_with_nan_back_and_a_limit(db: Database) -> None:
    records = db.records
    values = [1.0, None, math.inf, 4.0]
    records.add_rows([MetricRow(model_id="m", future_id=str(i), kind="k", name="loss", value=v)
                      for i, v in enumerate(values)] + [MetricRow(model_id="n", future_id="9", kind="k", name="x",
                                                                  value=0.0)])  # fmt: skip
    rows = records.latest_metrics("m")
    assert [r.future_id for r in rows] == ["3", "2", "1", "0"]
    assert rows[0].value == 4.0 and rows[1].value == math.inf and math.isnan(rows[2].value)  # type: ignore[arg-type]
    assert [r.future_id for r in records.latest_metrics("m", limit=2)] == ["3", "2"]
    records.add_rows([MetricRow(model_id="many", future_id=str(i), kind="k", name="x", value=i) for i in range(101)])
    assert len(records.latest_metrics("many")) == 100  # the default window


def test_a_repeated_sampling_session_returns_the_first_row(db: Database) -> None:
    records = db.records
    first = SamplingSessionRow(id="s:sample:0", session_id="s", owner=ME, base_model="b", model_path="p1")
    again = SamplingSessionRow(id="s:sample:0", session_id="s", owner=ME, base_model="b", model_path="p2")
    assert records.add_sampling_session(first).model_path == "p1"
    assert records.add_sampling_session(again).model_path == "p1"
    assert records.session_children("s")[1] == ["s:sample:0"]


def test_the_sweeper_sees_every_owners_expired_ready_checkpoints_oldest_first(db: Database) -> None:
    records = db.records
    now = utcnow()
    rows = [
        _checkpoint("r:train:0", "late", expires_at=now - timedelta(seconds=1)),
        _checkpoint("r:train:0", "early", owner=OTHER, expires_at=now - timedelta(hours=2)),
        _checkpoint("r:train:0", "writing", status="pending", expires_at=now - timedelta(hours=3)),
        _checkpoint("r:train:0", "fresh", expires_at=now + timedelta(minutes=1)),
        _checkpoint("r:train:0", "kept"),
    ]
    records.add_rows(rows)  # type: ignore[arg-type]
    assert [r.checkpoint_id for r in records.expired_checkpoints()] == ["weights/early", "weights/late"]
    assert [r.checkpoint_id for r in records.expired_checkpoints(limit=1)] == ["weights/early"]


def test_an_expired_checkpoints_removal_leaves_a_save_that_took_its_name_since(db: Database, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The sweeper reads an expired checkpoint, then a save over its name sets that row aside and writes into
    the same directory before the sweeper removes it: the save's files stay (they went with the old row, and
    the accepted save was lost). A checkpoint still as read goes, row and files, and leaves nothing behind."""
    from tx.api.paths import checkpoints_root
    from tx.api.routes_rest import remove_checkpoint

    records = db.records
    run = _run(records.create_session(ME, [], {}, None), 0)
    directories = {name: checkpoints_root(tmp_path) / run.id / "weights" / name for name in ("x", "y")}
    expired = utcnow() - timedelta(seconds=1)
    rows = {name: _checkpoint(run.id, name, expires_at=expired) for name in directories}
    for name, row in rows.items():
        row.directory = str(directories[name])
    records.add_rows([run, *rows.values()])
    for directory in directories.values():
        directory.mkdir(parents=True)
        (directory / "weights.bin").write_text("old")
    read = {r.checkpoint_id: r for r in records.expired_checkpoints()}
    records.set_aside(rows["x"])  # a save over "x" takes the name and writes its files
    (directories["x"] / "weights.bin").write_text("new")
    remove_checkpoint(records, tmp_path, read["weights/x"])
    assert (directories["x"] / "weights.bin").read_text() == "new"
    remove_checkpoint(records, tmp_path, read["weights/y"])
    assert not directories["y"].exists() and records.get_checkpoint(run.id, "weights/y", ME, expired=True) is None
    assert sorted(p.name for p in directories["y"].parent.iterdir()) == ["x"]


def test_a_sampler_another_request_inserted_meanwhile_is_returned_not_a_500(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create_sampling_session and its retry racing (on Postgres, or on two API processes) both found no
    row, and the second insert's IntegrityError was a 500. The loser returns the winner's row."""
    import sqlmodel

    first = SamplingSessionRow(id="s:sample:0", session_id="s", owner=ME, base_model="b")
    db.records.add_sampling_session(first)
    real_get, misses = sqlmodel.Session.get, iter([True])

    def racing_get(self, entity, ident, **kw):  # type: ignore[no-untyped-def]
        if next(misses, False):  # the other request's insert lands after this look
            return None
        return real_get(self, entity, ident, **kw)

    monkeypatch.setattr(sqlmodel.Session, "get", racing_get)
    kept = db.records.add_sampling_session(
        SamplingSessionRow(id="s:sample:0", session_id="s", owner=ME, base_model="b")
    )
    assert (kept.id, kept.base_model, kept.owner) == ("s:sample:0", "b", ME)


def test_run_creation_is_one_at_a_time_across_servers(db: Database) -> None:
    """`Records.run_creation` holds counting and inserting runs together across API processes (an advisory
    lock on Postgres), so racing creates cannot all find room."""
    import threading
    import time

    from tx.db import open_database

    other = open_database(db.engine.url.render_as_string(hide_password=False), ".") if db.listener else db
    entered = threading.Event()

    def second() -> None:
        with other.records.run_creation():
            entered.set()

    try:
        with db.records.run_creation():
            thread = threading.Thread(target=second)
            thread.start()
            time.sleep(0.3)
            assert not entered.is_set()  # the other server waits for this one's insert
        thread.join(10)
        assert entered.is_set()
    finally:
        if other is not db:
            other.close()
