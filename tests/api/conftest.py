"""A real uvicorn server (in-process, loopback, free port) driven by the FakeRunner.

The session fixture `server` yields (base_url, runner, db); tests talk to it with the real
`tinker` SDK or plain httpx.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from api.fake_runner import FakeRunner
from api.harness import KEY, MODEL, Server
from tx.api.app import create_app
from tx.api.context import Settings
from tx.db import open_database
from tx.engine.loop import Engine

os.environ["TINKER_TELEMETRY"] = "0"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("smolgym-data")
    db = open_database(None, data_dir)
    db.queue.recover()
    runner = FakeRunner()
    engine = Engine(db.queue, runner)
    engine.start()
    settings = Settings(data_dir=data_dir, retrieve_hold_s=1.0)
    port = _free_port()
    config = uvicorn.Config(create_app(settings, db, MODEL), host="127.0.0.1", port=port, log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not uv.started and time.time() < deadline:
        time.sleep(0.02)
    yield Server(f"http://127.0.0.1:{port}", runner, db, data_dir)
    uv.should_exit = True
    thread.join(5)
    engine.stop()
    db.close()


@pytest.fixture(scope="session")
def service(server: Server):
    import tinker

    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    yield client
    client.close("success").result()


@pytest.fixture(scope="session")
def training(service):
    return service.create_lora_training_client(base_model=MODEL.base_model, rank=8).result()
