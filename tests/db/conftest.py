"""Database fixtures: a fresh SQLite database per test, and Postgres when SMOLGYM_TEST_POSTGRES_URL is set."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tx.db import Database, open_database

POSTGRES_URL = os.environ.get("SMOLGYM_TEST_POSTGRES_URL")


def _postgres_database() -> Database:
    """A fresh schema on the test server so runs never see each other's rows."""
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    assert POSTGRES_URL is not None
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in POSTGRES_URL else "?"
    return open_database(f"{POSTGRES_URL}{sep}options=-csearch_path%3D{schema}", ".")


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "postgres":
        if not POSTGRES_URL:
            pytest.skip("set SMOLGYM_TEST_POSTGRES_URL to run the Postgres variant")
        database = _postgres_database()
    else:
        database = open_database(None, tmp_path)
    yield database
    database.close()
