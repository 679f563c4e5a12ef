"""One engine over two processes (JAX's distributed runtime, gloo on CPU) against one process on four devices.

Two `python -m tx.api` processes with two simulated CPU devices each form one fsdp=2 x tp=2 mesh (fsdp
across the processes, tp within each); the reference is an in-process server on four devices with the same
mesh. The SDK's supervised loop, save_state / load_state, a named PEFT export, a seeded sample and two rounds
of the RL loop (sample the run's weights, train on the samples with importance_sampling) must give the same
losses, logprobs, adapter tensors and tokens. Then the follower is killed while a request is in
flight and another is queued: the leader must fail the first naming the lost process and exit with status 3
within the bound, leaving the second queued; both processes started again run it.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from e2e.conftest import KEY, _free_port, start_server
from e2e.rl_data import rl_batch
from e2e.test_roles import wait_ready

pytestmark = pytest.mark.e2e
FLAGS = ["--max-lora-adapters", "16", "--max-lora-rank", "16", "--decode-rows", "16", "--max-seq-len", "256",
         "--fsdp-size", "2", "--tensor-parallel-size", "2", "--log-level", "warning"]  # fmt: skip
LOST_BOUND_S = 20


def launch(
    process_id: int, coordinator: str, model_dir: Path, data_dir: Path, port: int, log: Path
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tx.api", "--coordinator", coordinator, "--num-processes", "2",
           "--process-id", str(process_id), "--base-model", str(model_dir), "--data-dir", str(data_dir),
           "--port", str(port), *FLAGS]  # fmt: skip
    # The session's flags (its cheap CPU compiles) with this process's own device count.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform" not in f]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join([*flags, "--xla_force_host_platform_device_count=2"]),
    }
    return subprocess.Popen(cmd, stdout=log.open("a"), stderr=subprocess.STDOUT, env=env)


def workload(url: str, base_model: str, data_dir: Path) -> dict:
    """A few SL steps, save_state / load_state, a named PEFT export, a seeded sample, two RL rounds."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    client = service.create_lora_training_client(base_model=base_model, rank=4, seed=3).result()
    tokens = np.random.RandomState(0).randint(0, 200, 24).tolist()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": np.ones(23, np.float32)},
    )
    losses = []
    for _ in range(3):
        out = client.forward_backward([datum], "cross_entropy").result()
        losses.append(out.metrics["loss:sum"])
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = client.save_state("after-3").result()
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # moves the weights past the checkpoint
    client.load_state(state.path).result()
    reloaded = client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    sampler = client.save_weights_for_sampler("exported").result()
    peft = load_file(next(data_dir.glob("checkpoints/*/sampler_weights/exported/adapter_model.safetensors")))
    sampling = service.create_sampling_client(model_path=sampler.path).result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    sample = sampling.sample(types.ModelInput.from_ints(tokens[:5]), 2, params).result()
    rl_sampled, rl_logprobs = [], []
    for round_ in range(2):
        data = rl_batch(client, tokens[:5], seed=11 + round_)
        rl_sampled.append([d.model_input.to_ints() for d in data])
        rl_out = client.forward_backward(data, "importance_sampling").result()
        rl_logprobs.append(np.concatenate([o["logprobs"].to_numpy() for o in rl_out.loss_fn_outputs]).tolist())
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after_rl = client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    service.close("success").result(timeout=30)
    return {
        "losses": losses,
        "logprobs": out.loss_fn_outputs[0]["logprobs"].tolist(),
        "reloaded": reloaded,
        "peft": peft,
        "tokens": [s.tokens for s in sample.sequences],
        "sample_logprobs": [s.logprobs for s in sample.sequences],
        "rl_sampled": rl_sampled,
        "rl_logprobs": rl_logprobs,
        "after_rl": after_rl,
    }


@dataclass
class TwoProcesses:
    leader: subprocess.Popen
    follower: subprocess.Popen
    logs: list[Path]
    url: str
    data_dir: Path
    model_dir: Path


def start_pair(model_dir: Path, data_dir: Path, tmp: Path) -> TwoProcesses:
    """Both processes on `data_dir` (appending to their logs in `tmp`), once both say they are ready."""
    port, coordinator = _free_port(), f"127.0.0.1:{_free_port()}"
    logs = [tmp / "leader.log", tmp / "follower.log"]
    follower = launch(1, coordinator, model_dir, data_dir, 0, logs[1])
    leader = launch(0, coordinator, model_dir, data_dir, port, logs[0])
    pair = TwoProcesses(leader, follower, logs, f"http://127.0.0.1:{port}", data_dir, model_dir)
    try:
        wait_ready(leader, logs[0], "SmolGym ready on")
        wait_ready(follower, logs[1], "SmolGym follower ready")
    except BaseException:
        stop_pair(pair)
        raise
    return pair


