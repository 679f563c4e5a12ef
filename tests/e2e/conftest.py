"""A real SmolGym server (JAX engine + uvicorn, in-process on a free loopback port) on a tiny model.

`live` is parametrized over the queue backend: SQLite always, PostgreSQL when SMOLGYM_TEST_POSTGRES_URL
is set (`.ci/run` starts one). Session scope, so each backend starts one server for the whole suite.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn

os.environ["TINKER_TELEMETRY"] = "0"
KEY = "tml-e2e"
POSTGRES_URL = os.environ.get("SMOLGYM_TEST_POSTGRES_URL")


@dataclass
class LiveServer:
    url: str
    model_dir: Path
    base_model: str
    torch_model: object
    data_dir: Path
    backend: str = "sqlite"
    database_url: str | None = None  # None: SQLite in data_dir


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(
    model_dir: Path | str,
    data_dir: Path,
    database_url: str | None = None,
    max_lora_adapters: int = 16,
    fsdp_size: int = 1,
    tensor_parallel_size: int = 1,
    max_run_state_bytes: int | None = None,
) -> tuple[str, callable]:
    """Runs are never evicted and most e2e tests leave theirs loaded: the shared server needs a slot per
    run of the whole session (the old-SDK client alone leaves two), plus room for sampler snapshots.
    `model_dir` may be a hub name the local HF cache holds."""
    from tx.api.app import create_app
    from tx.api.context import Settings
    from tx.db import open_database
    from tx.engine import AdapterConfig, EngineConfig, build_runner
    from tx.engine.loop import Engine
    from tx.engine.run_memory import RunMemory
    from tx.engine.sampler import SamplerConfig

    db = open_database(database_url, data_dir)
    db.queue.recover()
    runner, info = build_runner(
        EngineConfig(base_model=str(model_dir), data_dir=data_dir, fsdp_size=fsdp_size,
            tensor_parallel_size=tensor_parallel_size, adapters=AdapterConfig(max_lora_adapters, 16),
            sampler=SamplerConfig(max_rows=16, max_seq_len=256)),
        run_memory=RunMemory(max_run_state_bytes),
    )  # fmt: skip
    engine = Engine(db.queue, runner)
    engine.start()
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(Settings(data_dir=data_dir), db, info), host="127.0.0.1", port=port, log_level="warning"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)
        engine.stop()
        db.close()

    return f"http://127.0.0.1:{port}", stop


def postgres_schema_url() -> str:
    """A fresh schema on the test server (SMOLGYM_TEST_POSTGRES_URL), so runs never see each other's rows."""
    import psycopg

    assert POSTGRES_URL is not None
    schema = f"e2e_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in POSTGRES_URL else "?"
    return f"{POSTGRES_URL}{sep}options=-csearch_path%3D{schema}"


def database_for(backend: str) -> str | None:
    """The database URL for a backend name (None = SQLite in the data dir); skips Postgres when unset."""
    if backend == "sqlite":
        return None
    if not POSTGRES_URL:
        pytest.skip("set SMOLGYM_TEST_POSTGRES_URL to run the Postgres variant")
    return postgres_schema_url()


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def live(request, hf_models, tmp_path_factory) -> Iterator[LiveServer]:
    database_url = database_for(request.param)
    model_dir, torch_model = hf_models("qwen3", 2, False)
    data_dir = tmp_path_factory.mktemp(f"e2e-data-{request.param}")
    url, stop = start_server(model_dir, data_dir, database_url)
    yield LiveServer(url, model_dir, str(model_dir), torch_model, data_dir, request.param, database_url)
    stop()


@pytest.fixture(scope="session")
def service(live: LiveServer):
    import tinker

    client = tinker.ServiceClient(base_url=live.url, api_key=KEY)
    yield client
