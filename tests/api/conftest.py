"""A real uvicorn server (in-process, loopback, free port) driven by the FakeRunner.

The session fixture `server` yields (base_url, runner, db); tests talk to it with the real
`tinker` SDK or plain httpx.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
import tinker

from api.fake_runner import FakeRunner
from api.harness import KEY, MODEL, OTHER_KEY, Server, running_server

os.environ["TINKER_TELEMETRY"] = "0"


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("smolgym-data")
    runner = FakeRunner()
    with running_server(runner, MODEL, data_dir) as (url, db):
        yield Server(url, runner, db, data_dir)


@pytest.fixture(scope="session")
def service(server: Server):
    import tinker

    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    yield client
    client.close("success").result()


@pytest.fixture(scope="session")
def training(service):
    return service.create_lora_training_client(base_model=MODEL.base_model, rank=8, seed=0).result()


# Clients shared by the API test modules (module-scoped: each module gets its own connections).
@pytest.fixture(scope="module")
def http(server: Server) -> httpx.Client:
    return httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": KEY}, timeout=30)


@pytest.fixture(scope="module")
def other(server: Server) -> httpx.Client:
    return httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": OTHER_KEY}, timeout=30)


@pytest.fixture(scope="module")
def rest(server: Server) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.url, api_key=KEY)