def stop_pair(pair: TwoProcesses) -> None:
    for proc in (pair.leader, pair.follower):
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(30)


@pytest.fixture(scope="module")
def two(hf_models, tmp_path_factory) -> Iterator[TwoProcesses]:
    model_dir, _ = hf_models("qwen3", 2, False)
    tmp = tmp_path_factory.mktemp("multihost")
    pair = start_pair(model_dir, tmp / "data", tmp)
    try:
        yield pair
    finally:
        stop_pair(pair)


def test_two_processes_compute_what_one_does(two: TwoProcesses, tmp_path):
    got = workload(two.url, str(two.model_dir), two.data_dir)
    ref_url, stop_reference = start_server(two.model_dir, tmp_path, fsdp_size=2, tensor_parallel_size=2)
    try:
        want = workload(ref_url, str(two.model_dir), tmp_path)
    finally:
        stop_reference()
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["logprobs"], want["logprobs"], rtol=1e-5, atol=1e-6)
    assert got["reloaded"] == pytest.approx(want["reloaded"], rel=1e-5)
    assert got["peft"].keys() == want["peft"].keys()
    for name, tensor in want["peft"].items():
        np.testing.assert_allclose(got["peft"][name], tensor, rtol=1e-5, atol=1e-7, err_msg=name)
    assert got["tokens"] == want["tokens"]
    np.testing.assert_allclose(got["sample_logprobs"], want["sample_logprobs"], rtol=1e-5, atol=1e-6)
    assert got["rl_sampled"] == want["rl_sampled"]
    for got_round, want_round in zip(got["rl_logprobs"], want["rl_logprobs"], strict=True):
        np.testing.assert_allclose(got_round, want_round, rtol=1e-5, atol=1e-6)
    # The RL steps' updates: the same weights after them, which differ from the weights before them.
    np.testing.assert_allclose(got["after_rl"], want["after_rl"], rtol=1e-5, atol=1e-6)
    assert np.abs(np.subtract(got["after_rl"], got["logprobs"])).max() > 1e-3


def test_a_lost_follower_fails_in_flight_work_and_stops_the_leader_and_queued_work_runs_after_a_restart(
    two: TwoProcesses,
):
    """The follower stops (SIGSTOP) so that the leader's next request is in flight for certain, and a sample
    queued behind it waits (the engine is stuck in that request's collective); then the follower dies. Both
    processes started again on the same data directory run the queued sample."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=two.url, api_key=KEY)
    db, log = two.data_dir / "smolgym.db", two.logs[0]
    running_before, samples_done = len(futures(db, "running")), futures(db, "done").count("sample")
    sampling = service.create_sampling_client(base_model=str(two.model_dir)).result()
    two.follower.send_signal(signal.SIGSTOP)
    service.create_lora_training_client(base_model=str(two.model_dir), rank=4)  # not awaited: never answered
    deadline = time.monotonic() + 60
    while len(futures(db, "running")) == running_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(futures(db, "running")) > running_before, "the request never reached the engine"
    sampling.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=3, seed=2))
    while futures(db, "pending") != ["sample"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert futures(db, "pending") == ["sample"], futures(db, "running")
    two.follower.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    rc = two.leader.wait(LOST_BOUND_S)
    assert rc == 3 and time.monotonic() - killed_at < LOST_BOUND_S, log.read_text()[-3000:]
    lost = [error for error in futures(db, "failed") if "engine process 1 of 2 is gone" in error]
    assert len(lost) == 1 and not futures(db, "running"), futures(db, "failed")
    assert "engine process 1 of 2 is gone" in log.read_text()
    assert futures(db, "pending") == ["sample"]  # the exit left the queued work queued

    again = start_pair(two.model_dir, two.data_dir, log.parent)
    try:
        deadline = time.monotonic() + 120
        while (futures(db, "pending") or futures(db, "running")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert futures(db, "done").count("sample") == samples_done + 1, (futures(db, "failed"), log.read_text()[-3000:])
    finally:
        stop_pair(again)


def futures(db: Path, status: str) -> list[str]:
    """The error text (or kind) of every future with `status`."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT kind, error FROM futures WHERE status = ?", (status,)).fetchall()
    return [error or kind for kind, error in rows]
