"""A real server process killed with work in its queue, then started again on the same data directory.

The queue the dead process leaves is made exactly: the server is killed (SIGKILL) while idle, the SDK's
requests are then accepted by the real API routes (in this process, no engine: what the dead server's API
had accepted and its engine not yet taken) and one of them is claimed as a dying engine would have. After the
restart the claimed request fails (its effect is unknown), the queued ones that need nothing of the dead
process run (a new run, a run from a checkpoint, base-model and checkpoint samples), and the ones that needed
its memory (the trained run's next step, an ephemeral sampler) fail naming what was lost and how to restore it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import uvicorn

from e2e.conftest import KEY, _free_port
from e2e.test_roles import wait_ready
from tx.db import codec

pytestmark = pytest.mark.e2e
FLAGS = ["--max-lora-adapters", "8", "--max-lora-rank", "8", "--decode-rows", "8", "--max-seq-len", "128",
         "--log-level", "warning"]  # fmt: skip


def launch(model_dir: Path, data_dir: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tx.api", "--base-model", str(model_dir), "--data-dir", str(data_dir),
           "--port", str(port), *FLAGS]  # fmt: skip
    return subprocess.Popen(
        cmd, stdout=log.open("a"), stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )


@contextlib.contextmanager
def api_only(model_dir: Path, data_dir: Path, port: int) -> Iterator:
    """The server's HTTP half over its database, with no engine: requests are accepted and stay queued."""
    from tx.api.__main__ import build_catalog, parse_args
    from tx.api.app import create_app
    from tx.api.context import Settings
    from tx.db import open_database

    args = parse_args(["--base-model", str(model_dir), "--data-dir", str(data_dir), *FLAGS])
    db = open_database(None, data_dir)
    app = create_app(Settings(data_dir=data_dir), db, build_catalog(args, None))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield db
    finally:
        server.should_exit = server.force_exit = True  # the SDK's long polls would hold a graceful exit
        thread.join(10)
        db.close()


def rows(data_dir: Path) -> dict[int, tuple[str, str, str | None, bytes | None]]:
    """future id -> (kind, status, error, result) of every future."""
    with sqlite3.connect(data_dir / "smolgym.db") as conn:
        found = conn.execute("SELECT id, kind, status, error, result FROM futures").fetchall()
    return {row[0]: row[1:] for row in found}


def wait_for(data_dir: Path, done: callable, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while not done(found := rows(data_dir)):
        assert time.monotonic() < deadline, found
        time.sleep(0.1)
    return found


def test_queued_work_runs_after_a_restart_and_work_on_lost_state_fails_by_name(hf_models, tmp_path):
    import tinker
    from tinker import types

    model_dir, _ = hf_models("qwen3", 2, False)
    data_dir, port, log = tmp_path / "data", _free_port(), tmp_path / "server.log"
    server = launch(model_dir, data_dir, port, log)
    try:
        wait_ready(server, log, "SmolGym ready on")
        service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY)
        client = service.create_lora_training_client(base_model=str(model_dir), rank=4).result()
        tokens = np.random.RandomState(0).randint(0, 200, 12).tolist()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": np.ones(11, np.float32)},
        )
        state = client.save_state("kept").result()
        named = client.save_weights_for_sampler("named").result()
        ephemeral = client.save_weights_and_get_sampling_client().result()
        server.send_signal(signal.SIGKILL)
        server.wait(30)

        before = len(rows(data_dir))
        prompt, params = types.ModelInput.from_ints(tokens[:4]), types.SamplingParams(max_tokens=3, seed=1)
        with api_only(model_dir, data_dir, port) as db:
            requests = [
                lambda: client.forward_backward([datum], "cross_entropy"),  # claimed by the dying engine, below
                lambda: client.forward_backward([datum], "cross_entropy"),
                lambda: client.optim_step(types.AdamParams(learning_rate=1e-2)),
                lambda: ephemeral.sample(prompt, 1, params),
                lambda: service.create_sampling_client(base_model=str(model_dir)).result().sample(prompt, 2, params),
                lambda: service.create_sampling_client(model_path=named.path).result().sample(prompt, 2, params),
                lambda: service.create_lora_training_client(base_model=str(model_dir), rank=4),
                lambda: service.create_training_client_from_state(state.path),
            ]
            for n, send in enumerate(requests, 1):  # one at a time: the queue holds them in this order
                send()
                wait_for(data_dir, lambda found, n=n: len(found) == before + n, 30)
                if n == 1:
                    (claimed,) = db.queue.claim(10)
        queued = rows(data_dir)
        assert [queued[i][1] for i in sorted(queued)][before:] == ["running"] + ["pending"] * 7

        server = launch(model_dir, data_dir, port, log)
        found = wait_for(data_dir, lambda f: not {s for _, s, *_ in f.values()} & {"pending", "running"})
        after = [found[i] for i in sorted(found)][before:]
        assert [(kind, status) for kind, status, *_ in after] == [
            ("forward_backward", "failed"), ("forward_backward", "failed"), ("optim_step", "failed"),
            ("sample", "failed"), ("sample", "done"), ("sample", "done"), ("create_model", "done"),
            ("load_weights", "done"),
        ], after  # fmt: skip
        assert int(claimed.future_id) == sorted(found)[before] and "effect is unknown" in after[0][2]
        for _, _, error, _ in after[1:3]:
            assert f"model {client.model_id!r} lost its in-memory state" in error and state.path in error, error
        assert "lived in memory only and were lost" in after[3][2]
        assert [len(codec.decode(result).sequences) for *_, result in after[4:6]] == [2, 2]
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGKILL)
            server.wait(30)
