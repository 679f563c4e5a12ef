"""One engine over several processes (hosts), on JAX's multi-controller runtime (`jax.distributed`).

Every process runs the same model pool over one global mesh of all processes' devices, and each jitted
program must be issued by every process in the same order. Process 0 (the leader) owns the queue and
the HTTP server; the others (followers) have neither. The seam is the `Runner` protocol of
`tx.engine.loop`: the leader's `Engine` drives a `LeaderRunner`, which sends every call that changes the
runner (`submit`, `step`, `discard`) to the followers before making it itself, and each follower makes the
same calls on its own pool in the same order (`follow`). A runner's decisions depend only on those calls
(no clocks, no threads; string hashing is pinned by `PYTHONHASHSEED`, part of the fingerprint), so the
processes stay in step; the one host-side draw, a sample request's seed when the client gave none, is made
by the leader before the call is sent. Results are made on every process and kept by the leader alone.

At start the processes exchange a `fingerprint` (code, JAX version, engine flags, models, devices, hash
seed) and any difference refuses the start, named. Later, a follower that dies or stops answering makes
the leader fail its in-flight work and exit (`tx.api.cluster`); a follower whose leader is gone exits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import jax

from tx.engine.config import EngineConfig
from tx.engine.loop import Completion, Runner
from tx.engine.plan_channel import Follower, Leader, LeaderLost
from tx.models.catalog import locate_model
from tx.models.safetensors_io import shard_files
from tx.protocol import RequestError, SampleRequest, WorkItem

log = logging.getLogger("tx.engine")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process stands: `coordinator` HOST:PORT of process 0 (None: detected by JAX from the
    cluster's environment, e.g. Slurm), `num_processes` and `process_id` (None with detection)."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None


def initialize(cluster: Cluster) -> None:
    """Join the distributed system. CPU devices' collectives go over gloo (TCP between the processes); the
    setting leaves accelerators' own collectives alone."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id)
    log.info("process %d of %d, %d local devices of %d", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())  # fmt: skip


def fingerprint(config: EngineConfig, models: Sequence[str], data_dir: Path) -> dict[str, str]:
    """What must agree between the processes of one engine, as readable strings."""
    flags = dataclasses.replace(config, data_dir=Path(data_dir).resolve(), base_model="")
    return {
        "code": _code_digest(),
        "jax": jax.__version__,
        "engine flags": repr(flags),
        "models": ", ".join(f"{name}={_model_digest(name)}" for name in models),
        "local devices": f"{jax.local_device_count()} x {jax.local_devices()[0].platform}",
        "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "unset"),
    }


def _code_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _model_digest(name: str) -> str:
    """config.json and the safetensors headers (names, shapes, dtypes): enough to tell two checkpoints apart
    without reading their weights."""
    model_dir = locate_model(name)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for file in shard_files(model_dir):
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            digest.update(f.read(size))
    return digest.hexdigest()[:16]


class LeaderRunner:
    """Process 0's runner: every state-changing call goes to the followers first, then to `runner`."""

    def __init__(self, runner: Runner, channel: Leader, verdict_s: float = 5.0) -> None:
        self.runner, self.channel = runner, channel
        self.verdict_s = verdict_s  # how long a failed step waits for the watchers' word on the followers
        self.broadcast_s = 0.0  # total seconds spent sending calls (benchmarks/multihost.py)
        self.broadcasts = 0

    def submit(self, items: Sequence[WorkItem]) -> None:
        items = [pin_seed(item) for item in items]
        self._send("submit", items)
        try:
            self.runner.submit(items)
        except Exception:
            self._hold_if_a_follower_is_lost()
            raise

    def step(self) -> list[Completion]:
        self._send("step")
        try:
            done = self.runner.step()
        except Exception:
            self._hold_if_a_follower_is_lost()
            raise
        if any(isinstance(c.result, RequestError) and c.result.category == "server" for c in done):
            self._hold_if_a_follower_is_lost()
        return done

    def _hold_if_a_follower_is_lost(self) -> None:
        """A step that failed work may have failed it in a collective on a follower that died ("Gloo
        AllGather failed: connection reset"); the watcher sees the same dead process on its own connection
        within moments and fails the in-flight work with the reason before the process exits. This thread
        must not fail that work first with the transport's words, nor run the queued work into the same dead
        peer: once a loss is reported it waits for the exit. With every follower alive it returns."""
        if self.channel.wait_lost(self.verdict_s):
            log.error("a step failed while a follower was lost; waiting for the leader to exit")
            threading.Event().wait()

    def parked(self) -> int:
        """The inner runner's requests waiting for a model load (`Engine._parked`)."""
        return int(getattr(self.runner, "parked", lambda: 0)())

    def discard(self, future_ids: Sequence[str]) -> None:
        self._send("discard", list(future_ids))
        getattr(self.runner, "discard", lambda _: None)(future_ids)

    def idle(self) -> bool:
        return self.runner.idle()

    def close(self) -> None:
        """Tell the followers to stop (the leader is shutting down in order)."""
        self._send("close")

    def _send(self, call: str, *args: object) -> None:
        start = time.perf_counter()
        self.channel.send((call, *args))
        self.broadcast_s += time.perf_counter() - start
        self.broadcasts += 1


def pin_seed(item: WorkItem) -> WorkItem:
    """A sample request without a seed gets one drawn here, once, so every process samples with it."""
    req = item.payload
    if not isinstance(req, SampleRequest) or req.params.seed is not None:
        return item
    params = dataclasses.replace(req.params, seed=secrets.randbits(64))
    log.info("request %s samples with seed %d", item.future_id, params.seed)
    return dataclasses.replace(item, payload=dataclasses.replace(req, params=params))


def follow(runner: Runner, channel: Follower) -> None:
    """A follower's life (`channel` started): make the leader's calls on `runner`, in order, until the leader
    closes (return) or is gone (exit non-zero). Results are dropped (the leader keeps its own); a call that
    raises raised on the leader too."""
    print("SmolGym follower ready", flush=True)
    while True:
        try:
            call, *args = channel.receive()
        except LeaderLost as err:
            log.error("%s; this follower exits", err)
            sys.exit(f"error: {err}")
        if call == "close":
            return
        try:
            getattr(runner, call)(*args)
        except Exception:  # the leader's engine sees the same exception and handles it (discard follows)
            log.debug("%s raised here as on the leader", call, exc_info=True)
