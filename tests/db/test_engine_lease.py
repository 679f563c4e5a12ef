"""One engine per data directory and per database: a second is refused before its recovery can fail the
first one's running work (`tx.db.lease`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tx.api.__main__ import main
from tx.db import Database
from tx.db.lease import EngineBusy, take_engine_lease
from tx.protocol import SampleRequest, SamplingParams, WorkItem


def test_a_second_engine_on_the_same_data_or_database_is_refused(db: Database, tmp_path: Path) -> None:
    first = take_engine_lease(db.engine, tmp_path / "a")
    with pytest.raises(EngineBusy, match="data directory"):
        take_engine_lease(db.engine, tmp_path / "a")
    if db.engine.dialect.name == "postgresql":  # another directory, the same database (schema)
        with pytest.raises(EngineBusy, match="database"):
            take_engine_lease(db.engine, tmp_path / "b")
    else:
        take_engine_lease(db.engine, tmp_path / "b").release()
    first.release()
    take_engine_lease(db.engine, tmp_path / "a").release()  # released: the next engine takes it


def test_a_refused_engine_leaves_the_live_ones_work_alone(tmp_path: Path) -> None:
    """`python -m tx.api` started again on a live server's data directory exits naming it, and the request
    the live engine is running stays running (the second's `recover` would have failed it)."""
    from tx.db import open_database

    db = open_database(None, tmp_path)
    request = SampleRequest([1, 2], 1, SamplingParams(max_tokens=2), "m")
    future = db.queue.submit(kind="sample", payload=request, owner="owner", model_id="m").future_id
    (claimed,) = db.queue.claim(8)
    assert isinstance(claimed, WorkItem) and claimed.future_id == future
    lease = take_engine_lease(db.engine, tmp_path)  # the live engine's
    with pytest.raises(SystemExit, match=f"engine .* is running on the data directory {tmp_path}"):
        main(["--data-dir", str(tmp_path), "--base-model", str(tmp_path / "no-model"), "--port", "0"])
    row = db.queue.get(future)
    assert row is not None and row.status == "running"
    lease.release()
    db.close()
