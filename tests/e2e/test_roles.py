"""Split roles on one Postgres: two `--role api` servers and one `--role engine`, real subprocesses.

Sixteen SDK clients (threads, tiny requests) train and sample through two balancers (one prefers server A,
the other B); server A is killed (SIGKILL) mid-run, its clients' connections drop and their retries land on
B, and A is started again while work is in flight (an API server must not fail work as left over). Every
request must complete exactly once: the futures table holds each client's calls once each, all `done`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from e2e.conftest import KEY, POSTGRES_URL, _free_port, postgres_schema_url
from e2e.tcp_proxy import FailoverProxy

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not POSTGRES_URL, reason="set SMOLGYM_TEST_POSTGRES_URL")]
CLIENTS, STEPS = 16, 3


def launch(role: str, url: str, data_dir: Path, model_dir: Path, log: Path, port: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tx.api", "--role", role, "--database-url", url, "--data-dir", str(data_dir),
           "--base-model", str(model_dir), "--port", str(port), "--max-lora-adapters", "32",
           "--max-lora-rank", "8", "--decode-rows", "8", "--max-seq-len", "128", "--log-level", "warning"]  # fmt: skip
    return subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )


def wait_ready(proc: subprocess.Popen, log: Path, line: str, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while line not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def client_loop(url: str, base_model: str, index: int, progress: list[int], out: dict) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    client = service.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
    rng = np.random.RandomState(index)
    tokens = rng.randint(0, 200, 16).tolist()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": np.ones(15, np.float32)},
    )
    losses, seconds = [], []
    for _ in range(STEPS):
        start = time.time()
        losses.append(client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        seconds.append(time.time() - start)
        progress[index] += 1
    sampler = client.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=index)
    sample = sampler.sample(types.ModelInput.from_ints(tokens[:4]), 2, params).result()
    out[index] = (client.model_id, losses, seconds, [len(s.tokens) for s in sample.sequences])


def futures_by_run(url: str) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """kind counts per run, and the status counts of every future."""
    from sqlalchemy import create_engine, text

    engine = create_engine("postgresql+psycopg://" + url.split("://", 1)[1])
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT model_id, kind, status FROM futures")).all()
    engine.dispose()
    kinds: dict[str, dict[str, int]] = {}
    statuses: dict[str, int] = {}
    for model_id, kind, status in rows:
        per_run = kinds.setdefault(str(model_id), {})
        per_run[kind] = per_run.get(kind, 0) + 1
        statuses[status] = statuses.get(status, 0) + 1
    return kinds, statuses


def test_two_api_servers_one_engine_survive_a_killed_server(hf_models, tmp_path):
    model_dir, _ = hf_models("qwen3", 2, False)
    url, data_dir = postgres_schema_url(), tmp_path / "data"
    logs = {name: tmp_path / f"{name}.log" for name in ("engine", "a", "b")}
    engine = launch("engine", url, data_dir, model_dir, logs["engine"])
    ports = {"a": _free_port(), "b": _free_port()}
    apis = {name: launch("api", url, data_dir, model_dir, logs[name], ports[name]) for name in ports}
    procs = [engine, *apis.values()]
    try:
        wait_ready(engine, logs["engine"], "SmolGym engine ready")
        for name, proc in apis.items():
            wait_ready(proc, logs[name], "SmolGym ready on")
        balancers = [FailoverProxy([ports["a"], ports["b"]]), FailoverProxy([ports["b"], ports["a"]])]
        progress, results = [0] * CLIENTS, {}
        threads = [
            threading.Thread(target=client_loop, args=(balancers[i % 2].url, str(model_dir), i, progress, results))
            for i in range(CLIENTS)
        ]
        for thread in threads:
            thread.start()
        deadline = time.time() + 600
        while min(progress) < 1 and time.time() < deadline:  # every client is mid-run: kill A
            time.sleep(0.1)
        apis["a"].send_signal(signal.SIGKILL)
        apis["a"].wait(10)
        time.sleep(2)  # A's clients retry against B meanwhile
        failed_over = balancers[0].routed[ports["b"]]
        # A restarted while work is queued and running: an API server must not fail it as left over
        procs.append(restarted := launch("api", url, data_dir, model_dir, logs["a"], ports["a"]))
        wait_ready(restarted, logs["a"], "SmolGym ready on")
        assert len(results) < CLIENTS, "the clients finished before A came back; the test checks nothing"
        for thread in threads:
            thread.join(max(1.0, deadline - time.time()))
        assert len(results) == CLIENTS, (progress, logs["b"].read_text()[-3000:], logs["engine"].read_text()[-3000:])
        assert failed_over > 0 and apis["b"].poll() is None and restarted.poll() is None
        assert engine.poll() is None
        kinds, statuses = futures_by_run(url)
        assert statuses == {"done": sum(statuses.values())}, statuses
        for model_id, losses, _seconds, lengths in results.values():
            assert kinds[model_id] == {"create_model": 1, "forward_backward": STEPS, "optim_step": STEPS,
                                       "save_weights_for_sampler": 1}, kinds[model_id]  # fmt: skip
            assert losses[-1] < losses[0] and len(lengths) == 2 and all(1 <= n <= 4 for n in lengths)  # EOS may stop
        samples = [k for k in kinds.values() if "sample" in k]  # keyed by sampling session
        assert samples == [{"sample": 1}] * CLIENTS, kinds
        # long polls on an API server are woken by the engine's NOTIFY: without it every step (two polls)
        # would wait out two 25 s holds
        assert np.median([s for *_, seconds, _ in results.values() for s in seconds]) < 25
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
